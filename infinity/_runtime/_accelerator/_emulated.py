"""An emulated accelerator for tests: a device that behaves like CUDA wherever the engine's
correctness depends on it, on a machine without one (``INFINITY_ACCELERATOR=emulated``).

Note [emulated accelerator]: the device is PyTorch's PrivateUse1 backend, renamed ``emu``
and set up from Python (``torch.utils.backend_registration``); its tensors are wrapper
subclasses (``EmuTensor``) around a host tensor that holds their bytes. Factories with
``device="emu"`` reach the two ``empty`` kernels registered for PrivateUse1; every other
operator reaches ``EmuTensor.__torch_dispatch__`` below autograd, which runs it on the
wrapped host tensors. What it emulates, and why each matters:

- a distinct device: ``t.device.type == "emu"``, and an operator mixing device tensors with
  host tensors of one or more dimensions raises as CUDA does (a host gradient added into a
  device shard, a host ``arange`` times device bits);
- streams and events: every stream has a queue and a worker thread. A copy issued on a
  stream with ``non_blocking=True`` from or to pinned host memory (and every device-to-device
  copy) is queued: when it reaches the front of its stream the destination is poisoned (NaN,
  or all bits set for integers), the worker sleeps a random delay (``set_delay``), then
  reads the source and writes the destination. So a copy read before its event, a buffer
  reused while its copy is queued, and a source changed before the copy lands all show as
  wrong numbers. ``Event.wait`` / ``Stream.wait_event`` / ``wait_stream`` queue a wait, and
  ``Event.synchronize`` blocks the CPU; those are the only ways to be sure. Every other
  operator runs at once on the calling thread after the current stream's queue drained
  (CUDA would run it after them in stream order);
- pinned host memory is a real property: memory the accelerator layer registered
  (``host_register``, as ``cudaHostRegister`` on CUDA) and the host results of
  ``.to("cpu", non_blocking=True)``; ``non_blocking`` with pageable memory is synchronous;
- memory statistics: allocated / peak bytes of device storage and a capacity
  (``INFINITY_EMULATED_MEMORY`` bytes, ``set_capacity``) past which allocation raises
  ``torch.OutOfMemoryError``.

Why a Python wrapper subclass and not a C++ PrivateUse1 backend: the emulator must change
what copies do in time (queues, delays, poison), which is Python-level logic either way, and
the wrapper needs no build step, no ABI tie to one torch version, and runs on the torch the
GPU image has. The cost is speed (a Python call per operator), which the tests' model sizes
absorb. The device's random numbers come from the host generator (the kernels run there).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import random
import threading
import time
import weakref
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ...errors import EngineError, InfinityError, UsageError

NAME = "emu"


class DeviceMismatchError(InfinityError, RuntimeError):
    """An operator mixed the emulated device's tensors with host tensors (CUDA raises a RuntimeError)."""
_setup_done = False
_lock = threading.RLock()


def setup() -> None:
    """Register the ``emu`` device with torch (once per process; irreversible, so only when
    ``INFINITY_ACCELERATOR=emulated`` asked for it)."""
    global _setup_done, _library
    with _lock:
        if _setup_done:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() == "privateuseone":
            _setup_privateuseone_for_python_backend(NAME, backend_module=_BackendModule())
        elif torch._C._get_privateuse1_backend_name() != NAME:
            raise UsageError(f"INFINITY_ACCELERATOR=emulated needs PyTorch's PrivateUse1 backend, which is "
                               f"already taken by {torch._C._get_privateuse1_backend_name()!r}")
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("empty.memory_format", _empty, "PrivateUse1")
        _library.impl("empty_strided", _empty_strided, "PrivateUse1")
        _library.impl("_fused_sdp_choice", _sdp_choice, "PrivateUse1")
        _library.impl("_copy_from", _copy_from, "PrivateUse1")  # reached below the Python key (torch.tensor(...,
        # device=...), list indices): the same copy as copy_
        _setup_done = True


_library = None


class _BackendModule:
    """``torch.emu``: what torch asks of a device module (checkpointing asks for AMP dtypes)."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass  # the device's kernels draw from the host generator

    def get_amp_supported_dtype(self):
        return [torch.bfloat16, torch.float16]

    def get_rng_state(self, device=None):
        return get_rng_state()

    def set_rng_state(self, state, device=None):
        set_rng_state(state)


def device() -> torch.device:
    return torch.device(NAME, 0)


# ---------------------------------------------------------------- memory


class _Memory:
    def __init__(self):
        self.allocated = 0
        self.peak = 0
        self.capacity = int(os.environ.get("INFINITY_EMULATED_MEMORY", str(64 << 30)))
        self.lock = threading.Lock()

    def check(self, nbytes: int) -> None:
        if self.allocated + nbytes > self.capacity:
            raise torch.OutOfMemoryError(
                f"emulated device out of memory: tried to allocate {nbytes} bytes with {self.allocated} of "
                f"{self.capacity} allocated (INFINITY_EMULATED_MEMORY)")

    def charge(self, nbytes: int) -> None:
        with self.lock:
            self.check(nbytes)
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.allocated -= nbytes


_memory = _Memory()


def memory_allocated() -> int:
    return _memory.allocated


def max_memory_allocated() -> int:
    return _memory.peak


def reset_peak_memory_stats() -> None:
    with _memory.lock:
        _memory.peak = _memory.allocated


def set_capacity(nbytes: int) -> None:
    _memory.capacity = int(nbytes)


def total_memory() -> int:
    return _memory.capacity


class EmuTensor(torch.Tensor):
    """A tensor on the emulated device; its bytes are the host tensor ``_data``."""

    _data: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=device(), requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, requires_grad: bool = False):
        self._data = data

    def __del__(self):  # not a weakref.finalize: torch.utils.swap_tensors refuses tensors with weakrefs
        ptr = self.__dict__.get("_ptr")
        if ptr is not None:
            _forget(ptr)

    @property  # type: ignore[override]
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``t.data = other`` copies torch's metadata; the bytes of a wrapper must follow it."""
        torch._C.TensorBase.data.__set__(self, value)
        self._data = value._data
        ptr = value.__dict__.get("_ptr")
        if ptr is not None:
            with _lock:
                _storages[ptr][1] += 1
        old, self._ptr = self.__dict__.get("_ptr"), ptr
        if old is not None:
            _forget(old)

    def data_ptr(self) -> int:  # type: ignore[override]
        return self._data.data_ptr()

    def untyped_storage(self):  # type: ignore[override]
        return self._data.untyped_storage()

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"EmuTensor({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


# A device storage (by the address of its host bytes) counts once however many wrappers
# view it; its bytes are released when the last wrapper goes.
_storages: dict = {}


def _forget(ptr: int) -> None:
    with _lock:
        entry = _storages.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _storages[ptr]
            _memory.release(entry[0])


def _wrap(data: torch.Tensor) -> EmuTensor:
    storage = data.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    with _lock:
        entry = _storages.get(ptr)
        if entry is None:
            _memory.charge(nbytes)
            entry = _storages[ptr] = [nbytes, 0]
        entry[1] += 1
    out = EmuTensor(data)
    out._ptr = ptr
    return out


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    _memory.check(_nbytes(size, dtype))  # before the host bytes exist
    return _wrap(torch.empty(size, dtype=dtype or torch.get_default_dtype(),
                             memory_format=memory_format or torch.contiguous_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _wrap(torch.empty_strided(size, stride, dtype=dtype or torch.get_default_dtype()))


def _copy_from(src, dst, non_blocking=False):
    _copy(dst, src, non_blocking)
    return dst


def _sdp_choice(*args, **kwargs):
    return 0  # the math kernel of scaled_dot_product_attention, as on a device without fused kernels


def _nbytes(size, dtype) -> int:
    n = 1
    for s in size:
        n *= int(s)
    return n * torch.empty((), dtype=dtype or torch.get_default_dtype()).element_size()


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


def _range_of(t: torch.Tensor) -> Optional[_Range]:
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    with _lock:
        return next((r for s, r in _pinned.items() if s <= start and end <= r.end), None)


def is_pinned(t: torch.Tensor) -> bool:
    return _range_of(t) is not None


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    _pin_result(out)
    return out


def _pin_result(t: torch.Tensor) -> None:
    """A host tensor made by ``.to("cpu", non_blocking=True)`` is pinned, as on CUDA, for its life."""
    ptr = t.untyped_storage().data_ptr()
    host_register(ptr, t.untyped_storage().nbytes(), cached=True)
    weakref.finalize(t, host_unregister, ptr)


# ---------------------------------------------------------------- streams and events


_delay = (0.0005, 0.004)  # seconds: each queued copy lands after a random delay in this range
_rng = random.Random(int(os.environ.get("INFINITY_EMULATED_SEED", "0")))


def set_delay(low: float, high: Optional[float] = None) -> None:
    """Each queued copy lands after a random delay in [low, high] seconds (high defaults to low)."""
    global _delay
    _delay = (float(low), float(low if high is None else high))


class Stream:
    """A queue of copies and waits, run in order by its own thread."""

    def __init__(self, name: str = "side"):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"emu-stream-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                item()
            except BaseException as e:  # surfaced at the next synchronize on this stream
                self._error = e
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def enqueue(self, item) -> None:
        with self._cv:
            self._pending += 1
        self._queue.put(item)

    def query(self) -> bool:
        return self._pending == 0

    def synchronize(self) -> None:
        if self._pending:
            with self._cv:
                while self._pending:
                    self._cv.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise EngineError(f"emulated stream {self.name}: a queued operation failed") from error

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, other: "Stream") -> None:
        if other is not self:
            self.wait_event(other.record_event())

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<emulated stream {self.name}>"


class Event:
    """Marks a point in a stream: done once everything queued before it has run."""

    def __init__(self, *args, **kwargs):
        self._done: Optional[threading.Event] = None  # None: never recorded, which counts as done (as on CUDA)

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = current_stream() if stream is None else stream
        done = threading.Event()
        self._done = done
        stream.enqueue(done.set)

    def query(self) -> bool:
        return self._done is None or self._done.is_set()

    def synchronize(self) -> None:
        if self._done is not None:
            self._done.wait()

    def wait(self, stream: Optional[Stream] = None) -> None:
        stream = current_stream() if stream is None else stream
        done = self._done
        if done is not None and not done.is_set():
            stream.enqueue(done.wait)


_compute = None
_local = threading.local()


def default_stream() -> Stream:
    global _compute
    if _compute is None:
        with _lock:
            if _compute is None:
                _compute = Stream("compute")
    return _compute


def current_stream() -> Stream:
    return getattr(_local, "stream", None) or default_stream()


@contextlib.contextmanager
def stream(s: Optional[Stream]):
    before = getattr(_local, "stream", None)
    if s is not None:
        _local.stream = s
    try:
        yield
    finally:
        _local.stream = before


_streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()


def new_stream() -> Stream:
    s = Stream("side")
    _streams.add(s)
    return s


def synchronize() -> None:
    default_stream().synchronize()
    for s in list(_streams):
        s.synchronize()


# ---------------------------------------------------------------- operators


_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
_MIXED_OK = _COPIES | {torch.ops.aten._local_scalar_dense.default}


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1)


class _Unheld:
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


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` where either may be on the device: queued on the current stream
    (Note [emulated accelerator]) when CUDA would run it asynchronously, else now."""
    d = dst._data if isinstance(dst, EmuTensor) else dst
    s = src._data if isinstance(src, EmuTensor) else src
    s_dev, d_dev = isinstance(src, EmuTensor), isinstance(dst, EmuTensor)
    host = None if (s_dev and d_dev) else (src if d_dev else dst)
    pinned = _range_of(host) if host is not None and (s_dev or d_dev) else None
    current = current_stream()
    if not (s_dev and d_dev) and not (non_blocking and pinned is not None):
        current.synchronize()
        d.copy_(s)
        return
    unheld = None
    if pinned is not None and not pinned.cached:  # the host side is reached by address alone
        unheld = _Unheld(host, pinned)
        if host is src:
            s = None
        else:
            d = None

    def land():
        try:
            target = d if d is not None else unheld.tensor()
            _poison(target)
            low, high = _delay
            if high > 0:
                time.sleep(_rng.uniform(low, high))
            target.copy_(s if s is not None else unheld.tensor())
        finally:
            if unheld is not None:
                unheld.done()

    current.enqueue(land)


def _dispatch(func, args, kwargs):
    if func is torch.ops.aten.copy_.default:
        _copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False)))
        return args[0]
    if func is torch.ops.aten._to_copy.default:
        return _to_copy(args[0], **kwargs)
    if func not in _MIXED_OK:
        _refuse_mixed(func, args, kwargs)
    current_stream().synchronize()
    wrappers = {}

    def unwrap(x):
        if isinstance(x, EmuTensor):
            wrappers[id(x._data)] = x
            return x._data
        return x

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, EmuTensor):
            same = wrappers.get(id(x))
            return same if same is not None else _wrap(x)
        return x

    return tree_map(wrap, out)


def _to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    target = torch.device(device) if device is not None else x.device
    dtype = x.dtype if dtype is None else dtype
    if target.type == "cpu":
        out = torch.empty_like(x._data, dtype=dtype, memory_format=memory_format or torch.preserve_format)
        if non_blocking:
            _pin_result(out)
    elif target.type == NAME:
        data = x._data if isinstance(x, EmuTensor) else x
        out = _wrap(torch.empty_like(data, dtype=dtype, memory_format=memory_format or torch.preserve_format))
    else:
        raise UsageError(f"emulated device: cannot copy to {target}")
    _copy(out, x, non_blocking)
    return out


def _refuse_mixed(func, args, kwargs) -> None:
    found_host = False
    found_device = False

    def look(x):
        nonlocal found_host, found_device
        if isinstance(x, EmuTensor):
            found_device = True
        elif isinstance(x, torch.Tensor) and x.dim() > 0 and x.device.type == "cpu":
            found_host = True
        return x

    tree_map(look, args)
    tree_map(look, kwargs)
    if found_host and found_device:
        raise DeviceMismatchError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{NAME}:0 and cpu! (emulated device, operator {func})")


# ---------------------------------------------------------------- random numbers


def get_rng_state() -> torch.Tensor:
    return torch.get_rng_state()  # the device's kernels run on the host: one generator


def set_rng_state(state: torch.Tensor) -> None:
    torch.set_rng_state(state)


def is_bf16_supported() -> bool:
    return False  # decided by the host's CPU, whose kernels the device runs: see native_bf16


def device_count() -> int:
    return 1


def free_memory() -> int:
    return _memory.capacity - _memory.allocated


def record_stream(t: torch.Tensor, s) -> None:
    pass  # a queued copy holds its tensors until it lands: memory is never reused under it
