"""Memory of the emulated device (Note [emulated accelerator] in _emulated.py): its capacity and
statistics, its storages (each counted once however many wrapper tensors view it), and the
host ranges registered as pinned, which queued copies reach by address.

``_lock`` guards the storage counts and the registered ranges; unregistering a range waits
on it for the range's copies in flight.
"""
from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Optional

import torch

_lock = threading.RLock()


# ---------------------------------------------------------------- capacity and statistics


class _Memory:
    """The device's ledger: bytes held now and at the peak, against a capacity, and the running
    counts torch's allocator statistics report (Note [emulated accelerator in torch.accelerator] in
    _emulated_torch.py)."""

    def __init__(self):
        self.allocated = 0
        self.peak = 0
        self.capacity = self.default = int(os.environ.get("INFINITY_EMULATED_MEMORY", str(64 << 30)))
        self.lock = threading.Lock()
        self.blocks = self.blocks_peak = 0  # storages held now, and at most
        self.reset_accumulated()
        self.ooms = 0

    def reset_accumulated(self) -> None:
        """Zero the running totals (``reset_accumulated_memory_stats``)."""
        self.bytes_in = self.bytes_out = 0
        self.blocks_in = self.blocks_out = 0
        self.ooms = 0

    def check(self, nbytes: int) -> None:
        if self.allocated + nbytes > self.capacity:
            self.ooms += 1
            # CUDA's wording (" out of memory. Tried to allocate"), which accelerate's
            # should_reduce_batch_size and the Trainer's auto_find_batch_size look for
            raise torch.OutOfMemoryError(
                f"emulated device out of memory. Tried to allocate {nbytes} bytes with {self.allocated} of "
                f"{self.capacity} bytes allocated (its capacity: INFINITY_EMULATED_MEMORY or set_capacity)")

    def charge(self, nbytes: int) -> None:
        with self.lock:
            self.check(nbytes)
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
            self.blocks += 1
            self.blocks_peak = max(self.blocks_peak, self.blocks)
            self.bytes_in += nbytes
            self.blocks_in += 1

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.allocated -= nbytes
            self.blocks -= 1
            self.bytes_out += nbytes
            self.blocks_out += 1

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.allocated
            self.blocks_peak = self.blocks


_memory = _Memory()


def check_room(nbytes: int) -> None:
    """Raise ``torch.OutOfMemoryError`` if ``nbytes`` more would pass the capacity."""
    _memory.check(nbytes)


def memory_allocated() -> int:
    return _memory.allocated


def max_memory_allocated() -> int:
    return _memory.peak


def reset_peak_memory_stats() -> None:
    _memory.reset_peak()


def reset_accumulated_memory_stats() -> None:
    with _memory.lock:
        _memory.reset_accumulated()


def device_stats() -> dict:
    """The ledger in the nested form of torch's ``getDeviceStats`` (what ``torch.accelerator.memory_stats``
    flattens): the device has no cache, so reserved, active and requested bytes are the allocated ones, each
    storage is one segment, and the large and small pools are not told apart (all is in ``all``)."""
    m = _memory
    with m.lock:
        nbytes = {"current": m.allocated, "peak": m.peak, "allocated": m.bytes_in, "freed": m.bytes_out}
        count = {"current": m.blocks, "peak": m.blocks_peak, "allocated": m.blocks_in, "freed": m.blocks_out}
        ooms, allocs, frees = m.ooms, m.blocks_in, m.blocks_out
    zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}

    def pools(stat: dict) -> dict:
        return {"all": dict(stat), "large_pool": dict(stat), "small_pool": dict(zero)}

    out: dict = {name: pools(nbytes) for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")}
    out.update({name: pools(count) for name in ("allocation", "segment", "active")})
    out.update({"inactive_split": pools(zero), "inactive_split_bytes": pools(zero)})
    out.update({"num_alloc_retries": 0, "num_ooms": ooms, "num_sync_all_streams": 0,
                "num_device_alloc": allocs, "num_device_free": frees,
                "max_split_size": -1, "oversize_allocations": dict(zero), "oversize_segments": dict(zero)})
    return out


def set_capacity(nbytes: int) -> None:
    _memory.capacity = int(nbytes)


def cap_memory(nbytes: Optional[int]) -> None:
    """The accelerator interface's cap: the capacity, or back to its default (None)."""
    _memory.capacity = _memory.default if nbytes is None else int(nbytes)


def total_memory() -> int:
    return _memory.capacity


def free_memory() -> int:
    return _memory.capacity - _memory.allocated


# ---------------------------------------------------------------- device storages


# A device storage (by the address of its host bytes) counts once however many wrappers
# view it; its bytes are released when the last wrapper goes.
_storages: dict = {}


def count_storage(ptr: int, nbytes: int) -> None:
    """A new wrapper views the storage of ``nbytes`` at ``ptr``: charged when it is the first."""
    with _lock:
        entry = _storages.get(ptr)
        if entry is None:
            _memory.charge(nbytes)
            entry = _storages[ptr] = [nbytes, 0]
        entry[1] += 1


def add_view(ptr: int) -> None:
    """One more wrapper views the storage at ``ptr``, which a live wrapper already holds."""
    with _lock:
        _storages[ptr][1] += 1


def drop_view(ptr: int) -> None:
    """A wrapper of the storage at ``ptr`` is gone; the last one releases its bytes."""
    with _lock:
        entry = _storages.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _storages[ptr]
            _memory.release(entry[0])


# ---------------------------------------------------------------- pinned host memory


class _Range:
    """A registered host range: ``owned`` by the caller (``host_register``, as
    ``cudaHostRegister``: a copy in flight holds no reference to it, as a DMA holds none, so
    the memory's users cannot see the copy) or ``cached`` (pinned by the backend itself, as
    CUDA's caching host allocator, which keeps a block until its copies are done)."""

    __slots__ = ("end", "cached", "copies", "idle")

    def __init__(self, end: int, cached: bool):
        self.end, self.cached, self.copies = end, cached, 0
        self.idle = threading.Condition(_lock)


_pinned: dict = {}  # start address -> _Range of every registered host range


def host_register(ptr: int, nbytes: int, cached: bool = False) -> None:
    with _lock:
        _pinned[ptr] = _Range(ptr + nbytes, cached)


def host_unregister(ptr: int) -> None:
    """The caller is about to unmap the range: its copies in flight land first (on CUDA
    unmapping under a DMA is undefined; here it would be a crash)."""
    with _lock:
        r = _pinned.get(ptr)
        if r is not None:
            r.idle.wait_for(lambda: r.copies == 0)
            del _pinned[ptr]


def range_of(t: torch.Tensor) -> Optional[_Range]:
    """The registered range that holds all of host tensor ``t``, if any."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    with _lock:
        return next((r for s, r in _pinned.items() if s <= start and end <= r.end), None)


def is_pinned(t: torch.Tensor) -> bool:
    return range_of(t) is not None


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    pin_result(out)
    return out


def pin_result(t: torch.Tensor) -> None:
    """A host tensor made by ``.to("cpu", non_blocking=True)`` is pinned, as on CUDA, for its life."""
    ptr = t.untyped_storage().data_ptr()
    host_register(ptr, t.untyped_storage().nbytes(), cached=True)
    weakref.finalize(t, host_unregister, ptr)


class Unheld:
    """A host tensor a queued copy reads or writes without holding it: its address, layout and
    the registered range that keeps the memory mapped until the copy is done."""

    def __init__(self, t: torch.Tensor, r: _Range):
        self.ptr, self.nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.range = r
        with _lock:
            r.copies += 1

    def tensor(self) -> torch.Tensor:
        raw = torch.frombuffer((ctypes.c_char * self.nbytes).from_address(self.ptr), dtype=torch.uint8)
        return raw.view(self.dtype).as_strided(self.size, self.stride, self.offset)

    def done(self) -> None:
        with _lock:
            self.range.copies -= 1
            self.range.idle.notify_all()
