"""The one module that knows CUDA from CPU.

Everything else in the package is device-agnostic and asks this module for the device,
host buffers, streams and events, and memory statistics. On a machine without CUDA the
device tier is plain CPU tensors, streams and events are synchronous no-ops, and an
optional ``device_memory_limit`` budget makes "larger than device memory" testable.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .errors import InvariantError, OutOfMemory


class DeviceOutOfMemory(OutOfMemory):
    """The engine's own device allocations would exceed the configured budget."""


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on: its CUDA device under torchrun, else the CPU."""
    if has_cuda():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def native_bf16() -> Tuple[bool, str]:
    """Whether this machine multiplies bf16 matrices natively (decided by its features at
    run time, never by the build machine's), and why, for the log."""
    if has_cuda():
        ok = torch.cuda.is_bf16_supported()
        return ok, f"the CUDA device {'supports' if ok else 'does not support'} bf16"
    native = sorted({"avx512_bf16", "amx_bf16"} & _cpu_flags())
    if native:
        return True, f"this CPU multiplies bf16 natively ({', '.join(native)})"
    return False, ("this CPU has no native bf16 matmul (no avx512_bf16 or amx_bf16; torch's bf16 matmul runs "
                   "tens of times slower than fp32 on it)")


def _cpu_flags() -> set:
    """The CPU's feature flags (Linux); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def comm_backend() -> str:
    return "nccl" if has_cuda() else "gloo"


# ---------------------------------------------------------------- host buffers


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory (CUDA machines only): the CUDA host allocator aligns it."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def to_device(t: torch.Tensor) -> torch.Tensor:
    """A host tensor on the device (a copy on CUDA, the same tensor without an accelerator)."""
    dev = device()
    if t.device == dev:
        return t
    return t.to(dev, non_blocking=True)


# ---------------------------------------------------------------- streams and events


class _SyncEvent:
    """The CPU stand-in for an event: the copy it marks has already happened."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_copy_stream = None


def start_copy_to_device(src: torch.Tensor):
    """Begin copying a host tensor to the device on the side stream for host->device
    traffic; returns ``(device tensor, event)``. The copy overlaps compute on the current
    stream; ``finish_copy_to_device`` orders a stream after it. Without an accelerator the
    host tensor is the device tensor and the event has already happened."""
    global _copy_stream
    if not has_cuda() or src.device == device():
        return src, _SyncEvent()
    if _copy_stream is None:
        _copy_stream = torch.cuda.Stream()
    _copy_stream.wait_stream(torch.cuda.current_stream())  # src was filled before this call
    with torch.cuda.stream(_copy_stream):
        dst = src.to(device(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(_copy_stream)
    return dst, event


def finish_copy_to_device(dst: torch.Tensor, event) -> torch.Tensor:
    """Make the current stream wait for a ``start_copy_to_device`` copy (no CPU wait) and
    let the caching allocator know ``dst`` is now used on it."""
    if has_cuda() and dst.is_cuda:
        stream = torch.cuda.current_stream()
        event.wait(stream)
        dst.record_stream(stream)
    return dst


_d2h_stream = None


def start_copy_to_host(src: torch.Tensor):
    """Begin copying a device tensor into new host memory (pinned on CUDA) on the side stream
    for device->host traffic; returns ``(host tensor, event)``. ``src`` is recorded on that
    stream, so the caching allocator does not reuse its memory before the copy is done even if
    the caller drops it at once. Without an accelerator the copy is made now (a real copy: the
    caller's tensor can be freed) and the event has already happened."""
    global _d2h_stream
    if not has_cuda() or not src.is_cuda:
        return src.detach().clone(), _SyncEvent()
    if _d2h_stream is None:
        _d2h_stream = torch.cuda.Stream()
    _d2h_stream.wait_stream(torch.cuda.current_stream())  # src was produced on the compute stream
    host = torch.empty_like(src, device="cpu", pin_memory=True)
    with torch.cuda.stream(_d2h_stream):
        host.copy_(src.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(_d2h_stream)
    src.record_stream(_d2h_stream)
    return host, event


def wait_copy_to_host(event) -> None:
    """The host tensor of a ``start_copy_to_host`` copy is complete after this."""
    event.synchronize()


# ---------------------------------------------------------------- memory budget


@dataclass
class MemoryStats:
    allocated: int  # bytes the engine holds on the device tier now
    peak: int  # the most it held since the last reset
    limit: Optional[int]  # the budget, or None
    device_total: Optional[int]  # physical device memory (CUDA only)


class DeviceBudget:
    """Charges the engine's own device allocations against ``device_memory_limit``.

    Note: only allocations the engine makes (gathered parameters, staging buffers,
    gradient buckets) are charged; activations belong to the user's model. Exceeding the
    budget raises DeviceOutOfMemory naming it, so a model larger than "device memory" is
    testable on a CPU-only machine.
    """

    def __init__(self, limit: Optional[int] = None):
        self._limit = limit
        self._allocated = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def limit(self) -> Optional[int]:
        return self._limit

    def set_limit(self, limit: Optional[int]) -> None:
        with self._lock:
            self._limit = limit

    def charge(self, nbytes: int, what: str = "buffer") -> None:
        with self._lock:
            if self._limit is not None and self._allocated + nbytes > self._limit:
                raise DeviceOutOfMemory(
                    f"allocating {nbytes} bytes for {what} would exceed device_memory_limit="
                    f"{self._limit} bytes ({self._allocated} already held by the engine); raise "
                    f"device_memory_limit, lower zero.prefetch.max_live_parameters / bucket_size, "
                    f"or offload more state (zero.offload_param.device)"
                )
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more can be charged now."""
        with self._lock:
            return self._limit is None or self._allocated + nbytes <= self._limit

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._allocated -= nbytes
            if self._allocated < 0:
                raise InvariantError("device budget released more bytes than it charged")

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._allocated

    def stats(self) -> MemoryStats:
        total = torch.cuda.get_device_properties(device()).total_memory if has_cuda() else None
        return MemoryStats(self._allocated, self._peak, self._limit, total)




def device_memory_total() -> Optional[int]:
    return torch.cuda.get_device_properties(device()).total_memory if has_cuda() else None


def device_count() -> int:
    return torch.cuda.device_count() if has_cuda() else 0
