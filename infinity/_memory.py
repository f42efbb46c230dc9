"""The engine's one model of its bytes: what each store needs for a plan, and what the host holds.

Note [one memory model]: the bytes a placement needs follow from the layout (flat sizes of
the optimizer and parameter spaces, the largest unit) and the config (tiers, chunk, host
cache, staging buffers). Each store states them for a plan, before anything is allocated,
as ``{tier: {category: bytes}}`` (``ParamStore.plan``, ``MemoryOptimizerStore.plan``,
``NvmeOptimizerStore.plan`` in _optimizer_swapper.py); ``store_plan`` (in _preflight.py) adds the engine's own recycled
gathered buffers. Everything that speaks of those bytes reads that one function: the
preflight (``_preflight.plan``) with the run's real layout, ``Engine.tier_bytes`` and the
stores' ``nbytes()``, the telemetry's account, and ``infinity.estimate`` with a layout
derived from the model's shape. ``tests/test_memory_model.py`` checks the plan against the
bytes the stores really mapped (Note [host memory ledger] in aio/_memory.py).

Categories of host memory (the names the ledger and the plan share):
  param_shards      compute-dtype parameter shards on the cpu tier
  param_staging     the NVMe parameter tier's staging pool (filled on first need)
  param_handoff     the step's fresh parameter output kept for the next forward (Note [hand-off])
  optimizer_states  fp32 master weights and Adam moments in host memory
  gradients         fp32 gradient shards in host memory (accumulating, sealed, spare)
  optimizer_buffers the optimizer swapper's buffer sets (Note [optimizer swapper])
  optimizer_cache   the swapper's host cache of the first chunks (Note [host cache])
  gathered          gathered parameters returned for reuse on a CPU-only run (Note [recycled host memory])
Beside those the account of a running process (``host_account``) reports the heap of the C
allocator (torch's CPU tensors: activations, autograd's gradients, temporaries), the free
pages the allocator keeps, and the rest of the resident set (interpreter, libraries, code).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Dict, Optional

PARAM_SHARDS = "param_shards"
PARAM_STAGING = "param_staging"
PARAM_HANDOFF = "param_handoff"
PARAM_CACHE = "param_cache"  # Note [parameter cache] in _param_store.py
OPT_STATES = "optimizer_states"
GRADIENTS = "gradients"
OPT_BUFFERS = "optimizer_buffers"
OPT_HOST_CACHE = "optimizer_cache"
GATHERED = "gathered"
PARAM_FILES = "param_files"  # on NVMe
OPT_FILES = "optimizer_files"  # on NVMe

TIERS = ("device", "host", "nvme")

Plan = Dict[str, Dict[str, int]]  # tier -> category -> bytes


def merge(*plans: Plan) -> Plan:
    out: Plan = {t: {} for t in TIERS}
    for p in plans:
        for tier, cats in p.items():
            for cat, n in cats.items():
                if n:
                    out[tier][cat] = out[tier].get(cat, 0) + n
    return out


def totals(plan: Plan) -> Dict[str, int]:
    """Bytes per tier."""
    return {t: sum(plan.get(t, {}).values()) for t in TIERS}


# ------------------------------------------------------------------ the account of a process


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.mallinfo2.restype = _Mallinfo2
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        return lib
    except (OSError, AttributeError):  # not glibc (or older than 2.33): the heap is not split out
        return None


_LIBC = _libc()


def malloc_bytes() -> Optional[Dict[str, int]]:
    """The C allocator's heap: ``in_use`` (torch's CPU tensors and everything else malloc'd,
    mmapped blocks included) and ``retained`` (freed pages it keeps for reuse); None off glibc."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return {"in_use": int(m.uordblks + m.hblkhd), "retained": int(m.fordblks)}


def trim_heap() -> bool:
    """Give the allocator's free pages back to the system (``malloc_trim``); False off glibc."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)


def host_account(plan: Optional[Plan] = None) -> dict:
    """Where this process's host memory is now, by category (Note [one memory model]): the
    engine's aligned buffers as mapped (the ledger: live and peak), the C heap in use and
    retained, and the rest of the resident set; with ``plan``, what the plan says of each."""
    from .aio._memory import ledger

    snap = ledger.snapshot()
    rss = _status_bytes("VmRSS")
    out = {"rss": rss, "peak_rss": _status_bytes("VmHWM"), "mapped": snap["live"],
           "mapped_peak": snap["peak"], "mapped_peak_total": snap["peak_total"]}
    heap = malloc_bytes()
    rest = rss - sum(snap["live"].values())
    if heap is not None:
        out["heap_in_use"], out["heap_retained"] = heap["in_use"], heap["retained"]
        rest -= heap["in_use"] + heap["retained"]
    out["other"] = rest  # interpreter, libraries, code; can be negative when heap pages are not resident
    if plan is not None:
        out["planned"] = {t: dict(c) for t, c in plan.items() if c}
    return out
