"""Preflight: before the first byte is allocated, check that every tier has room.

The bytes each tier needs follow from the shard sizes and the chosen placement; they are
checked against free host memory (MemAvailable, or a memory cgroup's headroom where lower: Note [host memory
available] in _runtime/_host_memory.py) and free disk under each ``nvme_path``. A plan
that does not fit is refused with the numbers and what to change, instead of dying halfway
through the first step.
"""
from __future__ import annotations

import os
import shutil
from typing import Protocol

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._host_memory import available as host_available
from .._runtime._log import logger
from .._runtime._tiers import StagePolicy, Tier
from ..errors import InsufficientResourcesError
from . import _param_store
from ._drives import drive_paths, local_rank, node_bytes_per_drive, rank_drives
from ._layout import Layout, ParamSource
from ._memory_plan import GATHERED, OPT_FILES, PARAM_FILES, MemoryPlan, merge
from ._nvme_optimizer_store import NvmeOptimizerStore
from ._optimizer_store import MemoryOptimizerStore, chunk_elems, head_elems
from ._swap import reclaim_stale, stale_elsewhere


class Placed(Protocol):
    """What the memory model reads of a placement (``Placement`` in _placement.py, after this module)."""

    @property
    def opt_tier(self) -> Tier: ...

    @property
    def param_tier(self) -> Tier: ...

    @property
    def policy(self) -> StagePolicy: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def overlap(self) -> bool: ...

    @property
    def grads_in_memory(self) -> bool: ...

    @property
    def param_source(self) -> ParamSource: ...

    @property
    def param_cache_elems(self) -> int: ...

    @property
    def speculate(self) -> bool: ...

    @property
    def gathered_reuse_bytes(self) -> int: ...

    @property
    def direct_reads(self) -> bool: ...

    @property
    def opt_host_upto(self) -> int: ...

    @property
    def param_host_upto(self) -> int: ...

    @property
    def itemsize(self) -> int: ...


GiB = float(1 << 30)


def store_plan(*, opt_tier, param_tier, opt_total: int, param_total: int, itemsize: int, overlapped: bool,
               lazy_grad: bool, chunk: int, head: int, grads_in_memory: bool, staging_numel: int,
               staging_count: int, param_source: ParamSource, gathered_bytes: int, moments: str = "fp32",
               param_cache: int = 0, opt_host_upto: int = 0, param_host_upto: int = 0, undo_itemsize: int = 0
               ) -> MemoryPlan:
    """The bytes of every store for a plan (Note [one memory model] in _memory_plan.py). ``param_tier`` is None
    when parameters stay whole (stages 1-2); ``gathered_bytes`` is the gathered recycler's
    capacity (0 with an accelerator, whose caching allocator reuses device memory). ``opt_host_upto``,
    ``param_host_upto``: an NVMe tier's host share (Note [split tiers] in _split.py)."""
    if opt_tier is Tier.NVME:
        plans = [NvmeOptimizerStore.plan(opt_total, chunk, max(head, opt_host_upto), grads_in_memory, moments,
                                         opt_host_upto)]
    else:
        plans = [MemoryOptimizerStore.plan(opt_tier, opt_total, overlapped, lazy_grad, undo_itemsize)]
    if param_tier is not None:  # under MASTER the frozen units' shards only: Note [parameters from the master] in _placement.py
        plans.append(_param_store.plan(opt_tier if param_source is ParamSource.MASTER else param_tier, param_total,
                                     itemsize, staging_numel, staging_count, chunk, param_source,
                                     cache=param_cache,  # Note [parameter cache] in _nvme_param_store.py
                                     frozen=param_total - opt_total, host_upto=param_host_upto))
        plans.append({"device": {GATHERED: gathered_bytes}})
    return merge(*plans)


def plan(placement: Placed, cfg) -> dict:
    """Bytes per tier this rank will hold, and per drive on disk, from the one memory model
    (Note [one memory model] in _memory_plan.py); ``categories`` says what they are."""
    z = cfg.zero
    layout = placement.layout
    n = layout.opt_total
    chunk = chunk_elems(z.offload_optimizer.chunk_size, n)
    cats = store_plan(
        opt_tier=placement.opt_tier, param_tier=placement.param_tier if placement.policy.partition_params else None,
        opt_total=n, param_total=layout.param_total, itemsize=placement.itemsize, overlapped=placement.overlap,
        lazy_grad=z.stage < 2, chunk=chunk,
        # Note [host cache] in _nvme_optimizer_store.py
        head=head_elems(z.offload_optimizer.host_cache, list(layout.opt_ranges), chunk, n),
        grads_in_memory=placement.grads_in_memory, staging_numel=max(z.offload_param.buffer_size or 0, layout.max_shard),
        staging_count=0 if placement.direct_reads else staging_buffers(z),
        param_source=placement.param_source, gathered_bytes=placement.gathered_reuse_bytes,
        moments=z.offload_optimizer.moments, param_cache=placement.param_cache_elems,
        opt_host_upto=placement.opt_host_upto, param_host_upto=placement.param_host_upto,
        undo_itemsize=placement.itemsize if placement.speculate else 0)
    need: dict = {"device": sum(cats["device"].values()), "host": sum(cats["host"].values()), "nvme": {},
                  "categories": cats}
    for path, nbytes in _nvme_files(cfg, cats):
        mine = rank_drives(path, z.nvme_layout, local_rank())  # Note [many drives] in _drives.py
        for i, drive in enumerate(mine):  # a striped rank's bytes evenly, to the byte
            need["nvme"][drive] = need["nvme"].get(drive, 0) + nbytes // len(mine) + (i < nbytes % len(mine))
    return need


def _nvme_files(cfg, cats: dict):
    """(nvme_path, bytes of this rank's swap files there) of the optimizer's and the parameters' files."""
    z = cfg.zero
    for cat, path in ((OPT_FILES, z.offload_optimizer.nvme_path), (PARAM_FILES, z.offload_param.nvme_path)):
        if cats["nvme"].get(cat):
            yield path, cats["nvme"][cat]


def node_need(cfg, need: dict, ranks: int) -> dict:
    """Bytes the swap files of this node's ``ranks`` ranks take on each drive (every rank holds
    what this one does; Note [many drives] in _drives.py)."""
    out: dict = {}
    for path, nbytes in _nvme_files(cfg, need["categories"]):
        for drive, n in node_bytes_per_drive(path, cfg.zero.nvme_layout, nbytes, ranks).items():
            out[drive] = out.get(drive, 0) + n
    return out


def staging_buffers(z) -> int:
    """Staging buffers of the NVMe parameter tier (``zero.offload_param.buffer_count``)."""
    return z.offload_param.buffer_count or (z.prefetch.depth + 2 if z.prefetch.enabled else 2)


def free_disk(path: str) -> int:
    """Free bytes on the disk under ``path`` (or its nearest existing parent), once what crashed
    runs left there is reclaimed (Note [swap directories] in _swap.py)."""
    reclaim_stale(path)
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe or ".").free


def preflight(placement: Placed, cfg) -> dict:
    need = plan(placement, cfg)
    ranks = comm.ranks_here()
    problems = []
    host_total = need["host"] + (need["device"] if engine_device_is_host() else 0)
    avail, bound = host_available()  # a memory cgroup's limit counts (Note [host memory available] in _host_memory.py)
    if host_total * ranks > avail:
        where = "" if bound == "MemAvailable" else f" (bound by {bound})"
        problems.append(
            f"host memory{where}: {ranks} rank(s) x {_amounts(host_total, avail, ranks)} available; "
            f"offload more state to NVMe (zero.offload_optimizer.device / zero.offload_param.device: nvme, or a "
            f"smaller cpu share of their split, or device: auto to plan it), "
            f"lower zero.offload_optimizer.chunk_size or zero.offload_optimizer.host_cache, keep gradients on "
            f"NVMe (zero.offload_optimizer.gradients: nvme), or run fewer ranks per node")
    if acc.has_accelerator():  # each rank has a device of its own
        on_device, free_device = device_need(placement, need), acc.device_memory_free() or 0
        if on_device > free_device:
            problems.append(
                f"device memory ({acc.device()}): {_amounts(on_device, free_device, 1, 'of model states ')} free, "
                f"before activations; offload states (zero.offload_optimizer.device / zero.offload_param.device: "
                f"cpu or nvme), partition parameters (zero.stage: 3), or use a device with more memory")
    problems += _disk_problems(cfg, need, ranks)
    if problems:
        raise InsufficientResourcesError("this placement does not fit on this machine:\n  - " + "\n  - ".join(problems))
    return need


def _disk_problems(cfg, need: dict, ranks: int) -> list:
    """Note [many drives] in _drives.py: free space on every drive of every nvme_path, for what
    this node's ranks put there (what crashed runs left is reclaimed on each first, the drives
    this rank does not write to included)."""
    problems = []
    node = node_need(cfg, need, ranks)
    z = cfg.zero
    for section in (z.offload_optimizer, z.offload_param):
        if section.device == "nvme" and section.nvme_path:
            for drive in drive_paths(section.nvme_path):
                node.setdefault(drive, 0)
    for drives in _filesystems(node):  # listed drives on one filesystem share its free space
        free = min(free_disk(drive) for drive in drives)  # each reclaimed first
        nbytes = sum(node[drive] for drive in drives)
        if len(drives) > 1 and tuple(drives) not in _SAID_SHARED:  # once a process (Init's preflight, then the engine's)
            _SAID_SHARED.add(tuple(drives))
            logger.warning("nvme_path lists %s, which are one filesystem: their swap files share its space and its "
                           "bandwidth (is a drive not mounted there?)", " and ".join(drives))
        if nbytes > free:
            others = [o for drive in drives for o in stale_elsewhere(drive)]
            whose = "belongs to a live run or another host" if len(others) == 1 else "belong to live runs or other hosts"
            note = (f"; {len(others)} other run director{'y' if len(others) == 1 else 'ies'} there "
                    f"({', '.join(others[:3])}) {whose}") if others else ""
            ours = [o for drive in drives for o in stale_elsewhere(drive, ours=True)]
            note += (f"; this process's own ({', '.join(ours[:3])}) holds infinity.Init's shards, which take their "
                     f"space until initialize has moved them") if ours else ""
            share = f"{ranks} rank(s) together: " if ranks > 1 else ""
            where = drives[0] if len(drives) == 1 else f"{', '.join(drives[:-1])} and {drives[-1]} (one filesystem)"
            problems.append(
                f"disk under {where}: {share}{_amounts(nbytes, free, 1, 'of swap files ')} free{note}; "
                f"point nvme_path at a larger disk or free space, or list more drives in it")
    return problems


_SAID_SHARED: set = set()  # the groups of drives on one filesystem already warned of


def _filesystems(drives) -> list:
    """The drives grouped by the filesystem they are on (a missing one: its nearest existing
    parent's), in order: two directories of one drive, or a drive not mounted whose mount point
    is on the root disk, are one filesystem and one free space."""
    groups: dict = {}
    for drive in drives:
        probe = drive
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        groups.setdefault(os.stat(probe or ".").st_dev, []).append(drive)
    return list(groups.values())


def _amounts(need: int, have: int, ranks: int, what: str = "") -> str:
    """"<need> <what>needed, <have>" in a unit and with digits that show the shortfall: MiB
    below a GiB, and exact bytes when the rounded figures would read the same."""
    unit, name = (GiB, "GiB") if max(need * ranks, have) >= GiB else (float(1 << 20), "MiB")
    a, b = f"{need / unit:.2f} {name}", f"{have / unit:.2f} {name}"
    if f"{need * ranks / unit:.2f}" == f"{have / unit:.2f}":
        a, b = f"{need:,} bytes", f"{have:,} bytes"
    return f"{a} {what}needed, {b}"


def engine_device_is_host() -> bool:
    return not acc.has_accelerator()


def device_need(placement: Placed, need: dict) -> int:
    """Bytes of model state on this rank's accelerator: the plan's device stores, and for
    stages 1-2 the whole parameters (in the compute dtype, every rank's shard of them)."""
    whole = 0 if placement.policy.partition_params else \
        placement.layout.param_total * comm.world_size() * placement.itemsize
    return need["device"] + whole
