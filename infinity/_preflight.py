"""Preflight: before the first byte is allocated, check that every tier has room.

The bytes each tier needs follow from the shard sizes and the chosen placement; they are
checked against free host memory (psutil) and free disk under each ``nvme_path``. A plan
that does not fit is refused with the numbers and what to change, instead of dying halfway
through the first step.
"""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import psutil

from . import _comm as comm
from ._memory import OPT_FILES, PARAM_FILES, store_plan
from ._stores import chunk_elems, head_elems
from ._swap import reclaim_stale, stale_elsewhere
from .errors import InsufficientResourcesError

if TYPE_CHECKING:
    from ._engine import Engine
    from ._optimizer import ZeroOptimizer


GiB = float(1 << 30)


def plan(engine: "Engine", opt: "ZeroOptimizer") -> dict:
    """Bytes per tier this rank will hold, and per nvme_path on disk, from the one memory model
    (Note [one memory model] in _memory.py); ``categories`` says what they are."""
    z = engine.cfg.zero
    n = opt.total
    chunk = chunk_elems(z.offload_optimizer.chunk_size, n)
    partitioned = engine.policy.partition_params
    biggest = max((u.shard_numel for u in engine.units), default=0)
    cats = store_plan(
        opt_tier=opt.opt_tier, param_tier=opt.param_tier if partitioned else None, opt_total=n,
        param_total=opt.layout.param_total, itemsize=engine.itemsize, overlapped=opt.overlap,
        lazy_grad=not engine.policy.reduce_in_backward, chunk=chunk,
        head=head_elems(z.offload_optimizer.host_cache, opt.unit_ranges, chunk, n),  # Note [host cache]
        grads_in_memory=opt.grads_in_memory, staging_numel=max(z.offload_param.buffer_size or 0, biggest),
        staging_count=0 if direct_reads(engine) else staging_buffers(z), params_are_master=opt.params_are_master,
        gathered_bytes=engine.gathered.capacity if engine.gathered is not None else 0)
    need = {"device": sum(cats["device"].values()), "host": sum(cats["host"].values()), "nvme": {},
            "categories": cats}
    for cat, path in ((OPT_FILES, z.offload_optimizer.nvme_path), (PARAM_FILES, z.offload_param.nvme_path)):
        if cats["nvme"].get(cat):
            need["nvme"][path] = need["nvme"].get(path, 0) + cats["nvme"][cat]
    return need


def staging_buffers(z) -> int:
    """Staging buffers of the NVMe parameter tier (``zero.offload_param.buffer_count``)."""
    return z.offload_param.buffer_count or (z.prefetch.depth + 2 if z.prefetch.enabled else 2)


def direct_reads(engine: "Engine") -> bool:
    """One rank without an accelerator reads parameter shards straight into gathered buffers
    (FetchUnit._direct_read_buffer): the NVMe tier's staging pool is never filled."""
    return engine.world_size == 1 and engine.gathered is not None


def ranks_here() -> int:
    """Ranks on this node: they share its host memory and local disks."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))


def free_disk(path: str) -> int:
    """Free bytes on the disk under ``path`` (or its nearest existing parent), once what crashed
    runs left there is reclaimed (Note [swap directories])."""
    reclaim_stale(path)
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe or ".").free


def gradients_in_host(choice: str, total: int) -> bool:
    """``zero.offload_optimizer.gradients`` for an NVMe optimizer tier (Note [gradients in host
    memory] in _stores.py): ``auto`` keeps the gradient shards in host memory when those of
    every rank on this node take at most a quarter of the available host memory."""
    if choice != "auto":
        return choice == "cpu"
    return 4 * total * ranks_here() <= psutil.virtual_memory().available // 4


def preflight(engine: "Engine", opt: "ZeroOptimizer") -> dict:
    need = plan(engine, opt)
    ranks = ranks_here()
    problems = []
    host_total = need["host"] + (need["device"] if engine_device_is_host() else 0)
    avail = psutil.virtual_memory().available
    if host_total * ranks > avail:
        problems.append(
            f"host memory: {ranks} rank(s) x {host_total / GiB:.2f} GiB needed, {avail / GiB:.2f} GiB available; "
            f"offload more state to NVMe (zero.offload_optimizer.device / zero.offload_param.device: nvme), "
            f"lower zero.offload_optimizer.chunk_size or zero.offload_optimizer.host_cache, keep gradients on "
            f"NVMe (zero.offload_optimizer.gradients: nvme), or run fewer ranks per node")
    for path, nbytes in need["nvme"].items():
        free = free_disk(path)
        if nbytes * ranks > free:
            others = stale_elsewhere(path)
            note = (f"; {len(others)} other run director{'y' if len(others) == 1 else 'ies'} there "
                    f"({', '.join(others[:3])}) belong to live runs or other hosts") if others else ""
            problems.append(
                f"disk under {path}: {ranks} rank(s) x {nbytes / GiB:.2f} GiB of swap files needed, "
                f"{free / GiB:.2f} GiB free{note}; point nvme_path at a larger disk or free space")
    if problems:
        raise InsufficientResourcesError("this placement does not fit on this machine:\n  - " + "\n  - ".join(problems))
    return need


def engine_device_is_host() -> bool:
    from . import _accelerator as acc

    return not acc.has_cuda()
