"""The disk bandwidth probe: O_DIRECT writes and reads of one file through ``infinity.aio``,
for the train job's summary and the run model's rates (Note [run model] in _runmodel.py)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, Optional

import torch

from .._offload._swap import PROBE_PREFIX
from ..aio import AsyncIO, aligned_empty

PROBE_BYTES = 64 * 1024 * 1024
PROBE_REPS = 3


def probe_disk(path: str, aio_cfg, nbytes: int = PROBE_BYTES) -> Optional[Dict[str, float]]:
    """Median O_DIRECT write and read bandwidth (bytes/s) of ``path`` through infinity.aio."""
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, f"{PROBE_PREFIX}{os.getpid()}.bin")  # reclaimed if this run crashes
    buf = aligned_empty(nbytes, torch.uint8)
    buf.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))  # not all zeros
    writes, reads = [], []
    try:
        with AsyncIO(aio_cfg.block_size, aio_cfg.queue_depth, aio_cfg.threads, direct=aio_cfg.direct) as h:
            for _ in range(PROBE_REPS):
                t = time.perf_counter()
                h.pwrite(buf, target, 0)
                h.wait()
                writes.append(nbytes / (time.perf_counter() - t))
                t = time.perf_counter()
                h.pread(buf, target, 0)
                h.wait()
                reads.append(nbytes / (time.perf_counter() - t))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)
    return {"write": sorted(writes)[len(writes) // 2], "read": sorted(reads)[len(reads) // 2]}
