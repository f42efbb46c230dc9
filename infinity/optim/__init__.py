"""The native CPU Adam/AdamW (native/cpu_adam): AVX512, AVX2 and scalar paths chosen at
run time by CPUID, multithreaded, no link against torch."""
from ._cpu_adam import CPUAdam
from ._functional import adam_step
from ._native import simd_path

__all__ = ["CPUAdam", "adam_step", "simd_path"]
