"""A swap file whose writes rotate over several handles while reads wait only for the writes
they overlap (Note [write ordering]), and the master weights' file built on it when the
parameter store and the NVMe optimizer store share it (Note [parameters from the master] in
_placement.py).
"""

from __future__ import annotations

import threading
from typing import List

import torch

from ..aio._checksum import checksummed
from ..aio._handle import close_handles
from ._swap import Swap, new_aio, wait_io

WRITE_HANDLES = 4  # the writes rotate over these (Note [write ordering])


class OrderedWrites:
    """Note [write ordering]: the overlapped step publishes a range before its write has
    landed, so a read waits for the writes that overlap its range, and only for those:
    writes rotate over WRITE_HANDLES handles, and a read waits for the handles holding an
    overlapping write (a prefetch, ``block`` off, does not wait: it tries again later).
    Waiting also raises a failed write's error, so none goes unseen. Offsets are elements of
    ``itemsize`` bytes."""

    def __init__(self, path, itemsize: int, aio_cfg, rank: int):
        self.path = path
        self.itemsize = itemsize
        self.bytes_written = 0
        self._rank = rank
        self._handles = [new_aio(aio_cfg) for _ in range(WRITE_HANDLES)]
        self._next = 0
        self._writes: List[tuple] = []  # (start, end, handle) of writes not yet seen to land
        self._lock = threading.Lock()  # the step's thread writes while the forward reads

    def write(self, offset: int, values: torch.Tensor) -> None:
        """Submit ``values`` at element ``offset``; the handle keeps them alive until written."""
        with self._lock:
            handle = self._handles[self._next]
            self._next = (self._next + 1) % len(self._handles)
        self._reap(handle)  # outside the lock: a read must not wait for this write's predecessor
        with self._lock:
            handle.pwrite(values, self.path, offset * self.itemsize)
            self._writes.append((offset, offset + values.numel(), handle))
            self.bytes_written += values.numel() * self.itemsize

    def _reap(self, handle) -> None:
        """Collect ``handle``'s earlier writes before it takes another (they were submitted
        WRITE_HANDLES writes ago, so have mostly landed): a handle keeps the tensors it wrote
        alive until collected, and the step's output tensors would otherwise stay mapped, up
        to the whole parameter space of them, until some read waited for them. So at most
        WRITE_HANDLES written outputs are uncollected (Note [one memory model] in _memory_plan.py).
        Only the step's thread writes; a read waiting on the same handle meanwhile is fine
        (``landed`` drops only the writes it saw)."""
        with self._lock:
            mine = [w for w in self._writes if w[2] is handle]
        if mine:
            wait_io(handle, f"parameter shard writes on rank {self._rank}")
            done = {id(w) for w in mine}
            with self._lock:
                self._writes = [w for w in self._writes if id(w) not in done]

    def landed(self, offset: int, numel: int, *, block: bool = True) -> bool:
        """Every write overlapping [offset, offset + numel) has landed (Note [write ordering]);
        without ``block``, False instead of waiting while one is still in flight."""
        end = offset + numel
        with self._lock:
            mine = [w for w in self._writes if w[0] < end and w[1] > offset]
        handles = list({id(h): h for _, _, h in mine}.values())
        if not block and any(h.in_flight() for h in handles):
            return False
        for h in handles:
            wait_io(h, f"parameter shard writes on rank {self._rank}")
        done = {id(w) for w in mine}
        with self._lock:
            self._writes = [w for w in self._writes if id(w) not in done]
        return True

    def close(self) -> None:
        """Close the handles (Note [closing handles] in aio/_handle.py); a second call does nothing."""
        handles, self._handles = self._handles, []
        close_handles(handles)


class MasterFile:
    """master.swp when the parameter store and the NVMe optimizer store share it (Note
    [parameters from the master] in _placement.py): built first, by the composition root, and
    given to both at construction. The parameter store writes the step's master weights
    through ``writes``; the optimizer store writes only the moments, and waits for
    ``writes.landed`` before it reads the file or hands it to a checkpoint."""

    def __init__(self, swap: Swap, total: int, aio_cfg):
        self.total = total  # elements: the optimizer's flat space
        nbytes = 4 * total
        # Note [swap checksums] in _checksum.py
        self.path = checksummed(swap.file("master.swp", nbytes), nbytes, aio_cfg.checksums)
        self.writes = OrderedWrites(self.path, 4, aio_cfg, swap.rank)

    def landed(self, offset: int, numel: int, *, block: bool = True) -> bool:
        return self.writes.landed(offset, numel, block=block)

    def close(self) -> None:
        self.writes.close()
