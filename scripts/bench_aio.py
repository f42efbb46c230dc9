"""Sequential write and read throughput of infinity.aio against fio, in the same run.

For each block size and queue depth, alternating: our AsyncIO writes then reads the whole
file from one 2 MiB-aligned, huge-page-advised buffer (``aligned_empty``); fio (ioengine
io_uring, --direct=1, the same bs and iodepth, hugepage buffers with --mem=shmhuge) does the
same on the same file. Prints GB/s (1e9 bytes/s) medians of --reps runs and our/fio ratio.

fio's hugepage buffers need reserved huge pages: as root the script raises vm.nr_hugepages
for the run and restores the old value afterwards; otherwise fio falls back to --mem=malloc
and the table says so.

    python scripts/bench_aio.py --path /local_nvme [--size 2G] [--quick] [--reps 5]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

import torch

from benchmarks._flags import parse_size
from infinity.aio import AsyncIO, aligned_empty

HUGE = 2 << 20
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


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
            for attempt in range(3):  # a fragmented memory may need compaction first
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
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", "--ioengine=io_uring", "--direct=1", f"--size={size}",
           f"--mem={mem}", "--numjobs=1", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def run_ours(h: AsyncIO, buf: torch.Tensor, path: str, rw: str) -> float:
    start = time.perf_counter()
    (h.pwrite if rw == "write" else h.pread)(buf, path, 0)
    h.wait()
    return buf.numel() / (time.perf_counter() - start) / 1e9


def thp_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=None, help="directory on the disk to measure (default: a temp dir in /var/tmp)")
    p.add_argument("--size", default="2G", help="file size (default 2G)")
    p.add_argument("--reps", type=int, default=5, help="runs per setting; medians are printed (>= 3)")
    p.add_argument("--quick", action="store_true", help="1 GiB, bs 1M and 8M at queue depth 32 only")
    p.add_argument("--bs", default="256K,1M,8M", help="block sizes, comma separated")
    p.add_argument("--qd", default="8,32,128", help="queue depths, comma separated")
    args = p.parse_args(argv)
    if shutil.which("fio") is None:
        p.error("fio is not installed (Debian package `fio`); it is the reference of this benchmark")
    size = parse_size("1G" if args.quick and args.size == "2G" else args.size)
    block_sizes = [parse_size(b) for b in ("1M,8M" if args.quick else args.bs).split(",")]
    depths = [int(q) for q in ("32" if args.quick else args.qd).split(",")]
    size -= size % max(block_sizes)
    if args.reps < 3:
        p.error("--reps must be >= 3 (medians of at least three runs)")
    if size <= 0:
        p.error("--size must be at least the largest block size")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    with HugePages(max(block_sizes) * max(depths)) as hp:
        return run(args, size, block_sizes, depths, "shmhuge" if hp.ok else "malloc")


def run(args, size, block_sizes, depths, mem) -> int:
    workdir = args.path or tempfile.mkdtemp(prefix="bench_aio_", dir="/var/tmp")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "bench_aio.bin")
    before = thp_bytes()
    buf = aligned_empty(size)
    buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    thp = (thp_bytes() - before) / size
    with AsyncIO(block_size=8 << 20, queue_depth=32) as h:  # lay the file out once, untimed
        run_ours(h, buf, path, "write")
        backend = h.backend

    rows = []
    try:
        fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
        print(f"# file {path}, {size / 1e9:.2f} GB; ours: {backend}, aligned_empty buffer "
              f"({thp:.0%} in huge pages); {fio} --mem={mem}; medians of {args.reps}; GB/s = 1e9 B/s")
        print(f"{'bs':>5} {'qd':>4} | {'ours W':>7} {'fio W':>7} {'W ratio':>7} | "
              f"{'ours R':>7} {'fio R':>7} {'R ratio':>7}")
        for bs in block_sizes:
            for qd in depths:
                rows.append(measure(path, buf, size, bs, qd, args.reps, mem))
    finally:
        if args.path is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            os.unlink(path)
    w = statistics.geometric_mean([r[1] / r[2] for r in rows])
    r = statistics.geometric_mean([r[3] / r[4] for r in rows])
    print(f"geometric mean of ratios: write {w:.3f}, read {r:.3f}")
    return 0


def measure(path, buf, size, bs, qd, reps, mem):
    samples = {k: [] for k in ("ours_w", "fio_w", "ours_r", "fio_r")}
    with AsyncIO(block_size=bs, queue_depth=qd) as h:
        for rep in range(reps):
            order = ["ours", "fio"] if rep % 2 == 0 else ["fio", "ours"]
            for rw in ("write", "read"):
                for who in order:
                    gbps = run_ours(h, buf, path, rw) if who == "ours" else run_fio(path, rw, bs, qd, size, mem)
                    samples[f"{who}_{rw[0]}"].append(gbps)
    m = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{human(bs):>5} {qd:>4} | {m['ours_w']:7.2f} {m['fio_w']:7.2f} {m['ours_w'] / m['fio_w']:7.3f} | "
          f"{m['ours_r']:7.2f} {m['fio_r']:7.2f} {m['ours_r'] / m['fio_r']:7.3f}", flush=True)
    return (bs, m["ours_w"], m["fio_w"], m["ours_r"], m["fio_r"], qd)


if __name__ == "__main__":
    sys.exit(main())
