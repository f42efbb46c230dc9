"""Moving a checkpoint's bytes: every transfer through ``infinity.aio``, in bounded chunks.

A tensor in host memory is written or read in place (no copy); a swap file is copied to a
checkpoint file, and back, through ``BUFFERS`` aligned buffers of ``CHUNK_BYTES`` each, the
read of one piece in flight while the previous ones are written: host memory stays at those
buffers (64 MiB) whatever the model size. Files are written front to back so that their CRC-32 is
computed as the bytes go out, and fsynced before they count as written.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from .._offload._swap import new_aio, wait_io
from ..aio import AsyncIO, aligned_empty
from ..aio._checksum import BLOCK
from ..aio._native import ffi, lib
from ..errors import StorageError
from ._clone import block_sums

CHUNK_BYTES = 16 << 20
BUFFERS = 4

Place = Union[torch.Tensor, str]  # a flat tensor, or the path of a file


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    return t.detach().reshape(-1).view(torch.uint8)


def crc_of(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a CPU tensor's bytes, continuing ``crc`` (zlib releases the GIL meanwhile)."""
    return zlib.crc32(memoryview(as_bytes(t).numpy()), crc)


def crc32c_of(t: torch.Tensor, crc: int = 0) -> int:
    """CRC32C of a CPU tensor's bytes, continuing ``crc``."""
    data = as_bytes(t).numpy()
    return int(lib.infinity_aio_crc32c(crc, ffi.from_buffer(data), data.size, 0))


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Mover:
    """The aio handles and bounce buffers of one save, load or export (buffers made on first use)."""

    def __init__(self, aio_cfg=None, chunk_bytes: int = CHUNK_BYTES):
        make = (lambda: new_aio(aio_cfg)) if aio_cfg is not None else AsyncIO
        self.readers = [make() for _ in range(BUFFERS)]
        self.writers = [make() for _ in range(BUFFERS)]
        self.chunk = chunk_bytes
        self._bufs: Optional[List[torch.Tensor]] = None
        self.bytes_read = self.bytes_written = 0
        self._syncer: Optional[ThreadPoolExecutor] = None
        self._syncs: List[Future] = []

    @property
    def buffers(self) -> List[torch.Tensor]:
        if self._bufs is None:
            self._bufs = [aligned_empty(self.chunk) for _ in range(BUFFERS)]
        return self._bufs

    def close(self) -> None:
        for h in self.readers + self.writers:
            h.close()
        self._bufs = None
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)

    def sync_soon(self, path: str) -> None:
        """fsync ``path`` on a helper thread while the next file is written (a flush of the
        disk's cache is slow; the writes need not wait for it). ``synced`` waits for them."""
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="infinity-checkpoint-fsync")
        self._syncs.append(self._syncer.submit(fsync_path, path))

    def synced(self) -> None:
        """Every ``sync_soon`` file is on disk (raises the first fsync error)."""
        pending, self._syncs = self._syncs, []
        for f in pending:
            f.result()

    def _wait(self, handle, what: str) -> None:
        wait_io(handle, what)

    # ---------------------------------------------------------------- the pipeline

    def stream(self, pieces: List[Tuple[str, int, int]], consume) -> None:
        """Read ``(path, byte offset, nbytes)`` pieces, cut to the buffer size, in order;
        call ``consume(buffer view, writer handle)`` on each once it has landed, while the
        next piece is read. ``consume`` may submit a write of the view on the handle given:
        the buffer is reused only after that handle's writes landed."""
        cut = [(p, o + k, min(self.chunk, n - k)) for p, o, n in pieces for k in range(0, n, self.chunk)]
        bufs = self.buffers
        for j in range(len(cut) + 1):
            if j < len(cut):
                i = j % BUFFERS
                self._wait(self.writers[i], "checkpoint writes")  # the buffer is free again
                path, off, n = cut[j]
                self.readers[i].pread(bufs[i][:n], path, off)
                self.bytes_read += n
            if j > 0:
                i = (j - 1) % BUFFERS
                path, off, n = cut[j - 1]
                self._wait(self.readers[i], f"reading {path} at byte {off}")
                consume(bufs[i][:n], self.writers[i])
        for w in self.writers:
            self._wait(w, "checkpoint writes")

    def checksum(self, path: str, nbytes: int, kind: str = "crc32", blocks: Optional[np.ndarray] = None) -> int:
        """The CRC-32 (``kind`` "crc32") or CRC32C ("crc32c") of the file's first ``nbytes``;
        ``blocks``: also the CRC32C of each 4 KiB block, into that uint32 array."""
        state = [0, 0]  # checksum, bytes so far

        def fold(buf, _):
            if kind == "crc32c":
                state[0] = crc32c_of(buf, state[0])
            else:
                state[0] = crc_of(buf, state[0])
            if blocks is not None:
                first = state[1] // BLOCK
                block_sums(buf.numpy(), blocks[first : first + -(-buf.numel() // BLOCK)])
            state[1] += buf.numel()

        self.stream([(path, 0, nbytes)], fold)
        return state[0]


class FileSink:
    """One checkpoint file written front to back, preallocated to ``nbytes`` when known;
    ``close`` returns (bytes, CRC-32) and has it fsynced (``Mover.synced`` waits for that)."""

    def __init__(self, path: str, mover: Mover, nbytes: int = 0):
        self.path, self.mover = path, mover
        self.size, self.crc = 0, 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # no block allocation on the write path
        finally:
            os.close(fd)

    def _put(self, buf: torch.Tensor, handle: AsyncIO) -> None:
        handle.pwrite(buf, self.path, self.size)  # the CRC is computed while the write is in flight
        self.crc = crc_of(buf, self.crc)
        self.size += buf.numel()
        self.mover.bytes_written += buf.numel()

    def append(self, source: Place, byte_offset: int, nbytes: int) -> None:
        """Append ``nbytes`` of ``source`` (a tensor's bytes or a file) from ``byte_offset``."""
        if nbytes == 0:
            return
        if isinstance(source, str):
            self.mover.stream([(source, byte_offset, nbytes)], self._put)
            return
        view = as_bytes(source)[byte_offset : byte_offset + nbytes]
        if view.device.type == "cpu":  # in place, in pieces: a piece's CRC while the previous one is written
            for k in range(0, nbytes, self.mover.chunk):
                self._put(view[k : k + self.mover.chunk], self.mover.writers[0])
            return
        for k in range(0, nbytes, self.mover.chunk):  # device memory: through a host buffer
            n = min(self.mover.chunk, nbytes - k)
            self.mover._wait(self.mover.writers[0], "checkpoint writes")
            buf = self.mover.buffers[0][:n]
            buf.copy_(view[k : k + n])
            self._put(buf, self.mover.writers[0])

    def zeros(self, nbytes: int) -> None:
        if nbytes > 0:
            self.append(torch.zeros(nbytes, dtype=torch.uint8), 0, nbytes)

    def close(self) -> Tuple[int, int]:
        for w in self.mover.writers:
            self.mover._wait(w, f"writing {self.path}")
        self.mover.sync_soon(self.path)
        return self.size, self.crc


def copy_into(mover: Mover, pieces: List[Tuple[str, int, int]], dest: Place, dest_offsets: List[int]) -> None:
    """Read each ``(path, byte offset, nbytes)`` piece into ``dest`` (a tensor or a file) at
    the byte offset ``dest_offsets`` gives for it."""
    if isinstance(dest, torch.Tensor) and dest.device.type == "cpu":
        flat = as_bytes(dest)
        for (path, off, n), at in zip(pieces, dest_offsets):  # in place, no buffer
            mover.readers[0].pread(flat[at : at + n], path, off)
            mover.bytes_read += n
        mover._wait(mover.readers[0], "reading a checkpoint into memory")
        return
    targets = iter([(at + k, min(mover.chunk, n - k)) for (_, _, n), at in zip(pieces, dest_offsets)
                    for k in range(0, n, mover.chunk)])

    def put(buf, handle):
        at, n = next(targets)
        if isinstance(dest, str):
            handle.pwrite(buf, dest, at)
            mover.bytes_written += n
        else:
            as_bytes(dest)[at : at + n].copy_(buf)

    mover.stream(pieces, put)


def check_file(mover: Mover, path: str, entry: dict, blocks: Optional[np.ndarray] = None) -> None:
    """The file has the manifest ``entry``'s bytes and CRC-32 (``crc32``) or CRC32C
    (``crc32c``, a cloned file: Note [cloned checkpoints] in _clone.py), or StorageError naming
    it; ``blocks``: its 4 KiB blocks' CRC32Cs, from the same read."""
    nbytes = entry["bytes"]
    kind = "crc32c" if "crc32c" in entry else "crc32"
    crc = entry[kind]
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise StorageError(e.errno, f"checkpoint file {path} is missing ({e.strerror}); the checkpoint is "
                                    f"incomplete: load another tag or the previous checkpoint") from e
    if size != nbytes:
        raise StorageError(f"checkpoint file {path} has {size} bytes, the manifest says {nbytes}: the file is "
                           f"truncated or was changed; load another tag or the previous checkpoint")
    got = mover.checksum(path, nbytes, kind, blocks)
    if got != crc:
        name = "CRC32C" if kind == "crc32c" else "CRC-32"
        raise StorageError(f"checkpoint file {path} fails its checksum ({name} {got:08x}, the manifest says "
                           f"{crc:08x}): its contents are corrupt; load another tag or the previous checkpoint")
