"""Host tensors handed back after use and handed out again, instead of fresh allocations.

Note [recycled host memory]: on a CPU-only run the engine allocates the same sizes over and
over: each step's fresh parameter shards (Note [hand-off] in _nvme_param_store.py) and the gathered
parameters of every fetch. A fresh allocation of that size is a new mapping, so each use
pays a page fault per page and an unmap on free; that cost on the critical path was larger
than the copies into the memory. A ``Recycler`` keeps a bounded number of returned tensors
and hands one out again when its size and dtype match. A tensor is reused only once nothing
else refers to its storage (no parameter view, no autograd saved tensor, no I/O request in
flight), so a late reader can never see the bytes of a later use: the owner returns it when
it is done with it, and the storage's use count says whether anybody else is.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch

from ..aio._memory import release_pages

_BASELINE = "_infinity_recycle_refs"  # attribute: the storage's use count when it was new


def _use_count(t: torch.Tensor) -> Optional[int]:
    query = getattr(torch._C, "_storage_Use_Count", None)
    return None if query is None else query(t.untyped_storage()._cdata)


def _unshared(t: torch.Tensor) -> bool:
    """Nothing but the tensor (and what it was allocated with) refers to its storage. A torch
    without the query never reuses: always correct, only slower."""
    n = _use_count(t)
    return n is not None and n <= getattr(t, _BASELINE)


class Recycler:
    """At most ``capacity`` bytes of returned tensors, reused for requests of the same
    numel and dtype; ``allocate(numel, dtype)`` makes new ones (aligned host memory, for
    O_DIRECT). Thread-safe: the optimizer step returns and takes from its own thread."""

    def __init__(self, capacity: int, allocate: Callable[[int, torch.dtype], torch.Tensor]):
        self.capacity = capacity
        self._allocate = allocate
        self._free: List[torch.Tensor] = []
        self._pooled = 0
        self._lock = threading.Lock()
        self.reused = 0  # requests served from returned tensors (for tests and telemetry)

    @property
    def pooled_bytes(self) -> int:
        return self._pooled

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() == numel and t.dtype == dtype and _unshared(t):
                    del self._free[i]
                    self._pooled -= _nbytes(t)
                    self.reused += 1
                    return t
        t = self._allocate(numel, dtype)
        setattr(t, _BASELINE, _use_count(t))
        return t

    def give(self, t: Optional[torch.Tensor]) -> None:
        """Return a tensor that ``take`` handed out (anything else is left alone). Whoever
        still uses its memory must hold a view, not this tensor object: the check counts
        tensors on the storage, not references to one tensor."""
        if t is None or getattr(t, _BASELINE, None) is None:
            return
        n = _nbytes(t)
        with self._lock:
            # Full: the newcomer goes, not the oldest. Uses come in the same order every step,
            # so what stays is what the next step asks for first (a unique size included).
            if self._pooled + n <= self.capacity and not any(x is t for x in self._free):
                self._free.append(t)
                self._pooled += n

    def clear(self) -> None:
        """Drop every returned tensor (the engine closed): their memory goes with the last user."""
        with self._lock:
            self._free.clear()
            self._pooled = 0

    def release_idle(self) -> int:
        """Give the pages of the returned tensors nobody uses any more back to the kernel,
        keeping them for reuse (Note [released pages] in aio/_memory.py): called where they
        would otherwise sit idle through the activation peak. A tensor still shared (a write
        in flight, a view) keeps its pages. Returns the bytes released."""
        with self._lock:
            return sum(release_pages(t) for t in self._free if _unshared(t))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
