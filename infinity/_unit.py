"""A fetch unit: the parameters owned directly by one submodule, gathered and released together.

Note [shard layout]: bandwidth-centric partitioning (paper 002 §6.1). Every parameter is
flattened, padded to a multiple of the world size N and split into N equal chunks; rank r
holds chunk r of every parameter of the unit, concatenated in parameter order, as the unit's
*shard* (``shard_numel`` elements). An all-gather of the shards yields an (N, shard_numel)
buffer whose column block [offset, offset + chunk) holds one parameter, rank-major; copying
that block out (a view when N == 1) rebuilds the full parameter. The reduce-scatter of
gradients uses the same layout in reverse, so rank r receives exactly the gradient of its
chunks. The optimizer's fp32 master weights, moments and gradient shards of a unit use the
same shard layout (see ``FetchUnit.opt_offset``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
from torch import nn

from . import _accelerator as acc
from . import _comm as comm
from ._param import ParamInfo, ParamState, raw_data, register, set_data

if TYPE_CHECKING:
    from ._engine import Engine


def padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


class FetchUnit:
    """The directly-owned parameters of one module and their shard on this rank."""

    def __init__(self, engine: "Engine", index: int, module_name: str, params: List[Tuple[str, nn.Parameter]],
                 *, partitioned: bool):
        self.engine = engine
        self.index = index  # position in the engine's unit list: the order of collectives
        self.module_name = module_name
        self.world_size = engine.world_size
        self.rank = engine.rank
        self.partitioned = partitioned
        self.params: List[nn.Parameter] = []
        self.infos: List[ParamInfo] = []
        offset = 0
        self._init_units = [_init_unit_of(p) for _, p in params]  # built under infinity.Init
        for init_unit, (name, _) in zip(self._init_units, params):
            if init_unit is not None and init_unit.world_size != self.world_size:
                raise RuntimeError(
                    f"{name} was partitioned by infinity.Init over {init_unit.world_size} rank(s) but this job "
                    f"has {self.world_size}: build the model under Init in the same job (same world size) that "
                    f"calls infinity.initialize")
        for name, p in params:
            info = ParamInfo(name, p.shape, p.numel(), padded(p.numel(), self.world_size), offset, self)
            register(p, info)
            self.params.append(p)
            self.infos.append(info)
            offset += info.chunk
        self.shard_numel = offset
        self.opt_offset = 0  # start of this unit's range in the optimizer's flat fp32 space
        self._staged: Optional[torch.Tensor] = None  # pool buffer holding the shard read from NVMe
        self._state = ParamState.AVAILABLE
        self._refs = 0
        self._gather_out: Optional[torch.Tensor] = None
        self._gather_handle: Optional[comm.CommHandle] = None
        self._charged = 0
        self.grads_pending = 0  # params whose gradient has not arrived in this backward

    # ------------------------------------------------------------ state

    @property
    def state(self) -> ParamState:
        return self._state

    @property
    def full_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def __repr__(self) -> str:
        return f"FetchUnit({self.module_name or '<root>'}, {len(self.params)} params, {self.state.name})"

    # ------------------------------------------------------------ shard <-> full

    def local_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard, from the full parameters or from chunks made by infinity.Init."""
        if not any(self._init_units):
            return self.shard_of([raw_data(p) for p in self.params], dtype)
        out = torch.empty(self.shard_numel, dtype=dtype, device=acc.device())
        for info, p, iu in zip(self.infos, self.params, self._init_units):
            src = iu.chunk() if iu is not None else self.chunks_of(raw_data(p), info)[self.rank]
            out[info.shard_offset : info.shard_offset + info.chunk].copy_(src)
        return out

    def materialize_init_params(self) -> None:
        """Stages 1-2 keep parameters whole: gather what Init partitioned."""
        from ._param import make_plain

        for p, iu in zip(self.params, self._init_units):
            if iu is not None:
                set_data(p, iu.materialize())
                make_plain(p)
        self._init_units = [None] * len(self.params)

    def forget_init(self) -> None:
        self._init_units = [None] * len(self.params)

    def chunks_of(self, full: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        """The (N, chunk) view of one parameter's padded, flattened values."""
        flat = full.reshape(-1)
        pad = info.padded_numel - info.numel
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.world_size, info.chunk)

    def shard_of(self, tensors: List[torch.Tensor], dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's shard of full tensors laid out like the unit's parameters."""
        out = torch.empty(self.shard_numel, dtype=dtype, device=acc.device()) if out is None else out
        with torch.no_grad():
            for info, t in zip(self.infos, tensors):
                out[info.shard_offset : info.shard_offset + info.chunk].copy_(self.chunks_of(t, info)[self.rank])
        return out

    @property
    def store(self):
        return self.engine.optimizer.param_store

    def partition(self) -> None:
        """AVAILABLE -> RELEASED for the first time: keep only this rank's shard (stage 3),
        written to the parameter store (unless that store is the fp32 master itself)."""
        assert self.partitioned and self._state is ParamState.AVAILABLE
        if not self.engine.optimizer.aliased:
            self.store.write(self.opt_offset, self.local_shard(self.dtype))
        self._drop_full()

    def shard(self) -> torch.Tensor:
        """This rank's compute-dtype shard where it is resident (device or cpu tier)."""
        return self.store.view(self.opt_offset, self.shard_numel)

    def _placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=acc.device())

    def _drop_full(self) -> None:
        for p in self.params:
            set_data(p, self._placeholder())
        self._state = ParamState.RELEASED

    # ------------------------------------------------------------ fetch / release

    def acquire(self) -> None:
        """Take a reference; gather if this is the first. Pairs with ``release``."""
        self._refs += 1
        if self._state is ParamState.AVAILABLE:
            return
        if self._state is not ParamState.GATHERING:
            self.start_gather()
        self.wait_gather()

    def release(self) -> None:
        """Drop a reference; free the full tensors when it was the last."""
        if self._refs <= 0:
            raise AssertionError(f"{self!r} released more often than acquired")
        self._refs -= 1
        if self._refs == 0 and self.partitioned and self._state is ParamState.AVAILABLE:
            self._drop_full()
            acc.budget.release(self._charged)
            self._charged = 0

    def stage_to_host(self) -> None:
        """RELEASED -> HOST: read the shard from NVMe into a pool buffer (resident tiers skip)."""
        assert self._state is ParamState.RELEASED, self._state
        if not self.store.resident:
            self._staged = self.store.read_into(self.opt_offset, self.shard_numel)
        self._state = ParamState.HOST

    def stage_to_device(self) -> None:
        """HOST -> DEVICE: the shard is where the all-gather reads it (a no-op without CUDA)."""
        assert self._state is ParamState.HOST, self._state
        self._state = ParamState.DEVICE

    def _device_shard(self) -> torch.Tensor:
        src = self._staged[: self.shard_numel] if self._staged is not None else self.shard()
        return acc.to_device(src)

    def start_gather(self) -> None:
        """RELEASED/DEVICE -> GATHERING: launch the all-gather of this unit's shards."""
        if self._state is ParamState.RELEASED:
            self.stage_to_host()
        if self._state is ParamState.HOST:
            self.stage_to_device()
        assert self._state is ParamState.DEVICE, self._state
        nbytes = self.full_numel * torch.empty((), dtype=self.dtype).element_size()
        acc.budget.charge(nbytes, f"gathered parameters of {self.module_name or '<root>'}")
        self._charged = nbytes
        self._gather_out = torch.empty(self.full_numel, dtype=self.dtype, device=acc.device())
        self._gather_handle = comm.all_gather_into_tensor(
            self._gather_out, self._device_shard(), async_op=True, what=f"all-gather of {self.module_name or '<root>'}")
        self._state = ParamState.GATHERING

    def wait_gather(self) -> None:
        """GATHERING -> AVAILABLE: wait, then point every parameter at its full tensor."""
        assert self._state is ParamState.GATHERING, self._state
        self._gather_handle.wait()
        rows = self._gather_out.view(self.world_size, self.shard_numel)
        for p, info in zip(self.params, self.infos):
            block = rows[:, info.shard_offset : info.shard_offset + info.chunk]
            set_data(p, block.reshape(-1)[: info.numel].view(info.shape))
        self._gather_out = None
        self._gather_handle = None
        if self._staged is not None:
            self.store.pool.put(self._staged)
            self._staged = None
        self._state = ParamState.AVAILABLE

    # ------------------------------------------------------------ gradients

    def grads_into(self, rows: torch.Tensor) -> None:
        """Copy the full gradients into an (N, shard_numel) block (zeros where absent)."""
        with torch.no_grad():
            for p, info in zip(self.params, self.infos):
                block = rows[:, info.shard_offset : info.shard_offset + info.chunk]
                if p.grad is None:
                    block.zero_()
                else:
                    block.copy_(self.chunks_of(p.grad, info))

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def load_full_into_params(self, rows: torch.Tensor) -> None:
        """Stage 1/2: copy gathered (N, shard_numel) values into the whole parameters."""
        with torch.no_grad():
            for p, info in zip(self.params, self.infos):
                block = rows[:, info.shard_offset : info.shard_offset + info.chunk]
                raw_data(p).copy_(block.reshape(-1)[: info.numel].view(info.shape))


def _init_unit_of(param):
    from ._init import InitUnit
    from ._param import info_of

    info = info_of(param)
    return info.unit if info is not None and isinstance(info.unit, InitUnit) else None
