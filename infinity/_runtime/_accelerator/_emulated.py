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
  (CUDA would run it after them in stream order), taking as long as ``compute_delay`` says
  (a sleep: the host is free meanwhile, as while a GPU computes);
- pinned host memory is a real property: memory the accelerator layer registered
  (``host_register``, as ``cudaHostRegister`` on CUDA) and the host results of
  ``.to("cpu", non_blocking=True)``; ``non_blocking`` with pageable memory is synchronous;
- memory statistics: allocated / peak bytes of device storage and a capacity
  (``INFINITY_EMULATED_MEMORY`` bytes, ``set_capacity``) past which allocation raises
  ``torch.OutOfMemoryError`` worded as CUDA's, in forward and in backward alike (Note [errors
  inside backward]); ``torch.accelerator`` and ``torch.emu`` answer from them, as libraries
  ask them of any device (Note [emulated accelerator in torch.accelerator] in _emulated_torch.py).

Why a Python wrapper subclass and not a C++ PrivateUse1 backend: the emulator must change
what copies do in time (queues, delays, poison), which is Python-level logic either way, and
the wrapper needs no build step, no ABI tie to one torch version, and runs on the torch the
GPU image has. The cost is speed (a Python call per operator), which the tests' model sizes
absorb. The device's random numbers come from the host generator (the kernels run there).
"""
from __future__ import annotations

import threading

import torch
from torch.utils._pytree import tree_map

from ...errors import InfinityError, UsageError
from . import _emulated_torch
from ._emulated_memory import (
    Unheld,
    add_view,
    cap_memory,
    check_room,
    count_storage,
    drop_view,
    free_memory,
    host_register,
    host_unregister,
    is_pinned,
    max_memory_allocated,
    memory_allocated,
    pin_result,
    pinned_empty,
    range_of,
    reset_peak_memory_stats,
    set_capacity,
    total_memory,
)
from ._emulated_streams import (
    Event,
    Stream,
    compute_delay,
    computing,
    copy_delay,
    current_stream,
    default_stream,
    new_stream,
    operators_run,
    record_stream,
    run_compute,
    set_delay,
    sleep_copy_delay,
    stream,
    synchronize,
)

# What the accelerator interface (``__init__``) and the tests read of this backend; memory
# statistics and pinned ranges live in _emulated_memory.py, streams and events in
# _emulated_streams.py, the device, its tensors and their operators here.
__all__ = [
    "NAME", "DeviceMismatchError", "EmuTensor", "Event", "Stream", "cap_memory", "current_stream", "default_stream",
    "device",
    "device_count", "free_memory", "get_rng_state", "host_register", "host_unregister", "is_bf16_supported",
    "is_pinned", "max_memory_allocated", "memory_allocated", "new_stream", "pinned_empty", "record_stream",
    "reset_peak_memory_stats", "set_capacity", "set_delay", "copy_delay", "compute_delay", "computing",
    "operators_run", "set_rng_state", "setup", "stream", "synchronize",
    "total_memory",
]

NAME = "emu"


class DeviceMismatchError(InfinityError, RuntimeError):
    """An operator mixed the emulated device's tensors with host tensors (CUDA raises a RuntimeError)."""


_setup_done = False
_setup_lock = threading.Lock()


def setup() -> None:
    """Register the ``emu`` device with torch (once per process; irreversible, so only when
    ``INFINITY_ACCELERATOR=emulated`` asked for it)."""
    global _setup_done, _library
    with _setup_lock:
        if _setup_done:
            return
        # torch's private helper, reached only when the emulated device is asked for
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() == "privateuseone":
            _setup_privateuseone_for_python_backend(NAME, backend_module=_emulated_torch.DeviceModule())
        elif torch._C._get_privateuse1_backend_name() != NAME:
            raise UsageError(f"INFINITY_ACCELERATOR=emulated needs PyTorch's PrivateUse1 backend, which is "
                               f"already taken by {torch._C._get_privateuse1_backend_name()!r}")
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("empty.memory_format", _empty, "PrivateUse1")
        _library.impl("empty_strided", _empty_strided, "PrivateUse1")
        _library.impl("_fused_sdp_choice", _sdp_choice, "PrivateUse1")
        _library.impl("_copy_from", _copy_from, "PrivateUse1")  # reached below the Python key (torch.tensor(...,
        # device=...), list indices): the same copy as copy_
        _emulated_torch.install()  # Note [emulated accelerator in torch.accelerator] in _emulated_torch.py
        _setup_done = True


_library = None


def device() -> torch.device:
    return torch.device(NAME, 0)


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
        if ptr is not None and drop_view is not None:  # (None: the interpreter is shutting down)
            drop_view(ptr)

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
            add_view(ptr)
        old, self._ptr = self.__dict__.get("_ptr"), ptr
        if old is not None:
            drop_view(old)

    def data_ptr(self) -> int:  # type: ignore[override]
        return self._data.data_ptr()

    def untyped_storage(self):  # type: ignore[override]
        return self._data.untyped_storage()

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"EmuTensor({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _wrap(data: torch.Tensor) -> EmuTensor:
    storage = data.untyped_storage()
    ptr = storage.data_ptr()
    count_storage(ptr, storage.nbytes())
    out = EmuTensor(data)
    out._ptr = ptr
    return out


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    check_room(_nbytes(size, dtype))  # before the host bytes exist
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


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` where either may be on the device: queued on the current stream
    (Note [emulated accelerator]) when CUDA would run it asynchronously, else now."""
    d = dst._data if isinstance(dst, EmuTensor) else dst
    s = src._data if isinstance(src, EmuTensor) else src
    s_dev, d_dev = isinstance(src, EmuTensor), isinstance(dst, EmuTensor)
    host = None if (s_dev and d_dev) else (src if d_dev else dst)
    pinned = range_of(host) if host is not None and (s_dev or d_dev) else None
    current = current_stream()
    if not (s_dev and d_dev) and not (non_blocking and pinned is not None):
        current.synchronize()
        d.copy_(s)
        return
    unheld = None
    if pinned is not None and not pinned.cached:  # the host side is reached by address alone
        unheld = Unheld(host, pinned)
        if host is src:
            s = None
        else:
            d = None

    def land():
        try:
            target = d if d is not None else unheld.tensor()
            _poison(target)
            sleep_copy_delay()
            target.copy_(s if s is not None else unheld.tensor())
        finally:
            if unheld is not None:
                unheld.done()

    current.enqueue(land)


class _Raised:
    """An operator's exception carried across torch's C++ inside a backward: Note [errors
    inside backward]."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __repr__(self) -> str:
        raise self.error


def _dispatch(func, args, kwargs):
    """Note [errors inside backward]: inside a backward, torch runs this device's operators
    under a stream guard whose destructor calls the Python backend's device guard (PyTorch's
    ``_setup_privateuseone_for_python_backend``) back in Python. An exception raised here
    leaves Python's error indicator set while C++ unwinds through that destructor, and the
    call into Python there aborts the process (``std::terminate``); CUDA's errors are C++
    exceptions and never do. So inside a backward an operator that raises returns a
    ``_Raised`` instead: torch cannot cast it to a tensor and asks for its ``repr`` for the
    message, which raises the original exception; pybind11 takes it as ``error_already_set``
    (the indicator cleared), which unwinds safely and reaches the caller of ``backward()`` as
    the same exception, type and message: an allocation past the capacity is a
    ``torch.OutOfMemoryError`` there as in forward. What this cannot reach: a Python hook
    that raises inside a backward on this device (a tensor hook, a saved-tensor hook) still
    aborts the process, as torch leaves the indicator set for those too; on CUDA they raise."""
    try:
        return _run(func, args, kwargs)
    except Exception as e:
        if torch._C._current_graph_task_id() == -1:
            raise  # outside a backward (forward, the step): no stream guard to unwind through
        return _Raised(e)


def _run(func, args, kwargs):
    if func is torch.ops.aten.copy_.default:
        _copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False)))
        return args[0]
    if func is torch.ops.aten._to_copy.default:
        return _to_copy(args[0], **kwargs)
    if func not in _MIXED_OK:
        _refuse_mixed(func, args, kwargs)
    current_stream().synchronize()
    run_compute()  # its time on the device, where a test set one (compute_delay)
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
            pin_result(out)
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


