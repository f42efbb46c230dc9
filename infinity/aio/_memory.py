"""Host memory for O_DIRECT: page-aligned, 2 MiB-aligned and advised for huge pages.

Note: why huge pages. A virtual disk (and many NVMe drivers) splits an O_DIRECT request
into one segment per physically contiguous run of the buffer. From 4 KiB pages a 1 MiB
request becomes several ~512 KiB device requests; from 2 MiB pages it stays whole. With
transparent huge pages in ``madvise`` mode the memory must be advised, and 2 MiB-aligned so
each huge page lines up with the buffer. Where THP is off the memory is still page-aligned,
which is all O_DIRECT needs.
"""
import threading
from collections import defaultdict

import torch

from .._runtime import _accelerator as acc
from .._runtime._log import logger
from ..errors import OutOfMemory, StorageError, UsageError, UsageTypeError
from ._native import ffi, lib

_HUGE_WARNED: list = []
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    """'always', 'madvise' or 'never' (the bracketed word of the sysfs file); '' if unknown."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


class HostLedger:
    """Note [host memory ledger]: bytes of aligned host memory mapped now and at their peak,
    by the category the caller named (``aligned_empty(..., what=)``). The count is kept where
    the memory is mapped and unmapped, so it is what the process really holds, not what a
    formula expects: the memory model (_memory_plan.py) is tested against it, and the telemetry
    reports it beside the resident set. A mapping counts from its allocation to the moment
    its last tensor goes (its unmap)."""

    def __init__(self):
        self._lock = threading.RLock()  # a mapping may be freed by a collection inside ``add``
        self.live = defaultdict(int)
        self.peak = defaultdict(int)
        self.peak_total = 0
        self._mappings: dict = {}  # address -> (bytes, category) of every live mapping

    def add(self, what: str, nbytes: int, address: int = 0) -> None:
        with self._lock:
            if address:
                self._mappings[address] = (nbytes, what)
            self.live[what] += nbytes
            self.peak[what] = max(self.peak[what], self.live[what])
            self.peak_total = max(self.peak_total, sum(self.live.values()))

    def sub(self, what: str, nbytes: int, address: int = 0) -> None:
        with self._lock:
            self._mappings.pop(address, None)
            self.live[what] -= nbytes

    def resident(self) -> dict:
        """Bytes of the live mappings resident now, by category (mincore): what they cost
        the resident set, less than ``live`` where pages were released (Note [released pages])
        or never touched."""
        out: dict = defaultdict(int)
        with self._lock:
            for address, (nbytes, what) in list(self._mappings.items()):
                n = lib.infinity_aio_resident(ffi.cast("void *", address), nbytes)
                out[what] += max(n, 0)  # -ENOMEM: unmapped meanwhile
        return {k: v for k, v in out.items() if v}

    def snapshot(self) -> dict:
        """``{"live": {category: bytes}, "peak": {...}, "peak_total": bytes}``."""
        with self._lock:
            return {"live": {k: v for k, v in self.live.items() if v}, "peak": dict(self.peak),
                    "peak_total": self.peak_total}

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = defaultdict(int, self.live)
            self.peak_total = sum(self.live.values())


ledger = HostLedger()


class _Mapping:
    """Owns one mapping from ``infinity_aio_alloc``; unmapped when the last tensor goes."""

    def __init__(self, nbytes: int, hugepage: bool, what: str = "other", pin: bool = True):
        huge = ffi.new("int32_t *")
        ptr = lib.infinity_aio_alloc(nbytes, 1 if hugepage else 0, huge)
        if ptr == ffi.NULL:
            raise OutOfMemory(f"aligned_empty: could not map {nbytes} bytes of host memory")
        self.nbytes, self.hugepage, self.huge = nbytes, hugepage, bool(huge[0])
        address = int(ffi.cast("uintptr_t", ptr))
        try:
            pinned = acc.host_register(address, nbytes) if pin else False  # page-locked for asynchronous device copies
        except BaseException:
            lib.infinity_aio_free(ptr, nbytes, 1 if hugepage else 0)
            raise
        ledger.add(what, nbytes, address)

        def free(p):
            ledger.sub(what, nbytes, address)  # out of the ledger before the address can be mapped again
            if pinned:
                acc.host_unregister(address)
            lib.infinity_aio_free(p, nbytes, 1 if hugepage else 0)

        self._ptr = ffi.gc(ptr, free)
        self.buffer = ffi.buffer(self._ptr, nbytes)


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, *, hugepage: bool = True,
                  what: str = "other", pin: bool = True) -> torch.Tensor:
    """A flat uninitialized CPU tensor on memory ready for O_DIRECT.

    2 MiB-aligned and advised for transparent huge pages (``hugepage=True``), else 4 KiB
    aligned. With an accelerator the mapping is pinned unless ``pin`` is off (``_accelerator.host_register``:
    cudaHostRegister on CUDA), so its size is what was asked for and it goes back to the
    system when its last tensor goes.
    ``what`` names the memory's category in the ledger (Note [host memory ledger]).
    """
    if not isinstance(dtype, torch.dtype):
        raise UsageTypeError(f"aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    numel = int(numel)
    if numel < 0:
        raise UsageError(f"aligned_empty: numel must be >= 0, got {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    mapping = _Mapping(nbytes, hugepage, what, pin)
    if hugepage and not _HUGE_WARNED and (not mapping.huge or _thp_mode() == "never"):
        _HUGE_WARNED.append(True)
        logger.info("aligned_empty: transparent huge pages are off (%s); using 4 KiB pages, "
                    "O_DIRECT requests may be split into smaller device requests",
                    _thp_mode() or "no THP support")
    # frombuffer keeps the cffi buffer (and through it the mapping) alive with the storage.
    return torch.frombuffer(mapping.buffer, dtype=torch.uint8).view(dtype)


HUGE_PAGE = 2 << 20


def release_pages(t: torch.Tensor) -> int:
    """Note [released pages]: give the pages of ``t`` (from ``aligned_empty``) back to the
    kernel while keeping its mapping; its contents read as zeros afterwards, and each page
    is faulted in again when next written. Whole 2 MiB pages inside ``t`` only, so a huge
    page is dropped whole, never split, and comes back as one fault that clears 2 MiB
    (about 0.1 ms) rather than 512 faults of 4 KiB (about 3 ms here). For engine buffers
    that sit idle through the activation peak: the gradient shards between the update that
    consumed them and the backward that writes them again, recycled buffers between uses.
    Pinned (page-locked) memory is not released. Returns the bytes released."""
    if acc.has_accelerator() or t.device.type != "cpu" or t.numel() == 0:
        return 0
    if not t.is_contiguous():
        raise UsageError("release_pages: the tensor must be contiguous")
    n = lib.infinity_aio_release(ffi.cast("void *", t.data_ptr()), t.numel() * t.element_size(), HUGE_PAGE)
    if n < 0:
        raise StorageError(-n, f"release_pages: madvise(MADV_DONTNEED) failed on {t.numel() * t.element_size()} bytes")
    return n
