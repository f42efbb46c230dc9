"""The CUDA backend of the accelerator layer: the only module of the package that calls
``torch.cuda``. Its functions have the same names and meaning as the emulated backend's
(``_emulated.py``), so the interface in ``__init__`` treats both alike."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ...errors import OutOfMemory

NAME = "cuda"


def setup() -> None:
    torch.cuda.set_device(device())


def device() -> torch.device:
    """This rank's GPU: ``LOCAL_RANK`` under torchrun (modulo the GPUs this process sees)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def is_bf16_supported() -> bool:
    """bf16 in hardware: an emulated bf16 (V100, T4) is slower than fp32 there."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def device_count() -> int:
    return torch.cuda.device_count()


def pci_address(index: int) -> Optional[str]:
    """GPU ``index``'s PCI address as sysfs spells it; None where this torch does not give it."""
    props = torch.cuda.get_device_properties(index)
    parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(p is None for p in parts):
        return None
    return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0"


# ---------------------------------------------------------------- memory


def memory_allocated() -> int:
    return torch.cuda.memory_allocated(device())


def max_memory_allocated() -> int:
    return torch.cuda.max_memory_allocated(device())


def reset_peak_memory_stats() -> None:
    torch.cuda.reset_peak_memory_stats(device())


def total_memory() -> int:
    return torch.cuda.get_device_properties(device()).total_memory


def free_memory() -> int:
    return torch.cuda.mem_get_info(device())[0]


def cap_memory(nbytes) -> None:
    torch.cuda.empty_cache()
    fraction = 1.0 if nbytes is None else min(1.0, nbytes / total_memory())
    torch.cuda.set_per_process_memory_fraction(fraction, device())


# ---------------------------------------------------------------- pinned host memory


def host_register(ptr: int, nbytes: int) -> None:
    """Page-lock host memory the package mapped itself (cudaHostRegister): pinned without
    torch's caching host allocator, which rounds sizes up to powers of two and never gives
    memory back."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise OutOfMemory(f"cudaHostRegister could not page-lock {nbytes} bytes of host memory ({err}); raise the "
                          f"locked-memory limit (ulimit -l) or offload less state to host memory")


def host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def is_pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.numel() > 0 and t.is_pinned()


# ---------------------------------------------------------------- streams and events


Event = torch.cuda.Event


def new_stream():
    return torch.cuda.Stream(device())


def current_stream():
    return torch.cuda.current_stream(device())


def stream(s):
    return torch.cuda.stream(s)


def synchronize() -> None:
    torch.cuda.synchronize(device())


def record_stream(t: torch.Tensor, s) -> None:
    t.record_stream(s)


# ---------------------------------------------------------------- random numbers


def get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state(device())


def set_rng_state(state: torch.Tensor) -> None:
    torch.cuda.set_rng_state(state, device())
