"""A fixed set of equal, aligned host buffers reused for every staged transfer (the NVMe
parameter tier's reads: _nvme_param_store.py)."""

from __future__ import annotations

import threading
from typing import List, Optional

import torch

from ..aio import aligned_empty
from ..errors import InfinityError
from ._swap import nbytes_of


class PoolExhausted(InfinityError, RuntimeError):
    pass


class HostPool:
    """A fixed set of equal, aligned host buffers reused for every staged transfer.

    Note [buffers under a copy]: a buffer that a host->device copy may still be reading comes
    back with the copy's event (``put(buf, after=event)``) and is handed out again only once the
    event has happened; the CPU waits for it only when a ``get`` finds no other buffer. A DMA
    holds no reference, so nothing but the event can tell that the buffer is still in use."""

    def __init__(self, numel: int, count: int, dtype: torch.dtype, what: str, category: str = "other"):
        self.numel, self.count, self.dtype, self.what = numel, count, dtype, what
        self.category = category  # Note [host memory ledger] in aio/_memory.py
        self._free: List[torch.Tensor] = []
        self._copying: List[tuple] = []  # (event, buffer) returned while a copy may read it, oldest first
        self._made = 0  # buffers are allocated on first need (a one-rank CPU run reads elsewhere)
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.count * nbytes_of(self.numel, self.dtype)

    def get(self, numel: int, timeout: float = 600.0, *, block: bool = True) -> Optional[torch.Tensor]:
        if numel > self.numel:
            raise PoolExhausted(f"{self.what}: a request of {numel} elements exceeds the buffer size {self.numel}; "
                                f"set the buffer size to at least {numel} (or leave it unset to size it automatically)")
        with self._cond:
            self._settle(wait=False)
            if not self._free and self._made < self.count:
                self._made += 1
                return aligned_empty(self.numel, self.dtype, what=self.category)
            if not self._free and self._copying and block:
                self._settle(wait=True)  # the oldest copy: the only CPU wait on a staging buffer
            if not block and not self._free:
                return None
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise PoolExhausted(f"{self.what}: all {self.count} buffers stayed in use for {timeout:.0f}s")
            return self._free.pop()

    def put(self, buf: torch.Tensor, after=None) -> None:
        """Give ``buf`` back; ``after``: the event of a copy that may still read it (Note
        [buffers under a copy])."""
        with self._cond:
            if after is None or after.query():
                self._free.append(buf)
                self._cond.notify()
            else:
                self._copying.append((after, buf))

    def _settle(self, wait: bool) -> None:
        """Buffers whose copies have landed become free; ``wait``: the oldest at least."""
        if wait and self._copying:
            self._copying[0][0].synchronize()
        landed = [buf for event, buf in self._copying if event.query()]
        self._copying = [(e, b) for e, b in self._copying if not any(b is x for x in landed)]
        self._free.extend(landed)

    def clear(self) -> None:
        """Drop the returned buffers (the engine closed); a later ``get`` makes them again."""
        with self._cond:
            self._settle(wait=False)
            for event, _ in self._copying:
                event.synchronize()  # nothing is unmapped under a copy
            self._settle(wait=False)
            self._made -= len(self._free)
            self._free.clear()

    @property
    def free(self) -> int:
        """Buffers a ``get`` would return now without waiting (made or not yet made)."""
        with self._cond:
            self._settle(wait=False)
            return len(self._free) + self.count - self._made


class ShardsUnderCopy:
    """Host tensors a copy to the device may still read, each kept alive (so its memory is not
    recycled or rewritten) until the copy's event (Note [buffers under a copy])."""

    def __init__(self):
        self._copying: List[tuple] = []  # (event, tensor), oldest first
        self._lock = threading.Lock()  # the forward gives shards back while the step's thread takes outputs

    def keep(self, shard: torch.Tensor, event) -> None:
        with self._lock:
            self.prune()
            if not event.query():
                self._copying.append((event, shard))

    def prune(self) -> None:
        """Let go of the tensors whose copies have landed."""
        self._copying = [(e, t) for e, t in self._copying if not e.query()]

    def pruned(self) -> None:
        with self._lock:
            self.prune()

    def wait(self) -> None:
        """Every copy still reading one has landed."""
        with self._lock:
            copying, self._copying = self._copying, []
        for event, _ in copying:
            event.synchronize()
