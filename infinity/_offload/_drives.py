"""Which drives a rank's swap files go to.

Note [many drives]: ``nvme_path`` names one directory or a list of them, one per data drive of
the node (a DGX H100 has 8; their bandwidth only adds up across drives). Two layouts
(``zero.nvme_layout``):

- ``per_rank`` (the default): each local rank keeps all its swap files on one drive,
  ``paths[local_rank % len(paths)]``, so that with as many drives as ranks per node no two ranks
  share a drive, and with fewer the ranks are dealt round the drives evenly;
- ``stripe``: each rank spreads every swap file over every drive in fixed-size extents, for nodes
  with fewer drives than ranks, or one rank that should read from all of them.

The assignment is a pure function of the paths, the layout and the rank's place on its node, so
that the engine, its preflight, the planner of ``infinity.estimate --plan`` and the endurance
ledger all derive the same bytes per drive from it.
"""
from __future__ import annotations

import os
from typing import Dict, Sequence, Tuple, Union

from ..errors import UsageError

NvmePath = Union[str, Sequence[str]]

LAYOUTS = ("per_rank", "stripe")


def drive_paths(nvme_path: NvmePath) -> Tuple[str, ...]:
    """The configured drives as a tuple: one string is one drive; each normalised (``/a/`` is
    ``/a``, so two spellings of one directory are one drive), order kept, repeats dropped."""
    paths = (nvme_path,) if isinstance(nvme_path, str) else tuple(nvme_path)
    return tuple(dict.fromkeys(os.path.normpath(os.fspath(p)) for p in paths))


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; else 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Ranks on this node, which share its drives and cores (torchrun's LOCAL_WORLD_SIZE; else 1)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def rank_drives(nvme_path: NvmePath, layout: str = "per_rank", rank_on_node: int = 0) -> Tuple[str, ...]:
    """Note [many drives]: the drives that hold the swap files of the rank ``rank_on_node``."""
    paths = drive_paths(nvme_path)
    if not paths:
        raise UsageError("nvme_path names no directory; give a directory, or a list of one directory per drive")
    if layout == "stripe":
        return paths
    if layout != "per_rank":
        raise UsageError(f"nvme_layout {layout!r}: expected one of {LAYOUTS}")
    return (paths[rank_on_node % len(paths)],)


def node_bytes_per_drive(nvme_path: NvmePath, layout: str, bytes_per_rank: int, ranks_on_node: int) -> Dict[str, int]:
    """Note [many drives]: swap bytes each drive holds when every rank of a node holds
    ``bytes_per_rank`` (striped extents counted evenly: the last partial extent is below the
    planner's resolution)."""
    paths = drive_paths(nvme_path)
    out = {p: 0 for p in paths}
    for r in range(ranks_on_node):
        mine = rank_drives(paths, layout, r)
        for p in mine:
            out[p] += bytes_per_rank // len(mine)
    return out


def configured_drives(cfg) -> Tuple[str, ...]:
    """Every drive the config's NVMe sections name, in order, each once: drive ``k`` of the
    telemetry (``drive<k>_read_bytes``) and the summary."""
    z = cfg.zero
    drives: Dict[str, None] = {}
    for section in (z.offload_optimizer, z.offload_param):
        if section.device == "nvme" and section.nvme_path:
            drives.update(dict.fromkeys(drive_paths(section.nvme_path)))
    return tuple(drives)


def rank_bandwidth(per_drive: float, drives: int, layout: str, ranks_on_node: int) -> float:
    """Note [many drives]: bytes/s one rank moves when every rank of the node moves as much at
    once and each drive serves ``per_drive`` bytes/s: the busiest drive sets the pace."""
    paths = tuple(str(d) for d in range(max(1, drives)))
    whole = 1 << 40  # a rank's bytes, large enough that the striped split's rounding is nothing
    busiest = max(node_bytes_per_drive(paths, layout, whole, max(1, ranks_on_node)).values())
    return per_drive * whole / busiest
