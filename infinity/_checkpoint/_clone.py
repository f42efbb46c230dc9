"""Checkpoint files cloned from swap files, and swap files cloned back, where the filesystem can.

Note [cloned checkpoints]: a state on the NVMe tier is a swap file whose first ``nbytes`` are
exactly the checkpoint file's contents (Note [checkpoint layout] in _format.py). Where the swap
directory and the checkpoint directory share extents (Note [cloned ranges] in aio/_clone.py),
a save clones that range instead of streaming it through the bounce buffers: metadata only,
and copy-on-write keeps the checkpoint's bytes when the next steps rewrite the swap file. The
swap file's writes have landed first (``checkpoint_sources`` / ``checkpoint_parts`` wait for
them). Nothing else changes: the file is fsynced before it counts as written, the commit is the
same (Note [crash-safe commit] in _save.py), and the manifest still holds each file's size and
checksum. The checksum of a cloned file is the CRC32C combined from the swap file's table of
block sums (Note [swap checksums] in aio/_checksum.py, Note [combined sums] in
aio/_crc_combine.py), recorded as ``crc32c`` instead of ``crc32``; blocks the table does not
vouch for are read from the clone, and a source without a table (``aio.checksums: false``, the
staging files of compressed moments) is read whole for its CRC-32 as before. A load verifies
each file as always, computing its block sums in the same pass; a file that fills a swap file
from offset 0 at the same offsets (same world size and layout) is then cloned back and the
swap file's table is given those sums. Elsewhere (ext4, two filesystems) both copy as before,
and the log says once per directory pair which it did and why. A swap file striped over several
drives is always copied (Note [striped swap files] in aio/_stripe.py).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import numpy as np

from .._runtime._log import logger
from ..aio._checksum import BLOCK, sums_of
from ..aio._clone import CloneSupport, clone_range, clone_support
from ..aio._crc_combine import combine_blocks
from ..aio._native import ffi, lib
from ..aio._stripe import StripedPath

READ_PIECE = 16 << 20  # blocks without a known sum are read from the clone this much at a time


class Cloner:
    """One save's or load's decisions: whether each (source directory, destination directory)
    pair shares extents, probed once and logged once; ``enabled`` False always copies."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._pairs: Dict[Tuple[int, int], CloneSupport] = {}
        self.cloned_bytes = 0
        self._striped_said = False

    def can(self, src: str, dst_dir: str) -> bool:
        if not self.enabled or not isinstance(src, str):
            return False
        if isinstance(src, StripedPath):  # Note [striped swap files] in aio/_stripe.py
            if not self._striped_said:
                self._striped_said = True
                logger.info("checkpoint: copying the NVMe states striped over %d drives (a striped swap file is not "
                            "the checkpoint file's layout)", len(src.members))
            return False
        src_dir = os.path.dirname(os.fspath(src))
        key = (os.stat(src_dir).st_dev, os.stat(dst_dir).st_dev)
        if key not in self._pairs:
            self._pairs[key] = support = clone_support(src_dir, dst_dir)
            verb = "cloning" if support.ok else "copying"
            logger.info(f"checkpoint: {verb} the NVMe states between {src_dir} and {dst_dir}: {support.reason}")
        return self._pairs[key].ok

    def clone_out(self, src: str, dest: str, nbytes: int, checksum_by_reading) -> dict:
        """Clone ``src``'s first ``nbytes`` into the new file ``dest``; its manifest entry.
        ``checksum_by_reading(path, nbytes)`` gives the CRC-32 where the sums cannot."""
        clone_range(src, 0, dest, 0, nbytes)
        self.cloned_bytes += nbytes
        crc = combined_crc32c(src, dest, nbytes)
        if crc is None:
            return {"bytes": nbytes, "crc32": checksum_by_reading(dest, nbytes)}
        return {"bytes": nbytes, "crc32c": crc}

    def can_back(self, src: str, dest) -> bool:
        """Whether the checkpoint file ``src`` can be cloned over the swap file ``dest``."""
        return not isinstance(dest, StripedPath) and self.can(src, os.path.dirname(dest))

    def clone_back(self, src: str, dest, nbytes: int, entries: Optional[np.ndarray]) -> None:
        """Clone the verified checkpoint file ``src`` over ``dest``'s first ``nbytes``; the
        swap file's table vouches for them with ``entries``, computed by the verify."""
        clone_range(src, 0, os.fspath(dest), 0, nbytes, create=False)
        self.cloned_bytes += nbytes
        sums = sums_of(dest)
        if sums is not None and entries is not None:
            sums.set_entries(0, entries)


def combined_crc32c(src, clone: str, nbytes: int) -> Optional[int]:
    """CRC32C of ``clone``'s ``nbytes`` from ``src``'s table of block sums (None when ``src``
    has none); the blocks it does not vouch for are read from ``clone``."""
    sums = sums_of(src)
    if sums is None:
        return None
    count = -(-nbytes // BLOCK)
    if count == 0:
        return 0
    entries = sums.entries(0, count)
    want = np.full(count, BLOCK, dtype=np.uint64)
    want[-1] = nbytes - (count - 1) * BLOCK
    crcs = (entries & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    unknown = np.flatnonzero((entries >> np.uint64(32)) != want)
    if len(unknown):
        _sum_blocks(clone, nbytes, unknown, crcs)
    return combine_blocks(crcs, BLOCK, int(want[-1]))


def _sum_blocks(path: str, nbytes: int, blocks: np.ndarray, out: np.ndarray) -> None:
    """out[k] = CRC32C of block k of ``path`` for each k in ``blocks`` (ascending), reading
    runs of consecutive blocks together."""
    fd = os.open(path, os.O_RDONLY)
    try:
        runs = np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1)
        for run in runs:
            first, last = int(run[0]), int(run[-1]) + 1
            for lo in range(first, last, READ_PIECE // BLOCK):
                hi = min(last, lo + READ_PIECE // BLOCK)
                data = os.pread(fd, min(hi * BLOCK, nbytes) - lo * BLOCK, lo * BLOCK)
                block_sums(data, out[lo:hi])
    finally:
        os.close(fd)


def block_sums(data, out: np.ndarray) -> None:
    """CRC32C of each 4 KiB block of ``data`` (the last may be shorter) into ``out`` (uint32)."""
    buf = ffi.from_buffer(data)
    whole = len(data) // BLOCK
    if whole:
        lib.infinity_aio_crc32c_blocks(buf, whole, ffi.from_buffer("uint32_t[]", out))
    if len(data) % BLOCK:
        out[whole] = lib.infinity_aio_crc32c(0, buf + whole * BLOCK, len(data) % BLOCK, 0)


def entries_of(crcs: np.ndarray, nbytes: int) -> np.ndarray:
    """Table entries (Note [block sums] in native/aio/sums.h) for blocks with CRC32Cs ``crcs``
    covering ``nbytes``."""
    lens = np.full(len(crcs), BLOCK, dtype=np.uint64)
    if len(crcs):
        lens[-1] = nbytes - (len(crcs) - 1) * BLOCK
    return (lens << np.uint64(32)) | crcs.astype(np.uint64)
