"""SSD write endurance as a budget: the bytes written to each drive, and the run's projection.

Note [endurance budget]: an SSD is rated for so many terabytes written (TBW), and training with
NVMe offload rewrites the optimizer states every step (12 bytes per parameter and more), so a
long run can spend a visible part of a disk's life. ``SsdLedger`` counts, per drive (each
directory of ``nvme_path``, Note [many drives] in _offload/_drives.py), the bytes this rank
wrote there: the swap files (every write through the engine's swap files, counted by the drive
it went to) and the checkpoints saved under a directory on the same filesystem (the files the
manifest lists as written; a file cloned from a swap file shares its blocks and writes nothing
then, and the copy-on-write it causes later is counted as the swap file's writes that cause
it). The train job records the bytes of each step and of the run in its telemetry and summary,
and after the first step projects the run (that step's bytes times the steps, times the ranks
of this node writing to that drive: ``sharing``) against ``aio.endurance_tbw``,
warning when it passes ``aio.endurance_warn_fraction`` of it. Checkpoints are not projected
(how many bytes a save writes depends on whether it clones); they are counted as they happen.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from .._offload._drives import configured_drives, rank_drives

TB = 10**12  # TBW ratings are decimal terabytes


def _holder(path: str, nvme_paths: List[str]) -> Optional[str]:
    """The nvme_path whose directory holds ``path``, or on whose filesystem it lies."""
    real = os.path.realpath(path)
    for p in nvme_paths:
        if real.startswith(os.path.realpath(p).rstrip("/") + "/"):
            return p
    try:
        dev = os.stat(real if os.path.exists(real) else os.path.dirname(real)).st_dev
        return next((p for p in nvme_paths if os.path.exists(p) and os.stat(p).st_dev == dev), None)
    except OSError:
        return None


class SsdLedger:
    """Bytes this rank wrote to each nvme_path (Note [endurance budget])."""

    def __init__(self, engine, nvme_paths: List[str]):
        self.engine = engine
        self.paths = list(nvme_paths)
        self.checkpoints: Dict[str, int] = {p: 0 for p in self.paths}

    def swap_written(self) -> Dict[str, int]:
        """Bytes written to this rank's swap files on each drive: every write, a striped file's
        to the drive each extent is on (Note [striped swap files] in aio/_stripe.py)."""
        out = {p: 0 for p in self.paths}
        for drive, (_, written) in self.engine.swap_dirs.drive_bytes().items():
            if drive in out:
                out[drive] += written
        return out

    def written(self) -> Dict[str, int]:
        swap = self.swap_written()
        return {p: swap[p] + self.checkpoints[p] for p in self.paths}

    def add_checkpoint(self, path: str) -> None:
        """Count the bytes a committed checkpoint wrote (cloned files write none)."""
        where = _holder(path, self.paths)
        if where is None:
            return
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError):
            return
        self.checkpoints[where] += sum(e["bytes"] for e in files.values() if "crc32c" not in e)


def local_ranks() -> int:
    """Ranks of this node, which share its disks (torchrun's LOCAL_WORLD_SIZE; else 1)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def sharing(cfg) -> Dict[str, int]:
    """Ranks of this node that write to each drive (Note [many drives] in _offload/_drives.py)."""
    z, ranks = cfg.zero, local_ranks()
    out: Dict[str, int] = {}
    for drive in configured_drives(cfg):
        out[drive] = sum(1 for r in range(ranks) if any(
            section.device == "nvme" and section.nvme_path and drive in rank_drives(section.nvme_path, z.nvme_layout, r)
            for section in (z.offload_optimizer, z.offload_param)))
    return out


def budget_warning(aio_cfg, per_step: Dict[str, int], steps: int,
                   ranks_per_drive: Optional[Dict[str, int]] = None) -> Optional[str]:
    """The warning of Note [endurance budget], or None (no budget, or within it);
    ``ranks_per_drive``: ``sharing``'s (None: every rank of the node on every drive)."""
    if aio_cfg.endurance_tbw is None:
        return None
    budget = aio_cfg.endurance_tbw * TB
    over = []
    for path, nbytes in per_step.items():
        projected = nbytes * steps * (ranks_per_drive or {}).get(path, local_ranks())
        if projected > aio_cfg.endurance_warn_fraction * budget:
            over.append(f"{path}: {projected / TB:.3g} TB ({100 * projected / budget:.2g}% of "
                        f"aio.endurance_tbw {aio_cfg.endurance_tbw:g} TB)")
    if not over:
        return None
    return (f"this run is projected to write {'; '.join(over)} from its first step's "
            f"{max(per_step.values()) / 2**30:.2f} GiB per rank over {steps} steps, more than "
            f"aio.endurance_warn_fraction = {aio_cfg.endurance_warn_fraction:g} of the SSD's rated endurance; "
            f"keep optimizer states in host memory (zero.offload_optimizer.device: cpu) or compressed "
            f"(zero.offload_optimizer.moments: bf16), or raise the fraction if this is intended")
