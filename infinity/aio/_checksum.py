"""Checksums of swap files: a table of CRC32C sums, one per 4 KiB block, in host memory.

Note [swap checksums]: every swap file the engine writes (``params.swp``, the optimizer's
``master.swp`` / ``exp_avg.swp`` / ``exp_avg_sq.swp`` / ``grad.swp``, the Init store's
``init.swp``) is opened through a ``SwapPath``: its path with a ``BlockSums`` table attached.
``AsyncIO`` hands the table to native/aio with every request on that path, whichever handle
makes it (the stores' readers and writers, a checkpoint's save or load). A write records the
CRC32C of each block it covers, computed on the I/O thread from the caller's memory just before
the write is issued; a read checks every block whose sum is known as soon as it has landed,
before anything can use it, and fails with ``CorruptionError`` (EBADMSG underneath) naming the
file, the block's byte offset, what the range holds and when. CRC32C because the CPU computes
it (SSE4.2 ``crc32``, chosen at run time by CPUID; a scalar table loop elsewhere) at several
GB/s per core with 20 lines of code of our own, and it catches every burst of up to 32 bits and
any odd number of flipped bits; xxh3 would be faster still but is a thousand lines to carry.

The sums live only in this process: swap files are scratch of one run (Note [swap directories]
in _swap.py), never read by another, so nothing is persisted. A block never written through
its table (a fresh, zero-filled file) is not checked. Host memory: 8 bytes per 4 KiB block
written (1/512 of the swap bytes), allocated 64 MiB of file at a time as writes reach it.
``aio.checksums: false`` turns it all off (the paths stay plain strings).
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Union

import numpy as np

from ..errors import InvariantError, OutOfMemory
from ._native import ffi, lib
from ._stripe import DriveTally, StripedPath, member_bytes, tally_of

BLOCK = 4096
ENTRY_BYTES = 8  # per block (Note [block sums] in native/aio/sums.h)


class BlockSums:
    """The native sum table of one file. ``describe(byte offset)`` says what the file holds
    there and ``when()`` when it is read (a training step), both for error messages."""

    def __init__(self, capacity: int, name: str):
        out = ffi.new("infinity_aio_sums **")
        rc = lib.infinity_aio_sums_create(max(int(capacity), 0), out)
        if rc < 0:
            raise OutOfMemory(f"no host memory for the checksum table of {name}")
        self._ptr = ffi.gc(out[0], lib.infinity_aio_sums_destroy)
        self.name = name
        self.describe: Callable[[int], str] = lambda offset: ""
        self.when: Callable[[], str] = lambda: ""

    @property
    def native(self):
        return self._ptr

    @property
    def nbytes(self) -> int:
        """Host memory the table holds now."""
        return int(lib.infinity_aio_sums_bytes(self._ptr))

    @property
    def mismatches(self) -> int:
        return int(lib.infinity_aio_sums_mismatches(self._ptr))

    @property
    def unrecorded(self) -> int:
        """Blocks written whose sum could not be kept (no memory for the table): unchecked."""
        return int(lib.infinity_aio_sums_unrecorded(self._ptr))

    def entries(self, first: int, count: int):
        """The entries of blocks [first, first + count) as a uint64 array (Note [block sums]
        in native/aio/sums.h: CRC32C in the low 32 bits, the prefix length covered above)."""
        out = np.zeros(count, dtype=np.uint64)
        rc = lib.infinity_aio_sums_get(self._ptr, first, count, ffi.from_buffer("uint64_t[]", out))
        if rc < 0:
            raise InvariantError(f"bad block range [{first}, {first + count}) of the sums of {self.name}")
        return out

    def set_entries(self, first: int, entries) -> None:
        """Vouch for blocks [first, first + len(entries)) with these entries (a clone made
        the file hold bytes whose sums are known); OutOfMemory if the table cannot hold them."""
        arr = np.ascontiguousarray(entries, dtype=np.uint64)
        rc = lib.infinity_aio_sums_set(self._ptr, first, len(arr), ffi.from_buffer("uint64_t[]", arr))
        if rc < 0:
            raise OutOfMemory(f"no host memory for the checksum table of {self.name}")

    @staticmethod
    def bytes_for(file_bytes: int) -> int:
        """Host memory of a table once ``file_bytes`` of its file have been written."""
        return -(-file_bytes // BLOCK) * ENTRY_BYTES


class SwapPath(str):
    """The path of a swap file, carrying its ``BlockSums`` (None: not checksummed) and its
    drive's ``DriveTally`` (Note [striped swap files] in _stripe.py): ``AsyncIO`` records and
    checks sums on every transfer made through it (Note [swap checksums]) and counts its bytes.
    A ``str`` everywhere else; pickled, it is the plain path."""

    sums: Optional[BlockSums]
    tally: Optional[DriveTally]

    def __new__(cls, path: str, sums: Optional[BlockSums], tally: Optional[DriveTally] = None):
        self = super().__new__(cls, path)
        self.sums = sums
        self.tally = tally
        return self

    def __reduce__(self):
        return (str, (str(self),))


class StripedSums:
    """The tables of a striped file's members, labelled as one: ``describe`` is told the
    logical offset of a member's block (Note [striped swap files] in _stripe.py)."""

    def __init__(self, path: StripedPath, tables: List[BlockSums]):
        self._path, self._tables = path, tables
        self._describe: Callable[[int], str] = lambda offset: ""
        self._when: Callable[[], str] = lambda: ""

    @property
    def describe(self) -> Callable[[int], str]:
        return self._describe

    @describe.setter
    def describe(self, fn: Callable[[int], str]) -> None:
        self._describe = fn
        for i, table in enumerate(self._tables):
            table.describe = self._member_describe(i, fn)

    def _member_describe(self, member: int, fn: Callable[[int], str]) -> Callable[[int], str]:
        return lambda offset: fn(self._path.logical(member, offset))

    @property
    def when(self) -> Callable[[], str]:
        return self._when

    @when.setter
    def when(self, fn: Callable[[], str]) -> None:
        self._when = fn
        for table in self._tables:
            table.when = fn

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tables)

    @property
    def mismatches(self) -> int:
        return sum(t.mismatches for t in self._tables)

    @property
    def unrecorded(self) -> int:
        return sum(t.unrecorded for t in self._tables)


def checksummed(path: str, capacity: int, enabled: bool) -> str:
    """``path`` with a fresh table of sums for a file of up to ``capacity`` bytes (each member
    of a striped file its own, for the member's share), or the path as it is when checksums
    are off (``aio.checksums``)."""
    if isinstance(path, StripedPath):
        n = len(path.members)
        return path.with_members([checksummed(m, member_bytes(capacity, path.extent, n, i), enabled)
                                  for i, m in enumerate(path.members)])
    if not enabled:
        return path
    return SwapPath(path, BlockSums(capacity, os.path.basename(path)), tally_of(path))


def sums_of(path) -> Optional[Union[BlockSums, StripedSums]]:
    """A swap file's table of block sums; a striped file's members' tables as one."""
    if isinstance(path, StripedPath):
        tables = [m.sums for m in path.members if isinstance(m, SwapPath) and m.sums is not None]
        return StripedSums(path, tables) if len(tables) == len(path.members) else None
    return path.sums if isinstance(path, SwapPath) else None


def crc32c(data, crc: int = 0, *, scalar: bool = False) -> int:
    """CRC32C of a bytes-like object or contiguous CPU tensor (tests and tools)."""
    buf = bytes(data.numpy().tobytes()) if hasattr(data, "numpy") else bytes(data)
    return int(lib.infinity_aio_crc32c(crc, ffi.from_buffer(buf), len(buf), 1 if scalar else 0))


def crc32c_hardware() -> bool:
    """True if CRC32C runs on the CPU's SSE4.2 instruction."""
    return bool(lib.infinity_aio_crc32c_hardware())
