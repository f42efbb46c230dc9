"""The CPU features infinity uses, and the one override of them.

Note [CPU feature level]: what runs depends on the CPU's features, read at run time (never the
build machine's): the native Adam's SIMD path (scalar, AVX2, AVX512, with avx512_bf16 for its
bf16 conversions) and ``precision.dtype: auto`` (bf16 where bf16 matrices multiply natively:
avx512_bf16 or AMX). The levels are ordered; a machine has the highest one its flags allow.
``INFINITY_CPU_ISA`` caps it for this process, so one machine runs what a lesser one would
(the suite runs its ISA-dependent tests under every level the machine has); a level the
machine lacks is an error that names the ones it has. ``INFINITY_CPU_ADAM_SIMD`` still pins
the Adam path alone.
"""
from __future__ import annotations

import functools
import os

from ..errors import UsageError

ENV = "INFINITY_CPU_ISA"
LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
# The flags (Linux /proc/cpuinfo names) each level needs beyond the one below it.
_NEEDS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx512_bf16": {"avx512_bf16"},
          "amx": {"amx_bf16", "amx_tile"}}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """The CPU's feature flags (Linux); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detected(flags=None) -> str:
    """The highest level this CPU's flags allow."""
    flags = cpu_flags() if flags is None else flags
    best = "scalar"
    for name in LEVELS[1:]:
        if not _NEEDS[name] <= flags:
            break
        best = name
    return best


def capped():
    """The level INFINITY_CPU_ISA sets, or None when it is unset."""
    return os.environ.get(ENV, "").strip().lower() or None


def level(flags=None) -> str:
    """The level in use: the machine's, capped by INFINITY_CPU_ISA when set."""
    have = detected(flags)
    cap = os.environ.get(ENV, "").strip().lower()
    if not cap:
        return have
    if cap not in LEVELS:
        raise UsageError(f"{ENV}={cap!r} is not a CPU feature level; use one of {', '.join(LEVELS)} (or unset it)")
    if LEVELS.index(cap) > LEVELS.index(have):
        raise UsageError(f"{ENV}={cap} asks for more than this CPU has (its level is {have}; the levels it can run: "
                         f"{', '.join(LEVELS[:LEVELS.index(have) + 1])})")
    return cap


def at_least(name: str, flags=None) -> bool:
    return LEVELS.index(level(flags)) >= LEVELS.index(name)


def levels_here() -> tuple:
    """Every level this machine can run, lowest first (what the suite runs its ISA tests under)."""
    return LEVELS[: LEVELS.index(detected()) + 1]
