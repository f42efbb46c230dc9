"""The engine's one model of its bytes: what each store needs for a plan, and what the host holds.

Note [one memory model]: the bytes a placement needs follow from the layout (flat sizes of
the optimizer and parameter spaces, the largest unit) and the config (tiers, chunk, host
cache, staging buffers). Each store states them for a plan, before anything is allocated,
as ``{tier: {category: bytes}}`` (``MemoryParamStore.plan``, ``NvmeParamStore.plan``, ``MemoryOptimizerStore.plan``,
``NvmeOptimizerStore.plan`` in _nvme_optimizer_store.py); ``store_plan`` (in _preflight.py) adds the engine's own recycled
gathered buffers. Everything that speaks of those bytes reads that one function: the
preflight (``_preflight.plan``) with the run's real layout, ``Engine.tier_bytes`` and the
stores' ``nbytes()``, the telemetry's account, and ``infinity.estimate`` with a layout
derived from the model's shape. ``tests/integration/test_memory_model.py`` checks the plan against the
bytes the stores really mapped (Note [host memory ledger] in aio/_memory.py).

Categories of host memory (the names the ledger and the plan share):
  param_shards      compute-dtype parameter shards on the cpu tier
  param_staging     the NVMe parameter tier's staging pool (filled on first need)
  param_handoff     the step's fresh parameter output kept for the next forward (Note [hand-off] in _nvme_param_store.py)
  optimizer_states  fp32 master weights and Adam moments in host memory
  gradients         fp32 gradient shards in host memory (accumulating, sealed, spare)
  undo_log          what a speculative update overwrote, kept until the step validates it (Note [speculative
                    update] in _zero/_speculative_update.py)
  optimizer_buffers the optimizer swapper's buffer sets (Note [optimizer swapper] in _nvme_optimizer_store.py)
  optimizer_cache   the swapper's host cache of the first chunks (Note [host cache] in _nvme_optimizer_store.py)
  gathered          gathered parameters returned for reuse on a CPU-only run (Note [recycled host memory] in _recycle.py)
Beside those the account of a running process (``host_account``) reports the heap of the C
allocator (torch's CPU tensors: activations, autograd's gradients, temporaries), the free
pages the allocator keeps, and the rest of the resident set (interpreter, libraries, code).

Note [allocator retained pages]: torch's CPU tensors come from glibc's malloc. Its mmap
threshold is dynamic: once a mapped block is freed, blocks up to that size (at most 32 MiB) come
from the heap arenas instead, and freed heap blocks stay in the process for reuse. A training
step frees and allocates activations of a few MiB in a different order every phase, so the
arenas fragment and keep their free pages: with GPT-2 124M on NVMe the heap retained 0.7 GiB at
the peak of backward and 1.6 GiB after the step, more than the engine's own buffers for
gradients. The block cache (Note [block cache] in native/host_alloc/host_alloc.cpp) replaces
glibc for those blocks by default; where it was not built, ``zero.host_allocator: release``
falls back to ``release_freed_blocks``, which fixes the threshold at MMAP_THRESHOLD, so every
block of that size or more is a mapping of its own, returned to the system when freed, and trims
what the arenas already keep. The cost is a page fault per page of each new block, which the
heap's reuse avoided; blocks below the threshold still come from the arenas. Measured there
(benchmarks/host_memory.py), peak RSS and minor faults per step: dynamic (glibc's default)
4.48 GiB, 0.35M; fixed at 16 MiB 5.10 GiB, 0.1-0.4M; 4 MiB 4.11 GiB, 0.9M; 1 MiB 3.84 GiB,
1.27M. 1 MiB is the only setting that removes the retained pages at the peak, and its 0.9M more
faults per step (3.6 GB zeroed) made the step 1.18x slower in a paired run, which is why the
block cache keeps freed blocks for reuse instead. With glibc advising huge pages for its
mappings (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, read only at process start, so
``initialize`` can only say so: ``huge_page_hint``) the faults come 2 MiB at a time: in the same
bench (2 rounds, GPT-2 124M, everything on NVMe) 0.22-0.24M faults per step instead of
1.28-1.30M, and the step 8.04 s instead of 8.79 s (plain PyTorch 8.08 s), at the same peak (2.71
GiB, 0.61x plain's 4.46 GiB).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Dict, Optional

import torch  # noqa: F401 - loaded before the block cache module, which shares its libc10

from ..aio import _memory as aio_memory
from ..aio._memory import ledger

PARAM_SHARDS = "param_shards"
PARAM_STAGING = "param_staging"
PARAM_HANDOFF = "param_handoff"
PARAM_CACHE = "param_cache"  # Note [parameter cache] in _nvme_param_store.py
OPT_STATES = "optimizer_states"
GRADIENTS = "gradients"
UNDO_LOG = "undo_log"  # Note [speculative update] in _zero/_speculative_update.py
OPT_BUFFERS = "optimizer_buffers"
OPT_HOST_CACHE = "optimizer_cache"
GATHERED = "gathered"
PARAM_FILES = "param_files"  # on NVMe
OPT_FILES = "optimizer_files"  # on NVMe

TIERS = ("device", "host", "nvme")

MemoryPlan = Dict[str, Dict[str, int]]  # tier -> category -> bytes


def merge(*plans: MemoryPlan) -> MemoryPlan:
    out: MemoryPlan = {t: {} for t in TIERS}
    for p in plans:
        for tier, cats in p.items():
            for cat, n in cats.items():
                if n:
                    out[tier][cat] = out[tier].get(cat, 0) + n
    return out


def totals(plan: MemoryPlan) -> Dict[str, int]:
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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: blocks this large and larger are mapped on their own (Note [allocator retained pages])


def release_freed_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Note [allocator retained pages]: map every block of ``threshold`` bytes or more on its
    own (freed at once), trim the heap's free pages above twice that, and give back what the
    arenas keep now. Process-wide. False off glibc, where nothing changes."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    ok = _LIBC.mallopt(M_MMAP_THRESHOLD, int(threshold)) and _LIBC.mallopt(M_TRIM_THRESHOLD, 2 * int(threshold))
    trim_heap()
    return bool(ok)


def huge_page_hint() -> str:
    """Note [allocator retained pages]: what to set for glibc to fault its mapped blocks in
    2 MiB pages, or "" when it is set or the kernel has no transparent huge pages to give."""
    if "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "") or aio_memory._thp_mode() in ("", "never"):
        return ""
    return ("; set GLIBC_TUNABLES=glibc.malloc.hugetlb=1 before Python starts to fault those blocks in 2 MiB "
            "pages (GPT-2 124M on NVMe: 5.6x fewer page faults, 1.09x -> 0.99x plain PyTorch's step)")


def trim_heap() -> bool:
    """Give the allocator's free pages back to the system (``malloc_trim``); False off glibc."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


# ------------------------------------------------------------------ the block cache

BLOCK_MIN = 1 << 20  # bytes: torch's CPU blocks this large and larger come from the block cache
RELEASE_CACHE_CAP = 256 << 20  # bytes of freed blocks kept at most under zero.host_allocator: release


def _block_cache():
    """Note [block cache] in native/host_alloc/host_alloc.cpp: the native module, or None
    where it was not built (torch not importable when the package was built)."""
    try:
        from .. import _host_alloc  # type: ignore[attr-defined]  # late: optional, absent where it was not built
    except ImportError:
        return None
    return _host_alloc


_BLOCK_USERS = [0]  # engines using the block cache now; the last one to close restores torch's allocator


def use_block_cache(cache_cap: Optional[int]) -> bool:
    """Note [block cache] in host_alloc.cpp: serve torch's CPU blocks of BLOCK_MIN bytes or more from the block
    cache, keeping at most ``cache_cap`` bytes of freed blocks (None: every freed block, for
    reuse); process-wide, until every engine that asked has called ``stop_block_cache``.
    False where the module was not built (glibc's allocator stays)."""
    lib = _block_cache()
    if lib is None:
        return False
    lib.install(BLOCK_MIN, True, (1 << 63) if cache_cap is None else int(cache_cap))
    _BLOCK_USERS[0] += 1
    return True


def stop_block_cache() -> None:
    """An engine is done with the block cache: its freed blocks go back to the system, and
    with the last engine torch's previous allocator is restored (live blocks stay valid)."""
    lib = _block_cache()
    if lib is None or _BLOCK_USERS[0] == 0:
        return
    _BLOCK_USERS[0] -= 1
    if _BLOCK_USERS[0] == 0:
        lib.uninstall()
    lib.release_cached()


def block_cache_bytes() -> Optional[Dict[str, int]]:
    """The block cache's ``live`` (torch's tensors) and ``cached`` (freed, kept for reuse) bytes;
    None when it does not serve torch now."""
    lib = _block_cache()
    if lib is None:
        return None
    st = lib.stats()
    return {"live": st["live_bytes"], "cached": st["cached_bytes"]} if st["installed"] else None


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)


def host_account(plan: Optional[MemoryPlan] = None) -> dict:
    """Where this process's host memory is now, by category (Note [one memory model]): the
    engine's aligned buffers as mapped (the ledger: live and peak) and as resident now, the C heap in use and
    retained, the block cache's blocks in use and cached (Note [block cache] in host_alloc.cpp), and the rest of the
    resident set; with ``plan``, what the plan says of each."""
    snap = ledger.snapshot()
    resident = ledger.resident()  # less than mapped where pages were released (Note [released pages] in _memory.py)
    rss = _status_bytes("VmRSS")
    out = {"rss": rss, "peak_rss": _status_bytes("VmHWM"), "mapped": snap["live"], "resident": resident,
           "mapped_peak": snap["peak"], "mapped_peak_total": snap["peak_total"]}
    heap = malloc_bytes()
    rest = rss - sum(resident.values())
    blocks = block_cache_bytes()
    if blocks is not None:  # torch's large blocks (Note [block cache] in host_alloc.cpp); not in the C heap
        out["blocks_in_use"], out["blocks_cached"] = blocks["live"], blocks["cached"]
        rest -= blocks["live"] + blocks["cached"]
    if heap is not None:
        out["heap_in_use"], out["heap_retained"] = heap["in_use"], heap["retained"]
        rest -= heap["in_use"] + heap["retained"]
    out["other"] = rest  # interpreter, libraries, code; can be negative when heap pages are not resident
    if plan is not None:
        out["planned"] = {t: dict(c) for t, c in plan.items() if c}
    return out
