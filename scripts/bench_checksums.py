"""What the swap-file checksums cost (Note [swap checksums] in infinity/aio/_checksum.py).

Three measurements, each ours with checksums against ours without, in the same run,
alternating, medians of --reps:

1. CRC32C throughput of one core: the SSE4.2 instruction (when the CPU has it), the
   portable scalar loop, and per-4 KiB-block sums as the I/O threads compute them, over 64 MiB.
2. AsyncIO: writing then reading a --size file through a checksummed path (sums recorded on
   every write, checked on every read) and through a plain one.
3. The headline: the train job's default run (``bash scripts/run.sh``: tiny GPT-2, every
   state on NVMe) for --steps steps with ``aio.checksums`` true and false; its "total" step
   time. Skip it with --skip-headline.

    python scripts/bench_checksums.py [--path DIR] [--size 256M] [--steps 10] [--reps 3]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's infinity

import torch  # noqa: E402

from infinity.aio import AsyncIO, aligned_empty  # noqa: E402
from infinity.testing import checksummed, crc32c_hardware, native_aio  # noqa: E402

ffi, lib = native_aio.ffi, native_aio.lib


def crc_rates(reps: int) -> dict:
    buf = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    ptr = ffi.cast("void *", buf.data_ptr())
    sums = ffi.new("uint32_t[]", buf.numel() // 4096)
    out = {"hardware": [], "scalar": [], "blocks": []}
    for _ in range(reps):
        for impl, name in ((0, "hardware"), (1, "scalar"), (2, "blocks")):
            t = time.perf_counter()
            if impl == 2:
                lib.infinity_aio_crc32c_blocks(ptr, buf.numel() // 4096, sums)
            else:
                lib.infinity_aio_crc32c(0, ptr, buf.numel(), impl)
            out[name].append(buf.numel() / (time.perf_counter() - t) / 1e9)
    return {k: statistics.median(v) for k, v in out.items()}


def io_times(path: str, size: int, reps: int) -> dict:
    buf = aligned_empty(size)
    buf.random_(0, 256)
    times = {True: [], False: []}
    with AsyncIO() as h:
        for _ in range(reps):
            for on in (True, False):
                target = checksummed(os.path.join(path, f"bench-{on}.swp"), size, on)
                t = time.perf_counter()
                h.pwrite(buf, target, 0)
                h.wait()
                h.pread(buf, target, 0)
                h.wait()
                times[on].append(time.perf_counter() - t)
    return {on: statistics.median(v) for on, v in times.items()}


def headline(steps: int, reps: int, nvme: str) -> dict:
    from infinity.train import default_config

    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(reps):
            for on in (True, False):
                cfg = default_config()
                cfg["train"]["output_dir"] = os.path.join(tmp, f"run-{on}")
                cfg["zero"]["offload_param"]["nvme_path"] = cfg["zero"]["offload_optimizer"]["nvme_path"] = nvme
                cfg["aio"] = {"checksums": on}
                path = os.path.join(tmp, "config.json")
                with open(path, "w") as f:
                    json.dump(cfg, f)
                cmd = [sys.executable, "-m", "infinity.train", "--config", path, "--no-save", "--steps", str(steps)]
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": ROOT})
                m = re.search(r"^\s*total\s+([0-9.]+)\s+100%", r.stdout, re.M)
                if r.returncode != 0 or m is None:
                    raise SystemExit(f"the train job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
                times[on].append(float(m.group(1)))
                print(f"  headline checksums={'on ' if on else 'off'}  {times[on][-1]:.4f} s/step", flush=True)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=None, help="directory on the disk to test (default: the temp dir)")
    p.add_argument("--size", default="256M", help="file size of the AsyncIO measurement (K/M/G suffixes)")
    p.add_argument("--steps", type=int, default=10, help="steps of each headline run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-headline", action="store_true")
    args = p.parse_args()
    size = int(float(args.size[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[args.size[-1].upper()]) \
        if args.size[-1].isalpha() else int(args.size)
    path = tempfile.mkdtemp(dir=args.path)
    try:
        rates = crc_rates(args.reps)
        hw = "SSE4.2" if crc32c_hardware() else "none (scalar used)"
        print(f"CRC32C, one core: hardware ({hw}) {rates['hardware']:.2f} GB/s, scalar {rates['scalar']:.2f} GB/s; "
              f"per 4 KiB block as the I/O threads sum them, 3 interleaved: {rates['blocks']:.2f} GB/s")
        io = io_times(path, size, args.reps)
        print(f"AsyncIO write+read of {size >> 20} MiB: checksums on {io[True]:.3f} s, off {io[False]:.3f} s, "
              f"on/off = {io[True] / io[False]:.3f}")
        if not args.skip_headline:
            times = headline(args.steps, args.reps, path)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            print(f"headline (default run, {args.steps} steps, median of {args.reps}): checksums on {on:.4f} s/step, "
                  f"off {off:.4f} s/step, on/off = {on / off:.3f}")
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
