"""Finds the async I/O settings that move data fastest on one disk.

    python -m infinity.aio.tune --path /local_nvme [--size 1G] [--quick]

Writes and reads a test file under ``--path`` with ``AsyncIO`` from an ``aligned_empty``
buffer, the way the NVMe tier does, and searches one knob at a time (block size, then queue
depth, then threads), each setting timed ``--reps`` times (median). A setting's score is the
bytes of a write plus a read over their total time, the shape of a swap cycle. A larger
queue or more threads wins only by more than ``--margin``. The result is printed as the
``aio:`` section of an infinity config, with the config's own key names.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from ._handle import AsyncIO
from ._memory import aligned_empty

Setting = Tuple[int, int, int]  # block_size, queue_depth, threads


@dataclass
class Result:
    write_gbps: float
    read_gbps: float

    @property
    def score(self) -> float:
        # bytes of one write plus one read over the time of both: the harmonic mean
        return 2.0 / (1.0 / self.write_gbps + 1.0 / self.read_gbps)


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b").rstrip("i")
    value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def parse_list(text: str, parse=int) -> List[int]:
    try:
        values = [parse(x) for x in text.split(",") if x.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r} ({e})")
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
    return values


class Prober:
    """Times one write and one read of the whole test file per run, caching each setting."""

    def __init__(self, path: str, buf: torch.Tensor, reps: int, backend=None):
        self.path, self.buf, self.reps, self.backend = path, buf, reps, backend
        self.cache: Dict[Setting, Result] = {}

    def _once(self, h: AsyncIO, write: bool) -> float:
        start = time.perf_counter()
        (h.pwrite if write else h.pread)(self.buf, self.path, 0)
        h.wait()
        return self.buf.numel() / (time.perf_counter() - start) / 1e9

    def measure(self, setting: Setting) -> Result:
        if setting not in self.cache:
            bs, qd, threads = setting
            with AsyncIO(block_size=bs, queue_depth=qd, threads=threads, backend=self.backend) as h:
                runs = [(self._once(h, True), self._once(h, False)) for _ in range(self.reps)]
            self.cache[setting] = Result(statistics.median(w for w, _ in runs),
                                         statistics.median(r for _, r in runs))
            res = self.cache[setting]
            print(f"  block_size={bs:>9} queue_depth={qd:>4} threads={threads}: write {res.write_gbps:5.2f} "
                  f"GB/s, read {res.read_gbps:5.2f} GB/s, score {res.score:5.2f}", flush=True)
        return self.cache[setting]


def best_of(prober: Prober, settings: Sequence[Setting], margin: float) -> Setting:
    """The best setting; a later (larger) one must beat the current best by `margin`."""
    best = settings[0]
    for s in settings[1:]:
        if prober.measure(s).score > prober.measure(best).score * (1.0 + margin):
            best = s
    return best


def search(prober: Prober, block_sizes, depths, threads, margin: float) -> Setting:
    qd0 = 32 if 32 in depths else depths[len(depths) // 2]
    print("block size:")
    # Block sizes are not ordered by cost, so the plain best wins here.
    bs = max(((b, qd0, threads[0]) for b in block_sizes), key=lambda s: prober.measure(s).score)[0]
    print("queue depth:")
    qd = best_of(prober, [(bs, q, threads[0]) for q in depths], margin)[1]
    print("threads:")
    return best_of(prober, [(bs, qd, t) for t in threads], margin)


def config_section(setting: Setting) -> str:
    bs, qd, threads = setting
    return f"aio:\n  block_size: {bs}\n  queue_depth: {qd}\n  threads: {threads}\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infinity.aio.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="a directory on the disk to tune for (the NVMe path)")
    p.add_argument("--size", type=parse_size, default=1 << 30, help="test file size (default 1G)")
    p.add_argument("--block-sizes", type=lambda t: parse_list(t, parse_size), default="256K,1M,4M,8M")
    p.add_argument("--queue-depths", type=parse_list, default="8,16,32,64,128")
    p.add_argument("--threads", type=parse_list, default="1,2")
    p.add_argument("--reps", type=int, default=3, help="runs per setting (median)")
    p.add_argument("--margin", type=float, default=0.03,
                   help="a larger queue or more threads must be this much faster to win (default 0.03)")
    p.add_argument("--backend", choices=["io_uring", "threads"], default=None)
    p.add_argument("--quick", action="store_true", help="256 MiB file, one run per setting, fewer settings")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.reps = min(args.size, 256 << 20), 1
        args.block_sizes, args.queue_depths, args.threads = [1 << 20, 8 << 20], [8, 32], [1, 2]
    if not os.path.isdir(args.path):
        p.error(f"--path {args.path!r} is not a directory; pass a directory on the disk to tune")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    bad = [b for b in args.block_sizes if b % 4096]
    if bad:
        p.error(f"block sizes must be multiples of 4096, got {bad}")
    size = args.size - args.size % max(args.block_sizes) or max(args.block_sizes)

    buf = aligned_empty(size)
    buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="infinity-aio-tune-", dir=args.path) as tmp:
        path = os.path.join(tmp, "probe.bin")
        with AsyncIO(block_size=max(args.block_sizes), backend=args.backend) as h:
            h.pwrite(buf, path)  # lay the file out once, untimed
            h.wait()
            backend = h.backend
        print(f"tuning on {args.path} ({backend} backend, {size / 1e9:.2f} GB file, "
              f"median of {args.reps})", flush=True)
        prober = Prober(path, buf, args.reps, args.backend)
        best = search(prober, sorted(args.block_sizes), sorted(args.queue_depths), sorted(args.threads),
                      args.margin)
    res = prober.measure(best)
    print(f"best: write {res.write_gbps:.2f} GB/s, read {res.read_gbps:.2f} GB/s; "
          "paste into your infinity config:\n")
    print(config_section(best), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
