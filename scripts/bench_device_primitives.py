"""Bandwidth of the primitives the offload tiers are built from, one JSON line per measurement.

- Copies between host and device (CUDA only), both directions, from pinned (torch's
  ``pin_memory``), pageable and ``infinity.aio.aligned_empty`` host memory (the engine's
  buffers, page-locked by the accelerator layer): ``--size`` bytes, the median of ``--reps``
  copies after one untimed, each timed from a ``torch.cuda.synchronize()`` before to one after.
- Disk through ``infinity.aio``: sequential O_DIRECT writes and reads of a ``--file-size`` file
  under a fresh temp dir in ``--path``, from and into one ``aligned_empty`` buffer (pinned host
  memory on CUDA machines), with the engine's default request size and queue depth. A write
  is timed up to its ``fsync``. The first read goes into a second buffer and is compared
  with what was written.

GB/s is 1e9 bytes per second. Without CUDA the copies are recorded as skipped.

    python scripts/bench_device_primitives.py [--size 256M] [--file-size 1G] [--path /var/tmp] [--tiny]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

import torch  # noqa: E402 - after the path insert

from infinity.aio import AsyncIO, aligned_empty  # noqa: E402
from infinity.aio.tune import parse_size  # noqa: E402
from infinity.config import Config  # noqa: E402


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def gbps(nbytes: int, seconds: list) -> dict:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"gbps": round(statistics.median(rates), 3), "min_gbps": round(min(rates), 3),
            "max_gbps": round(max(rates), 3), "reps": len(rates)}


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copies(nbytes: int, reps: int) -> None:
    if not torch.cuda.is_available():
        emit({"bench": "copy", "skipped": "no CUDA"})
        return
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    hosts = {"pinned": lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
             "pageable": lambda: torch.empty(nbytes, dtype=torch.uint8),
             "aligned_empty": lambda: aligned_empty(nbytes)}  # the engine's own buffers
    for name, make in hosts.items():
        host = make()
        host.fill_(7)
        for direction, dst, src in (("h2d", device, host), ("d2h", host, device)):
            timed_copy(dst, src)  # untimed: first touch, driver set-up
            seconds = [timed_copy(dst, src) for _ in range(reps)]
            emit({"bench": direction, "host": name, "pinned": host.is_pinned(), "bytes": nbytes,
                  **gbps(nbytes, seconds)})
        del host


def filesystem(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it)."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def o_direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def disk(path: str, nbytes: int, reps: int, max_seconds: float) -> None:
    aio = Config().aio
    workdir = tempfile.mkdtemp(prefix="bench_primitives_", dir=path)
    file = os.path.join(workdir, "primitives.bin")
    try:
        buf = aligned_empty(nbytes)
        buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
        back = aligned_empty(nbytes)
        with AsyncIO(block_size=aio.block_size, queue_depth=aio.queue_depth, threads=aio.threads) as h:
            common = {"bytes": nbytes, "backend": h.backend, "block_size": aio.block_size,
                      "queue_depth": aio.queue_depth, "pinned": buf.is_pinned(), "fs": filesystem(workdir),
                      "path": workdir}

            def write() -> float:
                start = time.perf_counter()
                h.pwrite(buf, file, 0)
                h.wait()
                h.fsync(file)
                return time.perf_counter() - start

            def read(into: torch.Tensor) -> float:
                start = time.perf_counter()
                h.pread(into, file, 0)
                h.wait()
                return time.perf_counter() - start

            write()  # untimed: allocates the file's blocks
            common["o_direct"] = o_direct_ok(file)
            end = time.perf_counter() + max_seconds / 2
            writes = [write()]
            while len(writes) < reps and time.perf_counter() < end:
                writes.append(write())
            emit({"bench": "aio_write", **common, **gbps(nbytes, writes)})
            end = time.perf_counter() + max_seconds / 2
            reads = [read(back)]
            same = torch.equal(buf, back)
            while len(reads) < reps and time.perf_counter() < end:
                reads.append(read(back))
            emit({"bench": "aio_read", **common, **gbps(nbytes, reads), "data_ok": same})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("256M"), help="bytes per host<->device copy")
    p.add_argument("--reps", type=int, default=5, help="timed copies per setting (median)")
    p.add_argument("--file-size", type=parse_size, default=parse_size("1G"), help="bytes of the disk test file")
    p.add_argument("--io-reps", type=int, default=3, help="timed writes and reads of the file (median)")
    p.add_argument("--path", default=os.environ.get("GPU_CHECK_DISK", "/var/tmp"),
                   help="directory on the disk to measure (a temp dir is made and removed under it)")
    p.add_argument("--max-seconds", type=float, default=40.0,
                   help="disk: no new repetition once this is spent (at least one of each runs)")
    p.add_argument("--tiny", action="store_true", help="16 MiB copies, a 64 MiB file, 3 repetitions")
    args = p.parse_args()
    if args.tiny:
        args.size, args.file_size, args.reps, args.io_reps = 16 << 20, 64 << 20, 3, 3
    failed = 0
    for name, part in (("copies", lambda: copies(args.size, args.reps)),
                       ("disk", lambda: disk(args.path, args.file_size, args.io_reps, args.max_seconds))):
        try:
            part()
        except Exception as e:  # noqa: BLE001 - one part failing is a result; the other still runs
            emit({"bench": name, "error": f"{type(e).__name__}: {e}"})
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
