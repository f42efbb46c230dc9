"""Asynchronous file I/O for the NVMe tier: io_uring through native/aio, bound with cffi.

``AsyncIO`` queues reads and writes of CPU tensors at byte offsets of files and returns at
once; ``wait`` collects them. ``aligned_empty`` hands out host memory that O_DIRECT can use
without copies. Transfers on a swap file's ``SwapPath`` carry block checksums, checked
on every read (``CorruptionError``; Note [swap checksums] in _checksum.py). When io_uring is
unavailable a thread pool of pread/pwrite takes over.
``python -m infinity.aio.tune --path DIR`` finds the best settings for a disk.
"""
from ._errors import AioError, CorruptionError
from ._handle import AsyncIO
from ._memory import aligned_empty

__all__ = ["AsyncIO", "AioError", "CorruptionError", "aligned_empty"]
