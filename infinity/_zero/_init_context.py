"""``infinity.Init``: partition (and offload) each submodule's parameters right after its
``__init__``, so the full model never exists in memory.

Note [partitioned construction]: inside the context every ``nn.Module`` subclass's
``__init__`` is wrapped; when the outermost ``__init__`` of a module returns, each of its
direct parameters is flattened, padded and cut into world-size shards (Note [shard layout] in _unit.py);
this rank's fp32 shard goes to the Init store (memory, or a swap file on NVMe) and the
parameter keeps a placeholder. Later code that touches such a parameter (Hugging Face's
``post_init`` / ``_init_weights``, ``tie_weights``, ``torch.nn.init``), or a view of it, runs on
the full tensor: it is materialized (all-gathered), the operation runs, and what it changed is
re-partitioned (Note [touched placeholders] in _init_ops.py). So initialization takes effect
exactly as without Init, and only the parameters of one operation are materialized at a time.
``infinity.initialize`` then adopts them as its units' shards, one unit at a time, and the Init
store is released.

Parameters assigned to a module after its ``__init__`` (a loader's ``setattr``) are
partitioned at once, through torch's global parameter-registration hook; with Hugging Face's
``from_pretrained`` that is how each rank's shards are streamed from the checkpoint files
(Note [streamed load] in _pretrained.py). The Init store keeps each shard in its parameter's
dtype.

Note [Init preflight]: the store is given its room when Init starts: free disk under
``nvme_path`` (after reclaiming what crashed runs left) or 80% of the available host memory,
divided among the ranks on this node. Every new shard is checked against it before it is
stored, and refused with the numbers and the knob to change, naming the parameter. A model
built on the meta device (``from_pretrained``) is checked whole, before the first byte of the
checkpoint is read: the sum of its unloaded parameters' shards. A Hugging Face model built from
its config is checked whole before its first parameter is allocated, for everything
``initialize`` will then allocate as well (its optimizer states and gradients on their tiers):
``_check_whole_model`` builds it on the meta device once and runs the engine's own preflight on
that copy's placement (``_unit_plan.placement_of``).

Note [shards left in the checkpoint]: on the NVMe tier a shard loaded from a checkpoint is not
copied into ``init.swp``: the store records where it is (file, element range, the file's size,
modification time and inode) and ``initialize`` reads it from there straight into the
optimizer's and the parameter store's files. The checkpoint's bytes are read once, by the rank
that keeps them, and nothing is written twice. A shard that is changed before ``initialize``
(an in-place ``torch.nn.init``, an assignment) gets a slot of its own; a checkpoint file that
changed in between is refused by name instead of being read.
"""
from __future__ import annotations

import bisect
import os
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .._offload._drives import NvmePath, local_rank, rank_drives
from .._offload._layout import padded, shard_range, shard_rows
from .._offload._preflight import free_disk, preflight
from .._offload._swap import SwapDir, _make_nvme_path, new_aio
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._host_memory import available as host_available
from .._runtime._log import logger
from .._runtime._tiers import Tier
from .._runtime._topology import place
from ..aio import aligned_empty
from ..aio._checksum import checksummed, sums_of
from ..config import Config
from ..errors import InsufficientResourcesError, ParameterNotAvailableError, StorageError, UsageError
from ._init_ops import data_view, realize, run_on_full
from ._ledger import Hold
from ._param import (
    ParamInfo,
    ParamState,
    info_of,
    make_partitioned,
    not_available_message,
    raw_data,
    register,
    set_data,
)
from ._pretrained import PendingTensor, SourceReader, open_lazily
from ._unit_plan import placement_of


class InitStore:
    """This rank's shards of Init-partitioned parameters, in each parameter's dtype: in memory or
    in one swap file. Each shard is checked against the room this rank has on its tier before
    it is stored (Note [Init preflight])."""

    def __init__(self, tier: Tier, nvme_path: Optional[NvmePath], aio_cfg, rank: int):
        tier = self.tier = Tier.of(tier)
        self._mem: Dict[int, torch.Tensor] = {}
        self._offsets: Dict[int, int] = {}
        self._sizes: Dict[int, int] = {}  # slot bytes per shard stored here
        self._end = 0
        self.used = 0
        self._in_flight = 0
        self._files: Dict[int, tuple] = {}
        self._names: Dict[int, str] = {}  # NVMe: slot offset -> parameter name, for error messages
        self.swap = None  # NVMe: made by the first shard written (loaded shards stay in the checkpoint)
        if tier is Tier.NVME and nvme_path:  # one drive, by the rank rule whatever the layout
            # (Note [many drives] in _drives.py): init.swp lives only until initialize
            nvme_path = rank_drives(nvme_path, "per_rank", local_rank())[0]
        if tier is Tier.NVME:
            self._swap_args = (nvme_path, rank, aio_cfg)
        self.room, self.where = room_for(tier, nvme_path)
        self.advice = _ADVICE  # what a refusal tells to change, by tier
        self.halve_hint: Optional[str] = _HALVE_HINT  # how fp32 shards take half (None: the train job's dtype rule)

    def slot_bytes(self, numel: int, dtype: torch.dtype) -> int:
        nbytes = numel * dtype.itemsize
        return -(-nbytes // 4096) * 4096 if self.tier is Tier.NVME else nbytes

    def check_room(self, nbytes: int, what: str, dtype: Optional[torch.dtype] = None) -> None:
        """Refuse, before storing anything more, if ``nbytes`` more do not fit (Note [Init preflight]),
        with what to change in the caller's words (``advice``: the train job says its flags); shards
        of ``dtype`` float32 are told how to store half (``halve_hint``)."""
        if self.used + nbytes > self.room:
            halve = f"; {self.halve_hint}" if dtype == torch.float32 and self.halve_hint else ""
            raise InsufficientResourcesError(
                f"infinity.Init: {what} needs {_size(self.used + nbytes)} of {self.where} on this rank, "
                f"{_size(self.room)} available ({comm.ranks_here()} rank(s) on this node share it); "
                f"{self.advice[self.tier]}{halve}")

    def new_shard(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for a shard that ``put`` stores without a copy: mapped memory, and on NVMe the
        whole aligned slot, so the write is one O_DIRECT request."""
        return aligned_empty(self.slot_bytes(numel, dtype), torch.uint8)[: numel * dtype.itemsize].view(dtype)

    def put(self, key: int, shard: torch.Tensor, name: str, copy: bool = True) -> None:
        """Store ``shard`` (``copy=False``: hand it over, e.g. from ``new_shard``). Writes to NVMe
        are asynchronous, at most ``_WRITES_IN_FLIGHT`` bytes at a time; ``get`` waits for them."""
        if shard.device.type != "cpu":  # values made on the device (an init run on a gathered parameter)
            shard, copy = acc.to_host(shard), False  # the store's shards live in host memory or on NVMe
        nbytes = self.slot_bytes(shard.numel(), shard.dtype)
        self._files.pop(key, None)  # new values: no longer the checkpoint's
        if nbytes > self._sizes.get(key, 0):  # a new shard, or one grown by an assignment of .data
            grown = nbytes - self._sizes.get(key, 0) if self.tier is not Tier.NVME else nbytes  # NVMe: a new slot
            self.check_room(grown, f"parameter {name}", shard.dtype)
            self.used += grown
            self._sizes[key] = nbytes
            if self.tier is Tier.NVME:
                self._offsets[key] = self._end
                self._end += nbytes
        if self.tier is not Tier.NVME:
            self._mem[key] = shard.clone() if copy and shard.data_ptr() else shard
            return
        slot = _whole_slot(shard, nbytes)
        if slot is None or copy:
            fresh = self.new_shard(shard.numel(), shard.dtype)
            fresh.copy_(shard.reshape(-1))
            slot = _whole_slot(fresh, nbytes)
        if self._in_flight + nbytes > _WRITES_IN_FLIGHT:
            self.settle()
        if self.swap is None:
            nvme_path, rank, aio_cfg = self._swap_args
            self.swap = SwapDir(nvme_path, rank)
            # Note [swap checksums] in aio/_checksum.py: the file grows up to the room it was given
            self.path = checksummed(self.swap.file("init.swp", 0), self.room, aio_cfg.checksums)
            self._label()
            self.io = new_aio(aio_cfg)
        self._names[self._offsets[key]] = name
        self.io.pwrite(slot, self.path, self._offsets[key])
        self._in_flight += nbytes

    def _label(self) -> None:
        sums = sums_of(self.path)
        if sums is not None:
            def describe(offset: int) -> str:
                starts = sorted(self._names)
                i = bisect.bisect_right(starts, offset) - 1
                return f"this rank's shard of parameter {self._names[starts[i]]}" if i >= 0 else ""

            sums.describe, sums.when = describe, lambda: "while building the model under infinity.Init"

    def settle(self) -> None:
        """Wait for the writes in flight."""
        if self._in_flight:
            self.io.wait(what="Init store writes")
            self._in_flight = 0

    def refer(self, key: int, pending: PendingTensor, lo: int, hi: int, numel: int) -> None:
        """Keep a shard where it already is: elements ``[lo, hi)`` of a checkpoint tensor, padded
        to ``numel`` (Note [shards left in the checkpoint])."""
        self._files[key] = (pending, lo, hi, numel, _stamp(pending.source.path))

    def get(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        ref = self._files.get(key)
        if ref is not None:
            pending, lo, hi, numel, stamp = ref
            if _stamp(pending.source.path) != stamp:
                raise StorageError(
                    f"{pending.source.path} changed after it was loaded under infinity.Init (size or modification "
                    f"time differ); the partitions still read from it: call infinity.initialize before changing "
                    f"or removing the checkpoint")
            return pending.read_shard(lo, hi, aligned_empty(numel, dtype))
        if self.tier is not Tier.NVME:
            return self._mem[key]
        self.settle()
        out = torch.empty(numel, dtype=dtype)
        self.io.sync_pread(out, self.path, self._offsets[key])
        return out

    def close(self) -> None:
        self._mem.clear()
        self._files.clear()
        if self.swap is not None:
            self.settle()
            self.io.close()
            self.swap.remove()


_WRITES_IN_FLIGHT = 256 << 20


def _stamp(path: str):
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _whole_slot(shard: torch.Tensor, nbytes: int) -> Optional[torch.Tensor]:
    """The ``nbytes`` bytes of a page-aligned buffer that starts with ``shard``, or None."""
    storage = shard.untyped_storage()
    start = shard.storage_offset() * shard.element_size()
    if not shard.is_contiguous() or shard.data_ptr() % 4096 or storage.nbytes() - start < nbytes:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,))


def _size(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 27 else f"{nbytes / (1 << 20):.2f} MiB"


_ADVICE = {
    Tier.DEVICE: "partition to host memory or NVMe instead (Init(offload='cpu' or 'nvme')), or run more ranks",
    Tier.CPU: "partition to NVMe instead (Init(offload='nvme', nvme_path=...)), or run more ranks",
    Tier.NVME: "point nvme_path at a larger disk or free space there",
}
_HALVE_HINT = ("the parameters are float32 as built: in bfloat16 they need half (from_pretrained(..., "
               "torch_dtype=torch.bfloat16), or the model built under torch.set_default_dtype(torch.bfloat16))")


def room_for(tier: Tier, nvme_path: Optional[str]):
    """Bytes this rank may store on ``tier`` and a name for where (Note [Init preflight])."""
    if tier is Tier.NVME:
        if not nvme_path:
            raise UsageError("Init(offload='nvme') needs nvme_path: pass nvme_path= or set zero.offload_param.nvme_path "
                             "to a directory on a fast local disk")
        # checked as the engine makes it (Note [swap directories] in _swap.py), made only by the first shard
        # written: a refusal for its room leaves no empty directory behind
        disk = _make_nvme_path(nvme_path, create=False)
        return free_disk(disk) // comm.ranks_here(), f"disk under {nvme_path}"
    avail, bound = host_available()  # a memory cgroup's limit counts (Note [host memory available] in _host_memory.py)
    return int(avail * _HOST_SHARE) // comm.ranks_here(), "host memory" if bound == "MemAvailable" else \
        f"host memory (bound by {bound})"


# The share of the available host memory the Init store may take: the rest is for the model's
# construction itself, the loader, and what initialize() allocates next to it.
_HOST_SHARE = 0.8


_EXACT_IN_FP32 = (torch.float32, torch.float16, torch.bfloat16)


class InitUnit:
    """The fetch unit of one Init-partitioned parameter until ``initialize`` adopts it.

    A parameter built on the meta device (``from_pretrained`` builds that way) has no values
    until the loader assigns them; its unit is *unloaded*: it materializes as a meta tensor,
    and ``shard`` refuses."""

    def __init__(self, init: "Init", param: nn.Parameter, name: str, dtype: torch.dtype, shape: torch.Size):
        self.init = init
        self.index = init.counter
        init.counter += 1
        self.world_size = init.world_size
        self.module_name = name
        self.params = [param]
        self.dtype = dtype
        numel = shape.numel()
        self.info = ParamInfo(name, shape, numel, padded(numel, self.world_size), 0, self)
        self.loaded = False
        self._state = ParamState.RELEASED
        self._refs = 0

    @property
    def state(self) -> ParamState:
        return self._state

    def on_unavailable(self, func, args, kwargs, infos):
        """Note [parameter owners] in _param.py: Init runs the op on the full tensors."""
        return self.init.on_unavailable(func, args, kwargs, infos)

    @property
    def shard_bytes(self) -> int:
        return self.init.store.slot_bytes(self.info.shard_numel, self.dtype)

    def shard(self) -> torch.Tensor:
        if not self.loaded:
            raise UsageError(
                f"parameter {self.info.name!r} {tuple(self.info.shape)} was built on the meta device under "
                f"infinity.Init and never given values (it is not in the checkpoint and nothing initialized it); "
                f"load or initialize it before infinity.initialize")
        return self.init.store.get(self.index, self.info.shard_numel, self.dtype)

    def materialize(self) -> torch.Tensor:
        """All-gather the shards into the full tensor (in the parameter's dtype)."""
        if not self.loaded:
            return torch.empty(self.info.shape, dtype=self.dtype, device="meta")
        wire = torch.float32 if self.dtype in _EXACT_IN_FP32 else self.dtype  # fp64 and integers: exact as they are
        mine = self.shard().to(wire)
        full = torch.empty(self.info.padded_numel, dtype=wire, device=acc.device())
        comm.all_gather_into_tensor(full, acc.to_device(mine), async_op=False, what=f"Init gather of {self.info.name}")
        return full[: self.info.numel].view(self.info.shape).to(self.dtype)

    def store_full(self, full: torch.Tensor) -> None:
        if full.is_meta:
            return  # still without values (Note [streamed load] in _pretrained.py)
        rows = shard_rows(full.detach().to(self.dtype), self.world_size)
        self.init.store.put(self.index, rows[self.init.rank].contiguous(), self.info.name)
        self.loaded = True

    def assign(self, full: torch.Tensor) -> None:
        """``param.data = full``: the values of ``full``, whose shape and dtype may differ from the
        parameter's (``resize_token_embeddings`` assigns a larger matrix): the partition is remade
        for them (Note [touched placeholders] in _init_ops.py)."""
        if full.shape != self.info.shape or full.dtype != self.dtype:
            if full.is_meta != self._on_meta():
                raise UsageError(f"parameter {self.info.name!r}: .data cannot move between the meta device and "
                                 f"another under infinity.Init; assign a new parameter instead")
            numel = full.shape.numel()
            self.info.shape, self.info.numel = full.shape, numel
            self.info.padded_numel = padded(numel, self.world_size)
            self.dtype = full.dtype
        self.store_full(full)
        set_data(self.params[0], self.placeholder())

    def load(self, pending) -> None:
        """This rank's shard, read from the checkpoint file (Note [streamed load] in _pretrained.py)."""
        numel, store = self.info.shard_numel, self.init.store
        lo, hi = shard_range(self.info.numel, self.world_size, self.init.rank)
        self.loaded = True
        if store.tier is Tier.NVME:  # Note [shards left in the checkpoint]
            store.refer(self.index, pending, lo, hi, numel)
            return
        mine = pending.read_shard(lo, hi, store.new_shard(numel, self.dtype))  # mapped memory: no heap left behind
        store.put(self.index, mine, self.info.name, copy=False)

    def placeholder(self) -> torch.Tensor:
        """The empty data of the parameter while partitioned; a parameter built on the meta device
        keeps meta data (torch cannot switch a tensor's data between meta and a real device)."""
        return torch.empty(0, dtype=self.dtype, device="meta" if self._on_meta() else acc.device())

    def _on_meta(self) -> bool:
        return raw_data(self.params[0]).is_meta

    def acquire(self, why: Hold = Hold.GATHERED) -> None:
        self._refs += 1  # only GatheredParameters acquires a unit before initialize
        if self._state is not ParamState.AVAILABLE:
            full = self.materialize()
            if self._on_meta() and not full.is_meta:
                raise UsageError(
                    f"parameter {self.info.name!r} was built on the meta device; it can be replaced (a loader's "
                    f"setattr, module.weight = nn.Parameter(...)) but not used in place once it has values")
            set_data(self.params[0], full)
            self._state = ParamState.AVAILABLE

    def release(self, why: Hold = Hold.GATHERED) -> None:
        self._refs -= 1
        if self._refs == 0:
            set_data(self.params[0], self.placeholder())
            self._state = ParamState.RELEASED


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

    ``offload`` ("none" | "cpu" | "nvme" | "auto": on NVMe given a path, else in host memory, until
    ``initialize`` plans it, Note [planned split] in _offload/_split.py) and ``nvme_path`` (a directory,
    or a list, one per drive) override the config's ``zero.offload_param``. Collective: all ranks build it alike."""


    def __init__(self, config=None, *, offload: Optional[str] = None, nvme_path: Optional[NvmePath] = None,
                 enabled: bool = True):
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
        self._saved: Dict[type, tuple] = {}  # class -> (its __init__, the wrapper that replaced it)
        self._active = False
        self._depth: Dict[int, int] = {}
        self._built: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._checked_load = False
        self._probing = False  # building the meta copy of _check_whole_model

    # ------------------------------------------------------------ context

    def __enter__(self):
        if not self.enabled:
            return self
        comm.configure(self.cfg)  # Note [comm timeout] in _comm.py
        comm.ensure_initialized()
        place(self.cfg.zero.numa, self.cfg.zero.cpu_threads)  # before the Init store: Note [rank placement] in _topology.py
        self.rank, self.world_size = comm.rank(), comm.world_size()
        off = self.cfg.zero.offload_param
        tier = (Tier.NVME if off.nvme_path else Tier.CPU) if off.device == "auto" else Tier.of(off.device)
        self.store = InitStore(tier, off.nvme_path, self.cfg.aio, self.rank)
        self._active = True
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
        self._hook = register_module_parameter_registration_hook(self._on_register)
        self.reader = SourceReader(self.cfg.aio)
        self._undo_lazy = None
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for cls, (orig, wrapped) in self._saved.items():
            if cls.__dict__.get("__init__") is wrapped:
                cls.__init__ = orig
            # else a decorator replaced it after a class was made inside the context (transformers'
            # use_experts_implementation wraps the __init__ it finds): its __init__ calls ours, which
            # from now on only calls the original; restoring would drop the decorator's
        self._saved.clear()
        self._active = False
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass
        self._hook.remove()
        self._stop_lazy_files()
        self.reader.close()
        logger.info("Init: %d parameters partitioned over %d rank(s) on tier %s", self._partitioned(), self.world_size,
                    self.store.tier)
        return False

    def _partitioned(self) -> int:
        """The parameters this Init partitioned that its modules hold now, each once: a parameter
        built on the meta device and replaced by its loaded values (``from_pretrained``) is one."""
        held = {id(p) for m in self._built for p in m._parameters.values()
                if p is not None and (i := info_of(p)) is not None and isinstance(i.unit, InitUnit) and i.unit.init is self}
        return len(held)

    def _wrap(self, cls) -> None:
        if cls in self._saved:
            return
        orig = cls.__dict__["__init__"]
        init = self

        def wrapped(module, *args, **kwargs):
            if init._probing or not init._active:  # the meta build of _check_whole_model, or after the context
                return orig(module, *args, **kwargs)
            if not init._depth:  # the outermost module: the model itself
                init._check_whole_model(type(module), args, kwargs)
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
        self._saved[cls] = (orig, wrapped)
        cls.__init__ = wrapped

    def _check_whole_model(self, cls: type, args: tuple, kwargs: dict) -> None:
        """Note [Init preflight]: a Hugging Face model is built once on the meta device first
        (its config gives every shape, no weight is allocated), and what ``initialize`` will
        allocate for it (the placement's stores, through the same preflight) is checked against
        this machine before the real build allocates its first parameter. Models built on the
        meta device already (``from_pretrained``) are checked whole when their load starts."""
        if torch.empty(()).device.type == "meta" or not any(
                c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in cls.__mro__):
            return
        self._probing = True
        try:
            with torch.device("meta"):
                probe = cls(*args, **kwargs)
        finally:
            self._probing = False
        placement, _, _ = placement_of(probe, self.cfg, self.world_size)
        try:
            preflight(placement, self.cfg)
        except InsufficientResourcesError as err:
            n = sum(p.numel() for p in probe.parameters())
            raise InsufficientResourcesError(
                f"infinity.Init: {cls.__name__} ({n / 1e9:.2f}B parameters) does not fit with the states this config "
                f"places; refused before its parameters are allocated. {err}") from None

    # ------------------------------------------------------------ partitioning

    def _partition_module(self, module: nn.Module) -> None:
        self._built.add(module)
        for pname, p in module._parameters.items():
            if p is not None and info_of(p) is None:
                self._partition(module, pname, p)

    def _partition(self, module: nn.Module, pname: str, p: nn.Parameter) -> None:
        data = raw_data(p)
        unit = InitUnit(self, p, f"{type(module).__name__}.{pname}", data.dtype, data.shape)
        if data.is_meta:
            self._start_lazy_files()  # a loader will assign the values (Note [streamed load] in _pretrained.py)
        unit.store_full(data)
        self._manage(p, unit)
        set_data(p, unit.placeholder())

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter):
        """torch's parameter-registration hook: a parameter assigned to a module this Init built,
        after its ``__init__`` (a loader's ``setattr``), is partitioned at once."""
        if self._probing or id(module) in self._depth or module not in self._built or info_of(param) is not None:
            return None  # partitioned when its __init__ returns, not ours, or already partitioned (tied)
        if isinstance(param, PendingTensor):
            return self._adopt_pending(module, name, param)
        self._partition(module, name, param)
        return None

    def _adopt_pending(self, module: nn.Module, name: str, pending: PendingTensor) -> nn.Parameter:
        """A parameter whose values are read from the checkpoint, this rank's shard only."""
        if not self._checked_load and self.store.tier is not Tier.NVME:  # NVMe: Note [shards left in the checkpoint]
            self._checked_load = True
            need = sum(u.shard_bytes for u in self.units if not u.loaded)
            self.store.check_room(need, f"loading the checkpoint ({len(self.units)} parameters)", pending.dtype)
        param = nn.Parameter(torch.empty(0, dtype=pending.dtype, device=acc.device()), pending.requires_grad)
        param.__dict__.update({k: v for k, v in pending.__dict__.items() if k not in ("source", "reader", "_is_param")})
        unit = InitUnit(self, param, f"{type(module).__name__}.{name}", pending.dtype, pending.shape)
        unit.load(pending)
        self._manage(param, unit)
        return param

    def _manage(self, param: nn.Parameter, unit: InitUnit) -> None:
        register(param, unit.info)
        make_partitioned(param)
        self.units.append(unit)

    def _start_lazy_files(self) -> None:
        if self._undo_lazy is None:
            self._undo_lazy = open_lazily(self.reader) or (lambda: None)

    def _stop_lazy_files(self) -> None:
        if self._undo_lazy is not None:
            self._undo_lazy()
            self._undo_lazy = None

    # ------------------------------------------------------------ ops on partitioned params

    def on_unavailable(self, func, args, kwargs, infos):
        """Note [touched placeholders] in _init_ops.py: run ``func`` on the full tensors."""
        if getattr(func, "__self__", None) is torch._C.TensorBase.data:
            param = args[0]
            unit = self._touch(param, ".data")
            if func.__name__ == "__set__":
                unit.assign(realize(args[1], self._touch, ".data ="))
                return None
            return data_view(param, unit.info.shape, unit.dtype, raw_data(param).device)
        return run_on_full(func, args, kwargs, self._touch)

    @staticmethod
    def _touch(param: nn.Parameter, op: str) -> InitUnit:
        """The Init unit of a parameter an operator reached, or the engine's refusal."""
        info = info_of(param)
        if info is None or not isinstance(info.unit, InitUnit):
            raise ParameterNotAvailableError(not_available_message(info, op))
        return info.unit

    def repartition(self, unit: InitUnit) -> None:
        unit.store_full(raw_data(unit.params[0]))

    def close(self) -> None:
        self.store.close()
