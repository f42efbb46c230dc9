"""Bandwidth of the primitives the offload tiers are built from.

- ``copies`` (CUDA only): host<->device copies, both directions, from pinned (torch's
  ``pin_memory``), pageable and ``infinity.aio.aligned_empty`` host memory (the engine's buffers,
  page-locked by the accelerator layer): ``--size`` bytes, ``--steps`` copies after one untimed,
  each timed from a ``torch.cuda.synchronize()`` before to one after. Contenders
  ``h2d-pinned``, ``d2h-pinned``, ``h2d-pageable``, ... in one process.
- ``disk``: sequential O_DIRECT writes and reads of a ``--file-size`` file under a fresh folder
  in ``--nvme-path``, from and into one ``aligned_empty`` buffer (pinned host memory on CUDA
  machines), with the engine's default request size and queue depth, ``--disk-steps`` of each
  (fewer once ``--max-seconds`` is spent). A write is timed up to its ``fsync``. The first read
  goes into a second buffer and is compared with what was written (``data_ok``). Contenders
  ``aio-write``, ``aio-read``.

A step is one copy or one pass over the file; ``extra`` holds GB/s (1e9 bytes per second) of
the median, fastest and slowest step. Without CUDA the copies are recorded as skipped.

    python -m benchmarks.device_primitives [--size 256M] [--file-size 1G] [--nvme-path /var/tmp] [--smoke]
"""
from __future__ import annotations

import os
import sys
import time

from . import _flags, _harness
from ._harness import Cell

BENCH = "device_primitives"
HOSTS = ("pinned", "pageable", "aligned_empty")
COPIES = tuple(f"{d}-{h}" for h in HOSTS for d in ("h2d", "d2h"))
DISK = ("aio-write", "aio-read")


def rates(nbytes: int, seconds: list, **extra) -> dict:
    """A sample of ``seconds`` moving ``nbytes`` each, with its GB/s beside it."""
    import statistics

    gbps = [nbytes / s / 1e9 for s in seconds]
    return _harness.sample(seconds, extra=dict(extra, bytes=nbytes, gbps=round(statistics.median(gbps), 3),
                                               min_gbps=round(min(gbps), 3), max_gbps=round(max(gbps), 3)))


def timed_copy(dst, src) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copies(nbytes: int, steps: int) -> dict:
    import torch

    from infinity.aio import aligned_empty

    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    make = {"pinned": lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            "pageable": lambda: torch.empty(nbytes, dtype=torch.uint8),
            "aligned_empty": lambda: aligned_empty(nbytes)}  # the engine's own buffers
    out = {}
    for name in HOSTS:
        host = make[name]()
        host.fill_(7)
        for direction, dst, src in (("h2d", device, host), ("d2h", host, device)):
            timed_copy(dst, src)  # untimed: first touch, driver set-up
            seconds = [timed_copy(dst, src) for _ in range(steps)]
            out[f"{direction}-{name}"] = rates(nbytes, seconds, host=name, pinned=host.is_pinned())
        del host
    return out


def o_direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def disk(workdir: str, nbytes: int, steps: int, max_seconds: float) -> dict:
    import torch

    from infinity.aio import AsyncIO, aligned_empty
    from infinity.config import Config
    from infinity.testing import fs_type

    aio = Config().aio
    file = os.path.join(workdir, "primitives.bin")
    buf = aligned_empty(nbytes)
    buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    back = aligned_empty(nbytes)
    with AsyncIO(block_size=aio.block_size, queue_depth=aio.queue_depth, threads=aio.threads) as h:
        common = {"backend": h.backend, "block_size": aio.block_size, "queue_depth": aio.queue_depth,
                  "pinned": buf.is_pinned(), "fs": fs_type(workdir), "path": workdir}

        def write() -> float:
            return _harness.timed(lambda: (h.pwrite(buf, file, 0), h.wait(), h.fsync(file)))

        def read() -> float:
            return _harness.timed(lambda: (h.pread(back, file, 0), h.wait()))

        def repeat(fn, seconds: list) -> list:  # at least the one given, at most ``steps``, within the time
            end = time.perf_counter() + max_seconds / 2
            while len(seconds) < steps and time.perf_counter() < end:
                seconds.append(fn())
            return seconds

        write()  # untimed: allocates the file's blocks
        common["o_direct"] = o_direct_ok(file)
        writes = repeat(write, [write()])
        reads = [read()]
        same = torch.equal(buf, back)
        reads = repeat(read, reads)
    return {"aio-write": rates(nbytes, writes, **common), "aio-read": rates(nbytes, reads, **common, data_ok=same)}


def measure(spec: dict) -> dict:
    if spec["part"] == "copies":
        return _harness.side_by_side(copies(spec["size"], spec["steps"]))
    return _harness.side_by_side(disk(spec["scratch"], spec["file_size"], spec["disk_steps"], spec["max_seconds"]))


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=5, warmup=1, timeout=600.0)
    p.add_argument("--size", default="256M", help="bytes per host<->device copy")
    p.add_argument("--file-size", default="1G", help="bytes of the disk test file")
    p.add_argument("--disk-steps", type=int, default=3, help="timed writes and reads of the file (median)")
    p.add_argument("--max-seconds", type=float, default=40.0,
                   help="disk: no new repetition once this is spent (at least one of each runs)")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.size, args.file_size, args.steps, args.disk_steps = "16M", "64M", 3, 3
    import torch

    size, file_size = _flags.parse_size(args.size), _flags.parse_size(args.file_size)
    cells = [Cell("copies", args.size, None if torch.cuda.is_available() else "no CUDA", COPIES),
             Cell("disk", args.file_size, side_by_side=DISK)]
    records = _harness.run_cells(BENCH, "benchmarks.device_primitives", cells, lambda cell, scratch: {
        "part": cell.contender, "size": size, "file_size": file_size, "steps": args.steps,
        "disk_steps": args.disk_steps, "max_seconds": args.max_seconds, "scratch": scratch}, args)
    return _harness.finish(BENCH, records, args, extra=("gbps", "min_gbps", "max_gbps"))


if __name__ == "__main__":
    sys.exit(main())
