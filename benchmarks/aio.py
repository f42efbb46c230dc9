"""Sequential write and read throughput of infinity.aio against fio, side by side in one process.

For each block size (``--block-sizes``) and queue depth (``--queue-depths``), one cell: our
AsyncIO writes then reads the whole ``--file-size`` file from one 2 MiB-aligned, huge-page-advised
buffer (``aligned_empty``), and fio (ioengine io_uring, --direct=1, the same bs and iodepth,
hugepage buffers with --mem=shmhuge) does the same on the same file, in turns, the order
alternating each step (Note [contenders side by side] in _harness.py). A step is one pass over
the file; ``extra`` holds GB/s (1e9 bytes/s, the median pass's). Contenders ``ours-write``,
``fio-write``, ``ours-read``, ``fio-read``; the ratios are ours over fio (a step quotient below
1: ours faster; ``gbps`` above 1: ours faster), and the closing line their geometric mean.

fio's hugepage buffers need reserved huge pages: as root the benchmark raises vm.nr_hugepages
for the run and restores the old value afterwards; otherwise fio falls back to --mem=malloc and
its records say so. Without fio its contenders are skipped.

    python -m benchmarks.aio --nvme-path /local_nvme [--file-size 2G] [--steps 5]
                             [--block-sizes 256K,1M,8M] [--queue-depths 8,32,128]
    python -m benchmarks.aio --smoke
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

from . import _flags, _harness
from ._harness import Cell

BENCH = "aio"
HUGE = 2 << 20
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
CONTENDERS = ("ours-write", "fio-write", "ours-read", "fio-read")
PAIRS = (("ours-write", "fio-write"), ("ours-read", "fio-read"))


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


class HugePages:
    """Reserves enough huge pages for fio's buffers and restores the old count on exit."""

    def __init__(self, need_bytes: int):
        self.need = need_bytes // HUGE + 16
        self.old = None
        self.ok = False

    def __enter__(self):
        try:
            with open(NR_HUGEPAGES) as f:
                self.old = int(f.read())
            for _ in range(3):  # a fragmented memory may need compaction first
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(str(max(self.old, self.need)))
                with open(NR_HUGEPAGES) as f:
                    got = int(f.read())
                self.ok = got >= self.need
                if self.ok:
                    break
                with open("/proc/sys/vm/compact_memory", "w") as f:
                    f.write("1")
            if not self.ok:
                print(f"# only {got} of {self.need} huge pages could be reserved; fio uses --mem=malloc",
                      file=sys.stderr)
        except OSError as e:
            print(f"# cannot reserve huge pages ({e}); fio uses --mem=malloc", file=sys.stderr)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(self.old))


def run_fio(path: str, rw: str, bs: int, qd: int, size: int, mem: str) -> float:
    """Seconds of one fio pass (its own bandwidth figure, turned into the pass's time)."""
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
           "--ioengine=io_uring", "--direct=1", f"--size={size}", f"--mem={mem}", "--numjobs=1",
           "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return size / job["read" if rw == "read" else "write"]["bw_bytes"]


def run_ours(h, buf, path: str, rw: str) -> float:
    return _harness.timed(lambda: ((h.pwrite if rw == "write" else h.pread)(buf, path, 0), h.wait()))


def thp_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:")), 0)


def measure(spec: dict) -> dict:
    import torch

    from infinity.aio import AsyncIO, aligned_empty

    size, bs, qd = spec["file_size"], spec["block_size"], spec["queue_depth"]
    path = os.path.join(spec["scratch"], "bench_aio.bin")
    before = thp_bytes()
    buf = aligned_empty(size)
    buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    common = {"file_bytes": size, "block_size": bs, "queue_depth": qd, "huge_pages": round((thp_bytes() - before) / size, 2)}
    fio = shutil.which("fio")
    times = {name: [] for name in CONTENDERS}
    with HugePages(bs * qd) as hp, AsyncIO(block_size=bs, queue_depth=qd) as h:
        mem = "shmhuge" if hp.ok else "malloc"
        run_ours(h, buf, path, "write")  # lay the file out once, untimed
        common["backend"] = h.backend
        for step in range(spec["steps"]):
            order = ("ours", "fio") if step % 2 == 0 else ("fio", "ours")
            for rw in ("write", "read"):
                for who in order:
                    if who == "ours":
                        times[f"ours-{rw}"].append(run_ours(h, buf, path, rw))
                    elif fio:
                        times[f"fio-{rw}"].append(run_fio(path, rw, bs, qd, size, mem))
    version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() if fio else None
    out = {}
    for name, ts in times.items():
        if not ts:
            out[name] = _harness.skipped("fio is not installed (Debian package `fio`)")
            continue
        extra = dict(common, gbps=round(size / statistics.median(ts) / 1e9, 3),
                     **({"fio": version, "fio_mem": mem} if name.startswith("fio") else {}))
        out[name] = _harness.sample(ts, extra=extra)
    return _harness.side_by_side(out)


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=5, warmup=0, timeout=3600.0)
    p.add_argument("--file-size", default="2G", help="bytes of the file (K/M/G suffixes)")
    p.add_argument("--block-sizes", default="256K,1M,8M", help="request sizes, comma-separated")
    p.add_argument("--queue-depths", default="8,32,128", help="queue depths, comma-separated")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.file_size, args.block_sizes, args.queue_depths, args.steps = "64M", "1M", "32", 3
    if args.steps < 3:
        p.error("--steps must be >= 3 (medians of at least three passes)")
    block_sizes = [_flags.parse_size(b) for b in _flags.parse_list(args.block_sizes)]
    depths = [int(q) for q in _flags.parse_list(args.queue_depths)]
    size = _flags.parse_size(args.file_size)
    size -= size % max(block_sizes)
    if size <= 0:
        p.error("--file-size must be at least the largest block size")
    cells = [Cell("aio", f"{human(bs)}-qd{qd}", side_by_side=CONTENDERS) for bs in block_sizes for qd in depths]
    shape = {f"{human(bs)}-qd{qd}": (bs, qd) for bs in block_sizes for qd in depths}
    records = _harness.run_cells(BENCH, "benchmarks.aio", cells, lambda cell, scratch: {
        "file_size": size, "block_size": shape[cell.size][0], "queue_depth": shape[cell.size][1],
        "steps": args.steps, "scratch": scratch}, args)
    status = _harness.finish(BENCH, records, args, PAIRS, extra=("gbps",), ratio_extra=("gbps",))
    quotients = _harness.ratios(BENCH, records, PAIRS, ("gbps",))
    for rw in ("write", "read"):
        mine = [q["extra"]["gbps"] for q in quotients if q["contender"] == f"ours-{rw}" and "gbps" in q["extra"]]
        if mine:
            print(f"geometric mean of ours / fio, {rw}: {statistics.geometric_mean(mine):.3f}x the bandwidth")
    return status


if __name__ == "__main__":
    sys.exit(main())
