"""How torch's device-generic API answers for the emulated device: ``torch.accelerator`` and
``torch.emu`` (Note [emulated accelerator] in _emulated.py).

Note [emulated accelerator in torch.accelerator]: once the ``emu`` backend is registered,
``torch.accelerator.current_accelerator()`` is ``emu`` in every process that registered it
(the test suite registers it in all of them, and the registration is irreversible). Libraries
ask that API for memory and cache operations: accelerate's ``free_memory`` (called by the
Trainer at the start of every ``train``) empties the cache through ``torch.accelerator``, TRL
and the Trainer read ``memory_allocated`` and ``max_memory_allocated``, torch's own
checkpointing reads the device module. torch answers the memory ones in C++ from the device's
``c10::DeviceAllocator``, which a backend written in Python cannot register, and the
uninitialised answer is an internal assertion (``Allocator for emu is not a DeviceAllocator``)
that stops the caller (``empty_host_cache`` crashes the process). So ``install`` puts an answer
in front of the eight ``torch._C`` entry points that ``torch.accelerator``'s Python functions
call at run time: while the
current accelerator is ``emu`` they answer from the emulator's ledger (_emulated_memory.py:
capacity, bytes held now and at the peak, counts) and its streams (``synchronize`` drains
them all); for any other accelerator the original entry point runs. Every Python function of
``torch.accelerator`` built on them (``memory_stats``, ``memory_allocated``,
``max_memory_reserved``, ``get_memory_info``, ...) therefore answers too, including ones a
later torch adds on the same entry points. ``torch.emu`` (the device module, which
``torch.get_device_module("emu")`` returns) carries the same functions under CUDA's names.
The device caches nothing, so ``empty_cache`` frees nothing and reserved bytes equal
allocated ones.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict

import torch

from . import _emulated_memory as memory
from . import _emulated_streams as streams

NAME = "emu"

_installed: Dict[str, Callable] = {}  # the original torch._C entry points, by name


def _is_current() -> bool:
    acc = torch._C._accelerator_getAccelerator()
    return acc is not None and acc.type == NAME


def _answers() -> Dict[str, Callable]:
    """The emulator's answer for each entry point ``torch.accelerator`` calls."""

    def capacity_info(index: Any = None):
        return memory.free_memory(), memory.total_memory()

    return {
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_emptyCache": lambda *a: None,
        "_accelerator_getDeviceStats": lambda index=None: memory.device_stats(),
        "_accelerator_resetAccumulatedStats": lambda index=None: memory.reset_accumulated_memory_stats(),
        "_accelerator_resetPeakStats": lambda index=None: memory.reset_peak_memory_stats(),
        "_accelerator_getMemoryInfo": capacity_info,
        "_accelerator_synchronizeDevice": lambda index=None: streams.synchronize(),
        # torch's host caching allocator of a Python backend is not there to empty (torch crashes): the
        # emulator's pinned memory is registered by its owners, so nothing is cached
        "_accelerator_emptyHostCache": lambda: None,
    }


def _routed(name: str, original: Callable, answer: Callable) -> Callable:
    def entry(*args, **kwargs):
        if _is_current():
            return answer(*args, **kwargs)
        return original(*args, **kwargs)

    entry.__name__ = name
    entry.__doc__ = f"{name}: the emulated device's answer while it is the accelerator, else torch's own."
    return entry


def install() -> None:
    """Route ``torch.accelerator``'s memory, cache and synchronize calls to the emulator (once)."""
    if _installed:
        return
    for name, answer in _answers().items():
        original = getattr(torch._C, name)
        _installed[name] = original
        setattr(torch._C, name, _routed(name, original, answer))


def memory_stats(device: Any = None) -> "OrderedDict[str, Any]":
    """The flat statistics of ``torch.cuda.memory_stats``, from the ledger."""
    flat = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat.append((prefix, value))

    walk("", memory.device_stats())
    return OrderedDict(sorted(flat))


class DeviceModule:
    """``torch.emu``: what torch and the libraries ask of a device module, under CUDA's names
    (checkpointing asks for AMP dtypes and the RNG state, accelerate and the Trainer for memory)."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        pass  # one device

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        pass  # the device's kernels draw from the host generator

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self):
        return [torch.bfloat16, torch.float16]

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()  # the device's kernels run on the host: one generator

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def synchronize(self, device: Any = None) -> None:
        streams.synchronize()

    def empty_cache(self) -> None:
        pass  # nothing cached

    def memory_allocated(self, device: Any = None) -> int:
        return memory.memory_allocated()

    def max_memory_allocated(self, device: Any = None) -> int:
        return memory.max_memory_allocated()

    def memory_reserved(self, device: Any = None) -> int:
        return memory.memory_allocated()

    def max_memory_reserved(self, device: Any = None) -> int:
        return memory.max_memory_allocated()

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        memory.reset_peak_memory_stats()

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        memory.reset_accumulated_memory_stats()

    def memory_stats(self, device: Any = None) -> "OrderedDict[str, Any]":
        return memory_stats(device)

    def mem_get_info(self, device: Any = None):
        return memory.free_memory(), memory.total_memory()

    def get_device_name(self, device: Any = None) -> str:
        return "infinity emulated device"
