"""Does the disk read and write at once as fast as it reads and writes in turns? (issue 23 item 5)

The optimizer swapper streams chunks: chunk k is read while chunk k - 1 is written back, so the
disk serves reads and writes at once. This writes a working set of ``--gb`` GB in 5 files (as
many as the swapper's), then measures over it through infinity.aio (O_DIRECT, 16 MiB requests
per file, the swapper's chunk), ``--steps`` times each, in turns in one process (Note
[contenders side by side] in _harness.py):

  read, write       a read pass, a write pass (B bytes each)
  read-then-write   the two passes one after the other (2B; its GB/s is the harmonic mean of
                    theirs: what a half-read, half-write stream reaches if the two do not interfere)
  at-once           both at once, as the swapper streams them (``_disk.mixed_pass``; 2B)
  phased-x1, -x4    read 1 (or 4) chunks of every file, wait, write them back, wait: reads and
                    writes never at once (2B)

A step is one pass; ``extra.gbps`` counts read and written bytes together. Ratios: each 2B
contender against ``read-then-write`` (a step quotient above 1: slower than no interference).

    python -m benchmarks.disk_mix [--gb 48] [--steps 2] [--nvme-path DIR]
"""
from __future__ import annotations

import os
import statistics
import sys

from . import _disk, _flags, _harness
from ._harness import Cell

BENCH = "disk_mix"
GB = 1e9
CHUNK = 16 << 20
FILES = 5
CONTENDERS = ("read", "write", "read-then-write", "at-once", "phased-x1", "phased-x4")
PAIRS = tuple((name, "read-then-write") for name in ("at-once", "phased-x1", "phased-x4"))


def create(root: str, total: float, aio_cfg) -> list:
    """``FILES`` files of ``total`` bytes together, every byte written (an unwritten extent reads as zeros without I/O)."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    size = int(total) // FILES // CHUNK * CHUNK
    files = [(os.path.join(root, f"f{i}.swp"), size) for i in range(FILES)]
    h, buf = new_aio(aio_cfg), aligned_empty(CHUNK, torch.uint8)
    buf.fill_(7)
    try:
        for path, n in files:
            with open(path, "wb") as f:
                f.truncate(n)
            for k, off in enumerate(range(0, n, CHUNK)):
                h.pwrite(buf, path, off)
                if k % 8 == 7:
                    h.wait()
            h.wait()
    finally:
        h.close()
    return files


def phased(files: list, burst: int, aio_cfg) -> float:
    """Read ``burst`` chunks of every file, wait, write them back, wait: the seconds of one pass."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    rh, wh = new_aio(aio_cfg), new_aio(aio_cfg)
    bufs = [[aligned_empty(CHUNK, torch.uint8) for _ in files] for _ in range(burst)]
    offs = list(range(0, max(n for _, n in files), CHUNK))

    def one_pass():
        for b in range(0, len(offs), burst):
            for handle, op in ((rh, "pread"), (wh, "pwrite")):
                for j, off in enumerate(offs[b : b + burst]):
                    for (path, _), buf in zip(files, bufs[j]):
                        getattr(handle, op)(buf, path, off)
                handle.wait()

    try:
        return _harness.timed(one_pass)
    finally:
        rh.close()
        wh.close()


def measure(spec: dict) -> dict:
    from infinity.config import AioConfig

    aio = AioConfig()
    files = create(spec["scratch"], spec["gb"] * GB, aio)
    total = sum(n for _, n in files)
    times = {name: [] for name in CONTENDERS}
    for _ in range(spec["steps"]):
        ws = _disk.working_set_bandwidth(files, CHUNK, 1, aio)
        read, write = total / ws["read"], total / ws["write"]
        for name, seconds in (("read", read), ("write", write), ("read-then-write", read + write),
                              ("at-once", 2 * total / ws["mixed"]), ("phased-x1", phased(files, 1, aio)),
                              ("phased-x4", phased(files, 4, aio))):
            times[name].append(seconds)
    moved = {name: total * (1 if name in ("read", "write") else 2) for name in CONTENDERS}
    return _harness.side_by_side({name: _harness.sample(ts, extra={
        "bytes": moved[name], "gbps": round(moved[name] / statistics.median(ts) / GB, 3), "files": FILES,
        "chunk_bytes": CHUNK}) for name, ts in times.items()})


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=2, warmup=0, timeout=7200.0)
    p.add_argument("--gb", type=float, default=48.0, help="the working set, GB")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.gb, args.steps = 0.2, 1
    smallest = FILES * CHUNK / GB
    if args.gb < smallest:
        p.error(f"--gb {args.gb:g}: the working set is {FILES} files of whole {CHUNK >> 20} MiB chunks, so at least "
                f"{smallest:.2f} GB; larger sets spread the requests over more of the drive")
    _disk.check_disk(args.nvme_path, int(args.gb * GB))
    records = _harness.run_cells(BENCH, "benchmarks.disk_mix", [Cell("disk", f"{args.gb:g}GB", side_by_side=CONTENDERS)],
                                 lambda cell, scratch: {"gb": args.gb, "steps": args.steps, "scratch": scratch}, args)
    return _harness.finish(BENCH, records, args, PAIRS, extra=("gbps",), ratio_extra=("gbps",))


if __name__ == "__main__":
    sys.exit(main())
