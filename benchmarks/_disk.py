"""The disk under the benchmarks that write large working sets (``large_model``, ``disk_mix``):
the free-space check before a run, and the bandwidth over a set of files measured the way the
optimizer swapper moves them (O_DIRECT through ``infinity.aio``, chunk-interleaved across the
files; reads, writes, and both at once as the swapper streams them)."""
from __future__ import annotations

import os
import shutil
import sys
import time

GiB = 2**30


def check_disk(path: str, need: int) -> None:
    """Exit with what to do when ``path`` has less than ``need`` bytes free; say the load average."""
    from ._flags import load_note

    print(load_note(), file=sys.stderr)
    os.makedirs(path, exist_ok=True)
    free = shutil.disk_usage(path).free
    print(f"disk under {path}: {free / GiB:.2f} GiB free, this run needs about {need / GiB:.2f} GiB", file=sys.stderr)
    if free < need:
        sys.exit(f"not enough disk: free {(need - free) / GiB:.2f} GiB more under {path}, or point --nvme-path at a "
                 f"disk with {need / GiB:.2f} GiB free, or a smaller model")


def files_under(root: str) -> list:
    """(path, bytes) of every non-empty file under ``root``: a run's working set on the disk."""
    out = []
    for d, _, names in os.walk(root):
        out += [(os.path.join(d, n), os.path.getsize(os.path.join(d, n))) for n in names]
    return [(p, n) for p, n in out if n > 0]


def working_set_bandwidth(files: list, chunk_bytes: int, inflight: int, aio_cfg) -> dict:
    """Read then write every byte of ``files`` through infinity.aio (O_DIRECT), in requests of
    ``chunk_bytes``, chunk-interleaved across the files (chunk k of every file, then k + 1),
    ``inflight`` chunk groups in flight: bytes/s of each pass, and of both at once (``mixed``)."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    bufs = [[aligned_empty(chunk_bytes, torch.uint8) for _ in files] for _ in range(inflight)]
    handles = [new_aio(aio_cfg) for _ in range(inflight)]
    longest = max(n for _, n in files)
    out = {}
    try:
        for op in ("read", "write"):
            moved, t = 0, time.perf_counter()
            for k, off in enumerate(range(0, longest, chunk_bytes)):
                s = k % inflight
                handles[s].wait()  # the group that used this slot inflight chunks ago
                for (path, size), buf in zip(files, bufs[s]):
                    n = min(chunk_bytes, size - off)
                    if n <= 0:
                        continue
                    (handles[s].pread if op == "read" else handles[s].pwrite)(buf[:n], path, off)
                    moved += n
            for h in handles:
                h.wait()
            out[op] = moved / (time.perf_counter() - t)
            out[f"{op}_bytes"] = moved
        out["mixed"] = mixed_pass(files, chunk_bytes, bufs[0], handles[0], aio_cfg)
    finally:
        for h in handles:
            h.close()
    return out


def mixed_pass(files: list, chunk_bytes: int, bufs: list, reader, aio_cfg) -> float:
    """Reads and writes at once, as the swapper runs them: chunk k of every file read while
    chunk k - 1 of every file is written back. Bytes/s of both together."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    writer = new_aio(aio_cfg)
    out_bufs = [aligned_empty(chunk_bytes, torch.uint8) for _ in files]
    longest = max(n for _, n in files)
    try:
        moved, t = 0, time.perf_counter()
        for off in range(0, longest + chunk_bytes, chunk_bytes):
            reader.wait()
            writer.wait()
            for (path, size), rbuf, wbuf in zip(files, bufs, out_bufs):
                if off < size:
                    n = min(chunk_bytes, size - off)
                    reader.pread(rbuf[:n], path, off)
                    moved += n
                if 0 <= off - chunk_bytes < size:
                    n = min(chunk_bytes, size - off + chunk_bytes)
                    writer.pwrite(wbuf[:n], path, off - chunk_bytes)
                    moved += n
        reader.wait()
        writer.wait()
        return moved / (time.perf_counter() - t)
    finally:
        writer.close()
