"""What the swap-file checksums cost (Note [swap checksums] in infinity/aio/_checksum.py): ours
with checksums against ours without.

Side by side in one process per part, in turns, medians of ``--steps`` (Note [contenders side
by side] in _harness.py):

- ``crc32c``: CRC32C throughput of one core over 64 MiB: the SSE4.2 instruction (when the CPU
  has it; else the scalar loop stands in), the portable scalar loop, and per-4 KiB-block sums
  as the I/O threads compute them. Contenders ``hardware``, ``scalar``, ``blocks``.
- ``aio``: writing then reading a ``--file-size`` file through a checksummed path (sums
  recorded on every write, checked on every read) and through a plain one. Contenders
  ``aio-checksums-on``, ``aio-checksums-off``.
- ``train``: the train job's default run (``bash scripts/run.sh``: tiny GPT-2, every state on
  NVMe) for ``--train-steps`` steps with ``aio.checksums`` true and false; a step is one run's
  "total" step time. Contenders ``train-checksums-on``, ``train-checksums-off``.

    python -m benchmarks.checksums [--nvme-path DIR] [--file-size 256M] [--train-steps 10] [--steps 3]
                                   [--only crc32c,aio,train]
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

from . import _flags, _harness
from ._harness import ROOT, Cell

BENCH = "checksums"
PARTS = {"crc32c": ("hardware", "scalar", "blocks"), "aio": ("aio-checksums-on", "aio-checksums-off"),
         "train": ("train-checksums-on", "train-checksums-off")}
PAIRS = (("hardware", "scalar"), ("aio-checksums-on", "aio-checksums-off"), ("train-checksums-on", "train-checksums-off"))
CRC_BYTES = 64 << 20


def crc_times(steps: int) -> dict:
    import torch

    from infinity.testing import native_aio

    ffi, lib = native_aio.ffi, native_aio.lib
    buf = torch.randint(0, 256, (CRC_BYTES,), dtype=torch.uint8)
    ptr = ffi.cast("void *", buf.data_ptr())
    sums = ffi.new("uint32_t[]", CRC_BYTES // 4096)
    runs = {"hardware": lambda: lib.infinity_aio_crc32c(0, ptr, CRC_BYTES, 0),
            "scalar": lambda: lib.infinity_aio_crc32c(0, ptr, CRC_BYTES, 1),
            "blocks": lambda: lib.infinity_aio_crc32c_blocks(ptr, CRC_BYTES // 4096, sums)}
    times = {name: [] for name in runs}
    for _ in range(steps):
        for name, fn in runs.items():
            times[name].append(_harness.timed(fn))
    return times


def io_times(path: str, size: int, steps: int) -> dict:
    from infinity.aio import AsyncIO, aligned_empty
    from infinity.testing import checksummed

    buf = aligned_empty(size)
    buf.random_(0, 256)
    times = {"aio-checksums-on": [], "aio-checksums-off": []}
    with AsyncIO() as h:
        for _ in range(steps):
            for name in times:
                target = checksummed(os.path.join(path, f"{name}.swp"), size, name.endswith("-on"))
                times[name].append(_harness.timed(lambda: (h.pwrite(buf, target, 0), h.wait(),
                                                           h.pread(buf, target, 0), h.wait())))
    return times


def train_times(steps: int, train_steps: int, scratch: str) -> dict:
    from infinity.train import default_config

    times = {"train-checksums-on": [], "train-checksums-off": []}
    for _ in range(steps):
        for name in times:
            cfg = default_config()
            cfg["train"]["output_dir"] = os.path.join(scratch, f"run-{name}")
            cfg["zero"]["offload_param"]["nvme_path"] = cfg["zero"]["offload_optimizer"]["nvme_path"] = scratch
            cfg["aio"] = {"checksums": name.endswith("-on")}
            path = os.path.join(scratch, "config.json")
            with open(path, "w") as f:
                json.dump(cfg, f)
            cmd = [sys.executable, "-m", "infinity.train", "--config", path, "--no-save", "--steps", str(train_steps)]
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
            m = re.search(r"^\s*total\s+([0-9.]+)\s+100%", r.stdout, re.M)
            if r.returncode != 0 or m is None:
                raise SystemExit(f"the train job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            times[name].append(float(m.group(1)))
    return times


def measure(spec: dict) -> dict:
    from infinity.testing import crc32c_hardware

    part, steps = spec["part"], spec["steps"]
    if part == "crc32c":
        hw = "SSE4.2" if crc32c_hardware() else "none (the scalar loop)"
        return _harness.side_by_side({name: _harness.sample(ts, extra={"bytes": CRC_BYTES, "hardware": hw, "gbps": round(
            CRC_BYTES / statistics.median(ts) / 1e9, 2)}) for name, ts in crc_times(steps).items()})
    if part == "aio":
        times = io_times(spec["scratch"], spec["file_size"], steps)
        return _harness.side_by_side({k: _harness.sample(v, extra={"bytes": spec["file_size"]}) for k, v in times.items()})
    times = train_times(steps, spec["train_steps"], spec["scratch"])
    return _harness.side_by_side({k: _harness.sample(v, extra={"train_steps": spec["train_steps"]})
                                  for k, v in times.items()})


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=3, warmup=0, only=",".join(PARTS), timeout=3600.0)
    p.add_argument("--file-size", default="256M", help="bytes of the AsyncIO part's file (K/M/G suffixes)")
    p.add_argument("--train-steps", type=int, default=10, help="steps of each train-job run")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.file_size, args.train_steps, args.steps = "16M", 2, 1
    parts = _flags.parse_list(args.only)
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        p.error(f"--only: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    size = _flags.parse_size(args.file_size)
    cells = [Cell(part, {"crc32c": "64M", "aio": args.file_size, "train": "tiny"}[part], side_by_side=PARTS[part])
             for part in parts]
    records = _harness.run_cells(BENCH, "benchmarks.checksums", cells, lambda cell, scratch: {
        "part": cell.contender, "steps": args.steps, "file_size": size, "train_steps": args.train_steps,
        "scratch": scratch}, args)
    return _harness.finish(BENCH, records, args, PAIRS, extra=("gbps",))


if __name__ == "__main__":
    sys.exit(main())
