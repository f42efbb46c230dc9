"""Loading of the native ``infinity._cpu_adam`` extension and choice of its SIMD path.

The path defaults to the best one this CPU supports (checked by CPUID in the extension);
``INFINITY_CPU_ADAM_SIMD=scalar|avx2|avx512`` or a ``simd=`` argument pins one, which is
how the tests run every path against the scalar reference.
"""
from __future__ import annotations

import functools
import os

from .._runtime import _cpu_isa
from .._runtime._log import logger
from ..errors import NativeLibraryMissing, UsageError, UsageTypeError

ENV_SIMD = "INFINITY_CPU_ADAM_SIMD"

# Mirrors the enums of native/cpu_adam/cpu_adam.h.
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
# "avx512_nobf16" is the AVX512 path with bf16 rounded in integer arithmetic, as on CPUs
# without avx512_bf16; it exists so tests can run that variant on any AVX512 machine.
SIMD_CHOICES = ("auto", "scalar", "avx2", "avx512", "avx512_nobf16")


@functools.lru_cache(maxsize=None)
def lib():
    """The extension module; a clear ImportError when the package was not built."""
    try:
        from .. import _cpu_adam  # late: the native module may not be built, which is said here, when used
    except ImportError as err:
        raise NativeLibraryMissing(
            "infinity._cpu_adam (the native CPU Adam) is not built; run "
            "`bash scripts/setup_env.sh` or `pip install --no-build-isolation -e .` "
            f"from the repository root ({err})"
        ) from err
    return _cpu_adam


@functools.lru_cache(maxsize=None)
def _features() -> tuple:
    f = lib().cpu_features()
    return tuple(sorted(f.items()))


def cpu_features() -> dict:
    """``{"avx2": bool, "avx512": bool, "avx512bf16": bool}`` as CPUID reports them."""
    return dict(_features())


def _best() -> str:
    """The best path of this CPU (CPUID, in the extension), capped by INFINITY_CPU_ISA (Note [CPU
    feature level] in _runtime/_cpu_isa.py): below avx512_bf16 the AVX512 path rounds bf16 in
    integer arithmetic, as on CPUs without it."""
    f = cpu_features()
    best = "avx512" if f["avx512"] else "avx2" if f["avx2"] else "scalar"
    cap = _cpu_isa.capped()
    if cap is None:
        return best
    _cpu_isa.level()  # refuses a level this CPU lacks
    if cap in ("scalar", "avx2"):
        return cap if ISA_CODES[cap] <= ISA_CODES[best] else best
    if cap == "avx512" and best == "avx512" and f["avx512bf16"]:
        return "avx512_nobf16"
    return best


def resolve(simd: str | None) -> tuple[int, bool, str]:
    """Maps a requested path to (isa code, may use avx512_bf16, path name).

    None means the environment's choice, else the best path of this CPU.
    """
    return _resolve(simd, os.environ.get(ENV_SIMD) if simd is None else None, _cpu_isa.capped())


@functools.lru_cache(maxsize=64)
def _resolve(simd: str | None, env: str | None, isa_cap: str | None = None) -> tuple[int, bool, str]:
    """``isa_cap`` (INFINITY_CPU_ISA) is read by ``_best``; it is an argument so the cache keys on it."""
    if simd is not None and not isinstance(simd, str):
        raise UsageTypeError(f"simd must be a string ({', '.join(SIMD_CHOICES)}) or None, got {simd!r}")
    name = (simd if simd is not None else env or "auto").strip().lower()
    if name not in SIMD_CHOICES:
        source = "simd=" if simd is not None else f"{ENV_SIMD}="
        raise UsageError(f"{source}{name!r} is not a CPU Adam path; use one of {', '.join(SIMD_CHOICES)}")
    if name == "auto":
        name = _best()
    base = "avx512" if name == "avx512_nobf16" else name
    f = cpu_features()
    if base != "scalar" and not f[base]:
        raise UsageError(
            f"CPU Adam path {name!r} needs {base.upper()} but this CPU lacks it "
            f"(supported here: {', '.join(p for p in ('avx2', 'avx512') if f[p]) or 'scalar only'}); "
            f"pick another with simd= or {ENV_SIMD}"
        )
    _log_choice(name)
    return ISA_CODES[base], name != "avx512_nobf16", name


@functools.lru_cache(maxsize=None)
def _log_choice(name: str) -> None:
    f = cpu_features()
    detail = " with avx512_bf16 conversions" if name == "avx512" and f["avx512bf16"] else ""
    logger.debug("CPU Adam uses the %s path%s", name, detail)


def simd_path() -> str:
    """The path ``adam_step`` uses by default: "avx512", "avx2" or "scalar"."""
    return resolve(None)[2]
