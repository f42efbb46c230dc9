"""Swap files spread over several drives, and the bytes each drive moved.

Note [striped swap files]: with ``zero.nvme_layout: stripe`` (Note [many drives] in
_offload/_drives.py) a swap file is a ``StripedPath``: one member file per drive, the logical
file cut into extents of ``extent`` bytes dealt round the members, extent k in member
``k % n`` at ``(k // n) * extent`` (RAID 0 done by the engine, on drives a user need not
assemble). ``AsyncIO`` cuts every request on such a path at extent boundaries and submits each
piece to its member, so the stores, the checkpoints and the Init store read and write logical
offsets and never know. An extent is a multiple of 4096, so each 4 KiB block lies in one member:
each member is a ``SwapPath`` with its own table of block sums, recorded and checked at member
offsets (Note [swap checksums] in _checksum.py), and a corrupt block is named by the member file
and its offset there, while the table's ``describe`` is told the logical offset. An extent is
also a multiple of ``aio.block_size``, so a request of one aio block lands on one drive.

The default extent, 8 MiB (``zero.nvme_stripe_size``): a fetch unit's shard or an optimizer
chunk (tens to hundreds of MiB) then spans every drive of a node's eight, while each piece is
still eight requests of the default 1 MiB block, so cutting costs one submission from Python
per 8 MiB. A piece costs about 2 us of the submitting thread (measured: 0.16 ms to submit 256
MiB in 8 MiB extents, 0.58 ms in 1 MiB ones, 0.08 ms unstriped), so 1 MiB extents would take
some 5% of a core at the 24 GB/s of eight drives; 64 MiB ones would leave a 256 MiB read on
four of them. Each file of a rank starts on another drive (its members rotated), so the master
weights and the two moments, read at the same offsets in the same chunk, come from three drives.

A striped file is never cloned: its extents are not the checkpoint file's layout, and its
drives need not share a filesystem with the checkpoint. A save and a load copy it through
``AsyncIO`` (Note [cloned checkpoints] in _checkpoint/_clone.py says so in its log).

Every swap file's path (striped or not) carries its drive's ``DriveTally``: ``AsyncIO`` adds
the bytes of each request piece it submits to the tally of the drive the piece goes to, so
the telemetry, the summary and the SSD ledger count bytes per drive, checkpoints' copies of
swap files included.
"""
from __future__ import annotations

import os
import threading
from typing import Iterator, Optional, Sequence, Tuple

from ..errors import UsageError


class DriveTally:
    """Bytes read from and written to one drive's swap files, by every handle (thread-safe)."""

    def __init__(self, drive: str):
        self.drive = drive
        self.read = 0
        self.written = 0
        self._lock = threading.Lock()

    def add(self, write: bool, nbytes: int) -> None:
        with self._lock:
            if write:
                self.written += nbytes
            else:
                self.read += nbytes


class StripedPath(str):
    """Note [striped swap files]: a logical swap file over ``members`` (one per drive) in extents
    of ``extent`` bytes. As a ``str`` it is its members' paths joined by ``|``, which names no
    file: whatever treats it as one path fails instead of using one member's bytes."""

    members: Tuple[str, ...]
    extent: int

    def __new__(cls, members: Sequence[str], extent: int):
        if len(members) < 2:
            raise UsageError(f"a striped swap file needs two members or more, got {list(members)}")
        if extent <= 0 or extent % 4096:
            raise UsageError(f"stripe extent {extent} must be a positive multiple of 4096")
        self = super().__new__(cls, "|".join(members))
        self.members = tuple(members)
        self.extent = extent
        return self

    def __reduce__(self):
        return (str, (str(self),))

    def pieces(self, offset: int, length: int) -> Iterator[Tuple[int, int, int, int]]:
        """``(member, member offset, offset in the request, bytes)`` of a request of ``length``
        bytes at logical ``offset``, in order."""
        extent, n = self.extent, len(self.members)
        done = 0
        while done < length:
            k, within = divmod(offset + done, extent)
            take = min(extent - within, length - done)
            yield k % n, (k // n) * extent + within, done, take
            done += take

    def logical(self, member: int, offset: int) -> int:
        """The logical offset of byte ``offset`` of member ``member``."""
        row, within = divmod(offset, self.extent)
        return (row * len(self.members) + member) * self.extent + within

    def with_members(self, members: Sequence[str]) -> "StripedPath":
        return StripedPath(members, self.extent)


def member_bytes(size: int, extent: int, count: int, member: int) -> int:
    """Bytes of member ``member`` of ``count`` for a logical file of ``size`` bytes."""
    rows, rest = divmod(size, extent * count)
    return rows * extent + min(max(rest - member * extent, 0), extent)


def members_of(path) -> Tuple[str, ...]:
    """The files a swap file's bytes are in: its members, or the path itself."""
    return path.members if isinstance(path, StripedPath) else (path,)


def tally_of(path) -> Optional[DriveTally]:
    return getattr(path, "tally", None)


def unlink(path) -> None:
    """Remove a swap file, every member of a striped one."""
    for member in members_of(path):
        os.unlink(member)
