"""``infinity.Init``: partition (and offload) each submodule's parameters right after its
``__init__``, so the full model never exists in memory.

Note [partitioned construction]: inside the context every ``nn.Module`` subclass's
``__init__`` is wrapped; when the outermost ``__init__`` of a module returns, each of its
direct parameters is flattened, padded and cut into world-size chunks (Note [shard layout]);
this rank's fp32 chunk goes to the Init store (memory, or a swap file on NVMe) and the
parameter keeps a placeholder. Later code that touches such a parameter (Hugging Face's
``post_init`` / ``_init_weights``, ``tie_weights``, ``torch.nn.init``) runs on the full
tensor: it is materialized (all-gathered), the operation runs, and in-place results are
re-partitioned. So initialization takes effect exactly as without Init, and at most one
parameter is materialized at a time. ``infinity.initialize`` then adopts the chunks as its
shards, one unit at a time, and the Init store is released.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional

import torch
from torch import nn

from . import _accelerator as acc
from . import _comm as comm
from ._log import logger
from ._param import (
    ParamInfo,
    ParamState,
    first_arg,
    info_of,
    make_partitioned,
    raw_data,
    register,
    set_data,
)
from ._swap import SwapDir, new_aio
from ._tiers import Tier
from ._unit import padded

_INPLACE_SUFFIX = "_"


class InitStore:
    """This rank's fp32 chunks of Init-partitioned parameters: in memory or in one swap file."""

    def __init__(self, tier: Tier, nvme_path: Optional[str], aio_cfg, rank: int):
        tier = self.tier = Tier.of(tier)
        self._mem: Dict[int, torch.Tensor] = {}
        self._offsets: Dict[int, int] = {}
        self._end = 0
        if tier is Tier.NVME:
            self.swap = SwapDir(nvme_path, rank)
            self.path = self.swap.file("init.swp", 0)
            self.io = new_aio(aio_cfg)

    def put(self, key: int, chunk: torch.Tensor) -> None:
        if self.tier is not Tier.NVME:
            self._mem[key] = chunk.clone() if chunk.data_ptr() else chunk
            return
        if key not in self._offsets:
            self._offsets[key] = self._end
            self._end += -(-chunk.numel() * 4 // 4096) * 4096
        self.io.sync_pwrite(chunk.contiguous(), self.path, self._offsets[key])

    def get(self, key: int, numel: int) -> torch.Tensor:
        if self.tier is not Tier.NVME:
            return self._mem[key]
        out = torch.empty(numel, dtype=torch.float32)
        self.io.sync_pread(out, self.path, self._offsets[key])
        return out

    def close(self) -> None:
        self._mem.clear()
        if self.tier is Tier.NVME:
            self.io.close()
            self.swap.remove()


class InitUnit:
    """The fetch unit of one Init-partitioned parameter until ``initialize`` adopts it."""

    def __init__(self, init: "Init", param: nn.Parameter, name: str, dtype: torch.dtype):
        self.engine = init
        self.index = init.counter
        init.counter += 1
        self.world_size = init.world_size
        self.module_name = name
        self.params = [param]
        self.dtype = dtype
        self.key = id(param)
        self.info = ParamInfo(name, param.shape, param.numel(), padded(param.numel(), self.world_size), 0, self)
        self._state = ParamState.RELEASED
        self._refs = 0

    @property
    def state(self) -> ParamState:
        return self._state

    def chunk(self) -> torch.Tensor:
        return self.engine.store.get(self.key, self.info.chunk)

    def materialize(self) -> torch.Tensor:
        """All-gather the chunks into the full tensor (in the parameter's dtype)."""
        mine = self.chunk()
        full = torch.empty(self.info.padded_numel, dtype=torch.float32, device=acc.device())
        comm.all_gather_into_tensor(full, acc.to_device(mine), async_op=False, what=f"Init gather of {self.info.name}")
        return full[: self.info.numel].view(self.info.shape).to(self.dtype)

    def store_full(self, full: torch.Tensor) -> None:
        rows = _chunks(full.detach().to(torch.float32), self.info, self.world_size)
        self.engine.store.put(self.key, rows[self.engine.rank].contiguous())

    def acquire(self) -> None:
        self._refs += 1
        if self._state is not ParamState.AVAILABLE:
            set_data(self.params[0], self.materialize())
            self._state = ParamState.AVAILABLE

    def release(self) -> None:
        self._refs -= 1
        if self._refs == 0:
            set_data(self.params[0], torch.empty(0, dtype=self.dtype, device=acc.device()))
            self._state = ParamState.RELEASED


def _chunks(full: torch.Tensor, info: ParamInfo, world: int) -> torch.Tensor:
    flat = full.reshape(-1)
    pad = info.padded_numel - info.numel
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(world, info.chunk)


def _all_subclasses(cls) -> List[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in out:
                out.append(s)
                todo.append(s)
    return out


class Init:
    """Build a model partitioned from the start: ``with infinity.Init(config=cfg): model = M()``.

    ``offload`` ("none" | "cpu" | "nvme") and ``nvme_path`` override the config's
    ``zero.offload_param``. Collective: every rank must build the same model inside it."""


    def __init__(self, config=None, *, offload: Optional[str] = None, nvme_path: Optional[str] = None,
                 enabled: bool = True):
        from .config import Config

        cfg = Config.coerce(config)
        overrides = {}
        if offload is not None:
            overrides["zero.offload_param.device"] = offload
        if nvme_path is not None:
            overrides["zero.offload_param.nvme_path"] = nvme_path
        if overrides:
            cfg = cfg.with_overrides(overrides)
        self.cfg = cfg
        self.enabled = enabled
        self.counter = 0
        self.units: List[InitUnit] = []
        self._saved: Dict[type, object] = {}
        self._depth: Dict[int, int] = {}
        self._shadows: Dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------ context

    def __enter__(self):
        if not self.enabled:
            return self
        comm.ensure_initialized()
        self.rank, self.world_size = comm.rank(), comm.world_size()
        off = self.cfg.zero.offload_param
        self.store = InitStore(Tier.of(off.device), off.nvme_path, self.cfg.aio, self.rank)
        for cls in [nn.Module] + _all_subclasses(nn.Module):
            if "__init__" in cls.__dict__:
                self._wrap(cls)
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        init = self

        def _init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            if "__init__" in cls.__dict__:
                init._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(_init_subclass)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for cls, orig in self._saved.items():
            cls.__init__ = orig
        self._saved.clear()
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass
        logger.info("Init: %d parameters partitioned over %d rank(s) on tier %s", len(self.units), self.world_size,
                    self.store.tier)
        return False

    def _wrap(self, cls) -> None:
        if cls in self._saved:
            return
        orig = cls.__dict__["__init__"]
        self._saved[cls] = orig
        init = self

        def wrapped(module, *args, **kwargs):
            key = id(module)
            init._depth[key] = init._depth.get(key, 0) + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                init._depth[key] -= 1
            if init._depth[key] == 0:
                del init._depth[key]
                init._partition_module(module)

        wrapped.__wrapped__ = orig
        cls.__init__ = wrapped

    # ------------------------------------------------------------ partitioning

    def _partition_module(self, module: nn.Module) -> None:
        for pname, p in module._parameters.items():
            if p is None or info_of(p) is not None:
                continue
            unit = InitUnit(self, p, f"{type(module).__name__}.{pname}", raw_data(p).dtype)
            unit.store_full(raw_data(p))
            register(p, unit.info)
            make_partitioned(p)
            set_data(p, torch.empty(0, dtype=unit.dtype, device=acc.device()))
            self.units.append(unit)

    # ------------------------------------------------------------ ops on partitioned params

    def on_unavailable(self, func, args, kwargs, infos):
        """Run ``func`` on the full tensors; re-partition what it changed in place."""
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.data:
            info = infos[0]
            if func.__name__ == "__set__":
                info.unit.store_full(args[1])
                return None
            return self._shadow(args[0], info)
        fulls = {id(p): (p, info_of(p).unit, info_of(p).unit.materialize()) for p in _params_in(args, kwargs)}
        args2 = _substitute(args, fulls)
        kwargs2 = _substitute(kwargs, fulls)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args2, **kwargs2)
        name = getattr(func, "__name__", "")
        if name.endswith(_INPLACE_SUFFIX) or name in ("__setitem__", "__iadd__", "__imul__", "__isub__", "__itruediv__"):
            target = fulls.get(id(first_arg(args, kwargs)))
            if target is not None:
                target[1].store_full(target[2])
                return target[0]
        return out

    def _shadow(self, param, info) -> torch.Tensor:
        """``param.data`` of a partitioned parameter: a tensor whose ops reach the chunks."""
        shadow = self._shadows.get(id(info))
        if shadow is None:
            with torch._C.DisableTorchFunctionSubclass():
                shadow = torch.Tensor._make_subclass(type(param), raw_data(param), False)
            register(shadow, info)
            self._shadows[id(info)] = shadow
        return shadow

    def repartition(self, unit: InitUnit) -> None:
        unit.store_full(raw_data(unit.params[0]))

    def close(self) -> None:
        self.store.close()
        self._shadows.clear()


def _params_in(args, kwargs):
    from ._param import _iter_params

    seen = []
    for p in itertools.chain(_iter_params(args), _iter_params(kwargs)):
        i = info_of(p)
        if i is not None and i.state is not ParamState.AVAILABLE and all(p is not q for q in seen):
            seen.append(p)
    return seen


def _substitute(obj, fulls):
    if isinstance(obj, torch.Tensor):
        hit = fulls.get(id(obj))
        return hit[2] if hit is not None else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_substitute(x, fulls) for x in obj)
    if isinstance(obj, dict):
        return {k: _substitute(v, fulls) for k, v in obj.items()}
    return obj
