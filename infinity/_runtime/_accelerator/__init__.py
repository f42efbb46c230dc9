"""The accelerator layer: the one place that knows which device this process computes on.

Everything else in the package is device-agnostic and asks this layer for the device, pinned
host memory, copies between host and device ordered by events, and memory statistics.
Three kinds (``INFINITY_ACCELERATOR``; unset or ``auto``: CUDA where torch sees a GPU, else
the CPU):

- ``cuda``: ``_cuda.py``, the only module of the package that calls ``torch.cuda``;
- ``emulated``: ``_emulated.py``, a device that behaves like CUDA where correctness depends
  on it (asynchronous copies that land late, poisoned until then; pinned memory as a
  property; mixing host and device tensors refused), for tests on machines without a GPU.
  Never chosen unless asked for (Note [emulated accelerator] in _emulated.py);
- ``cpu``: the device tier is plain host tensors, copies are the tensors themselves and
  events have already happened; an optional ``device_memory_limit`` budget makes "larger
  than device memory" testable.

Note [copy ordering]: how copies are ordered, as FSDP2 orders its own. A host->device copy
runs on a side stream and waits for nothing: its source was filled by the CPU or by NVMe, and
the CPU is done with it when it issues the copy; the compute stream waits on the copy's
event (``finish_copy_to_device``), never on the whole side stream, and the CPU never waits
for it. The host buffer is reused only after that event (``copy_done``): the caller keeps the
event with the buffer. A device->host copy waits on an event of the compute stream (its
source was produced there) and the CPU waits on the copy's own event before reading the host
buffer (``wait_copy_to_host``). No collective wait blocks the CPU (``_comm.CommHandle``).
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ...errors import DeviceOutOfMemory, InvariantError, UsageError
from .. import _cpu_isa

KINDS = ("cuda", "emulated", "cpu")


def _choose(text: Optional[str] = None):
    """The backend module for ``text`` or ``INFINITY_ACCELERATOR`` (None for the CPU)."""
    if text is None:
        text = os.environ.get("INFINITY_ACCELERATOR", "auto")
    text = text.strip().lower() or "auto"
    if text not in KINDS + ("auto",):
        raise UsageError(f"INFINITY_ACCELERATOR={text!r}: use one of auto, cuda, emulated, cpu")
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("INFINITY_ACCELERATOR=cuda but torch sees no CUDA device "
                             f"(torch {torch.__version__}); unset it to train on the CPU")
        from . import _cuda  # late: only the backend asked for is loaded

        return _cuda
    if text == "emulated":
        from . import _emulated  # late: test-only code, loaded only when asked for

        _emulated.setup()
        return _emulated
    return None


class Backend:
    """Note [backend per thread]: which accelerator the code computes on, as a value. The
    process starts on ``INFINITY_ACCELERATOR``'s, and ``using`` switches the process's (every
    thread's, as autograd's device threads and the emulated streams' must follow it). A
    thread the engine starts (the overlapped step's, an asynchronous save's) holds the
    backend its starter had (``current``) and runs ``bound`` to it: a test that leaves a
    ``using`` block while an engine's step still runs does not pull the device from under
    that step."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module  # the backend module, or None for the CPU


class _Bound(threading.local):
    backend: Optional[Backend] = None  # this thread's own, or None: the process's


_process = Backend(_choose())
_bound = _Bound()


def _b():
    """The calling thread's backend module (None: the CPU)."""
    own = _bound.backend
    return (_process if own is None else own).module


def current() -> Backend:
    """The calling thread's backend, for a thread it starts (``bound``)."""
    own = _bound.backend
    return _process if own is None else own


@contextlib.contextmanager
def bound(backend: Backend):
    """Run the block on ``backend``, on this thread only (a thread started by one that
    computed on it)."""
    before, _bound.backend = _bound.backend, backend
    try:
        set_device()  # CUDA's current device is the thread's own: this rank's, as on its main thread
        yield
    finally:
        _bound.backend = before


@contextlib.contextmanager
def using(name: str):
    """Compute on another kind of accelerator inside the block (tests: the emulated device
    in a process that started on the CPU). Engines built inside belong to the block; their
    threads keep its backend after it ends (Note [backend per thread])."""
    global _process
    before, _process = _process, Backend(_choose(name))
    try:
        yield
    finally:
        synchronize()
        _process = before


def kind() -> str:
    """``cuda``, ``emulated`` or ``cpu``."""
    b = _b()
    return "cpu" if b is None else ("cuda" if b.NAME == "cuda" else "emulated")


def has_accelerator() -> bool:
    """Whether the device tier is an accelerator's memory (not the host's)."""
    return _b() is not None


def has_cuda() -> bool:
    return kind() == "cuda"


def device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` under torchrun, the emulated
    device, or the CPU."""
    b = _b()
    return torch.device("cpu") if b is None else b.device()


def set_device() -> None:
    """Make this rank's device current (CUDA: before streams, events and the process group
    are created, so none of them lands on GPU 0 of every rank)."""
    if kind() == "cuda":
        _b().setup()


def native_bf16() -> Tuple[bool, str]:
    """Whether this machine multiplies bf16 matrices natively (decided by its features at
    run time, never by the build machine's), and why, for the log."""
    if kind() == "cuda":
        ok = _b().is_bf16_supported()
        return ok, (f"the CUDA device {'supports bf16 in hardware' if ok else 'has no bf16 in hardware (only emulated)'}")
    flags = _cpu_flags()
    native = sorted({"avx512_bf16", "amx_bf16"} & flags)
    capped = _cpu_isa.capped()  # Note [CPU feature level] in _cpu_isa.py: INFINITY_CPU_ISA may leave bf16 out
    if native and (capped is None or _cpu_isa.at_least("avx512_bf16", flags)):
        return True, f"this CPU multiplies bf16 natively ({', '.join(native)})"
    if native:
        return False, (f"{_cpu_isa.ENV}={capped} leaves out this CPU's native bf16 ({', '.join(native)}); "
                       f"treated as a CPU without it")
    return False, ("this CPU has no native bf16 matmul (no avx512_bf16 or amx_bf16; torch's bf16 matmul runs "
                   "tens of times slower than fp32 on it)")


def _cpu_flags() -> frozenset:
    """The CPU's feature flags (Note [CPU feature level] in _cpu_isa.py)."""
    return _cpu_isa.cpu_flags()


def comm_backend() -> str:
    """Host tensors go through gloo and CUDA tensors through NCCL, so the small host values a
    step all-reduces are legal beside the device shards. The emulated device has no backend of
    its own: its collectives are staged through host memory (``stage_collectives``)."""
    return "cpu:gloo,cuda:nccl" if kind() == "cuda" else "gloo"


def comm_device_id() -> Optional[torch.device]:
    """The ``device_id`` for ``init_process_group``: binds NCCL to this rank's GPU at once."""
    return device() if kind() == "cuda" else None


def stage_collectives() -> bool:
    """Whether collectives of device tensors must go through host copies (the emulated device)."""
    return kind() == "emulated"


# ---------------------------------------------------------------- host buffers


def host_register(ptr: int, nbytes: int) -> bool:
    """Pin a host mapping of the package's own (2 MiB-aligned, in the host ledger) so copies
    from and to it are asynchronous; False where there is no accelerator to pin for."""
    if _b() is None or nbytes == 0:
        return False
    _b().host_register(ptr, nbytes)
    return True


def host_unregister(ptr: int) -> None:
    if _b() is not None:
        _b().host_unregister(ptr)


def is_pinned(t: torch.Tensor) -> bool:
    return _b() is not None and _b().is_pinned(t)


def on_device(t: torch.Tensor) -> bool:
    return t.device.type == device().type


def to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the device, complete on return (the caller may reuse ``t`` at once); the tensor
    itself where it is there already. For copies that overlap, ``start_copy_to_device``."""
    return t if on_device(t) else t.to(device())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, complete on return (the tensor itself where it is there already)."""
    return t if t.device.type == "cpu" else t.to("cpu")


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


DONE = _SyncEvent()


_side_streams: dict = {}


def _side_stream(purpose: str):
    key = (_b().NAME, purpose)
    s = _side_streams.get(key)
    if s is None:
        s = _side_streams[key] = _b().new_stream()
    return s


def current_stream():
    return None if _b() is None else _b().current_stream()


def start_copy_to_device(src: torch.Tensor, out: Optional[torch.Tensor] = None, after=None):
    """Begin copying a host tensor to the device on the host->device side stream; returns
    ``(device tensor, event)``. Ordered after nothing: ``src`` was filled by the CPU or NVMe
    before this call (Note [copy ordering]). ``src`` may be reused once the event has
    happened (``copy_done``); ``finish_copy_to_device`` orders a stream after the copy.
    ``after``: an event the copy must follow (``src`` is being filled by a device->host copy),
    waited on by the side stream, not the CPU. Without an accelerator the host tensor is the
    device tensor and the event has happened."""
    b = _b()
    if b is None or on_device(src):
        if out is not None and out is not src:
            out.copy_(src)
            return out, DONE
        return src, DONE
    s = _side_stream("h2d")
    with b.stream(s):
        if after is not None:
            after.wait(s)
        dst = torch.empty(src.shape, dtype=src.dtype, device=device()) if out is None else out
        dst.copy_(src, non_blocking=True)
        event = b.Event()
        event.record(s)
    return dst, event


def finish_copy_to_device(dst: torch.Tensor, event) -> torch.Tensor:
    """Make the current stream wait for a ``start_copy_to_device`` copy (no CPU wait) and
    let the caching allocator know ``dst`` is now used on it."""
    b = _b()
    if b is not None and on_device(dst):
        stream = b.current_stream()
        event.wait(stream)
        b.record_stream(dst, stream)
    return dst


def wait_copy(event) -> None:
    """Block the CPU until the copy of ``event`` has landed: only where the host buffer must be
    reused now and nothing else can be done meanwhile."""
    event.synchronize()


def start_copy_to_host(src: torch.Tensor, out: Optional[torch.Tensor] = None):
    """Begin copying a device tensor into host memory (``out``, pinned where given by the
    caller; else new pinned memory) on the device->host side stream; returns ``(host tensor,
    event)``. The copy waits for the compute stream's work so far (``src`` was produced
    there), and ``src`` is recorded on the side stream, so the caching allocator does not
    reuse its memory before the copy is done even if the caller drops it at once. Without an
    accelerator the copy is made now (a real copy: the caller's tensor can be freed) and the
    event has already happened."""
    b = _b()
    if b is None or not on_device(src):
        if out is None:
            return src.detach().clone(), DONE
        out.copy_(src.detach())
        return out, DONE
    s = _side_stream("d2h")
    produced = b.Event()
    produced.record(b.current_stream())
    if out is None:
        out = _pinned_like(src)
    with b.stream(s):
        produced.wait(s)
        out.copy_(src.detach(), non_blocking=True)
        event = b.Event()
        event.record(s)
    b.record_stream(src, s)
    return out, event


def _pinned_like(src: torch.Tensor) -> torch.Tensor:
    """Pinned host memory for a small, short-lived copy (activations): the backend's cached
    pinned allocations. Long-lived state buffers are the package's own mappings, pinned by
    ``host_register`` (``aio.aligned_empty``)."""
    return _b().pinned_empty(src.shape, src.dtype)


def stream_waits(event) -> None:
    """The current stream's later work runs after ``event`` (no CPU wait): e.g. a buffer a copy
    reads is not rewritten under it."""
    if _b() is not None:
        event.wait(_b().current_stream())


def wait_copy_to_host(event) -> None:
    """The host tensor of a ``start_copy_to_host`` copy is complete after this."""
    event.synchronize()


def synchronize() -> None:
    """Wait for all the device's work (for timings and at phase boundaries only)."""
    if _b() is not None:
        _b().synchronize()


# ---------------------------------------------------------------- device memory


def memory_allocated() -> int:
    return 0 if _b() is None else _b().memory_allocated()


def max_memory_allocated() -> int:
    """The allocator's peak (not the engine's budget)."""
    return 0 if _b() is None else _b().max_memory_allocated()


def reset_peak_memory_stats() -> None:
    if _b() is not None:
        _b().reset_peak_memory_stats()


def cap_memory(nbytes: Optional[int]) -> None:
    """Allocations past ``nbytes`` on the device raise ``torch.OutOfMemoryError`` (None: no cap
    but the device's own): CUDA's per-process fraction of the device (its cache emptied
    first, as cached blocks count against it), the emulated device's capacity. For the GPU
    check's out-of-memory phase and tests; nothing without an accelerator."""
    if _b() is not None:
        _b().cap_memory(nbytes)


def device_memory_total() -> Optional[int]:
    return None if _b() is None else _b().total_memory()


def device_memory_free() -> Optional[int]:
    return None if _b() is None else _b().free_memory()


def device_count() -> int:
    return 0 if _b() is None else _b().device_count()


def pci_address() -> Optional[str]:
    """The PCI address (``0000:3b:00.0``) of the GPU this rank computes on, whose NUMA node sysfs
    gives (Note [rank placement] in _topology.py); None where it is unknown, and on the emulated
    device and the CPU, which have none."""
    if kind() != "cuda":
        return None
    return _b().pci_address(device().index)


# ---------------------------------------------------------------- random numbers


def get_rng_state() -> Optional[torch.Tensor]:
    """This rank's device generator (CUDA: this rank's GPU only); None where the device has
    no generator of its own (the CPU, and the emulated device whose kernels use the host's)."""
    return _b().get_rng_state() if kind() == "cuda" else None


def set_rng_state(state: Optional[torch.Tensor]) -> None:
    if state is not None and kind() == "cuda":
        _b().set_rng_state(state)


# ---------------------------------------------------------------- memory budget


@dataclass
class MemoryStats:
    allocated: int  # bytes the engine holds on the device tier now
    peak: int  # the most it held since the last reset
    limit: Optional[int]  # the budget, or None
    device_total: Optional[int]  # physical device memory (CUDA only)


class DeviceBudget:
    """Charges the engine's own device allocations against ``device_memory_limit``.

    Note [device budget]: only allocations the engine makes (gathered parameters, staging
    buffers, gradient buckets, activation checkpoints brought back for backward) are charged;
    activations belong to the user's model. Exceeding the budget raises DeviceOutOfMemory
    naming it, so a model larger than "device memory" is testable on a CPU-only machine. The
    error is worded as CUDA's (" out of memory. Tried to allocate"), so the loops that retry
    with a smaller batch on an out-of-memory error (accelerate's ``find_executable_batch_size``,
    the Trainer's ``auto_find_batch_size``) retry on it as on CUDA's: a smaller batch lowers the
    activation checkpoints brought back; where the budget cannot hold the parameters at all,
    the loop ends at batch size zero, and the message says what to change. The engine itself
    recovers from it as from CUDA's (Note [aborted forward] in infinity/_zero/_engine.py).
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
                    f"device out of memory. Tried to allocate {nbytes} bytes for {what}, past device_memory_limit="
                    f"{self._limit} bytes ({self._allocated} already held by the engine); raise "
                    f"device_memory_limit, lower zero.prefetch.max_live_parameters / bucket_size, "
                    f"offload more state (zero.offload_param.device) or use a smaller batch"
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
        return MemoryStats(self._allocated, self._peak, self._limit, device_memory_total())
