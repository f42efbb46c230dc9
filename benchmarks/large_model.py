"""The large-model regime (issue 23 item 5): a GPT-style model whose states are several times
RAM, everything on NVMe, against the disk's own bandwidth over the same working set, in one run.

The child builds the model under infinity.Init (stage 3, parameters and optimizer states on
NVMe), trains ``--warmup`` steps, then ``--steps`` timed steps (contender ``infinity-nvme``; a
step is the time from one step's start to the next's, so the overlapped update of the previous
step is inside it), and counts the NVMe bytes each store moved per step. Then, with the engine
idle but its swap files still in place, it measures the disk over exactly those files (the real
working set) through infinity.aio, O_DIRECT, in the swapper's chunks, chunk-interleaved across
the files as the step touches them (``_disk.working_set_bandwidth``): a read pass, a write pass
and a pass that reads and writes at once as the swapper streams them. For each timed step, the
disk's time for that step's bytes is a contender of its own:

  disk-serial   read bytes / read bandwidth + written bytes / write bandwidth (one device)
  disk-at-once  (read + written bytes) / the at-once bandwidth

so the ratios infinity-nvme / disk-serial (the target: at most 1.5x) and / disk-at-once are
printed. ``extra`` holds the bytes per store, where the main thread waited, the process's CPU
use, the bytes per tier and the model states against RAM, and a 256 MiB probe (what the
preflight measures) for contrast. ``--compare-swap-io N``: then N pairs of updates timed alone
(``wait_step`` right after ``step``), the swapper's reads and writes overlapped and taking turns
on the same files (contenders ``update-overlap``, ``update-phased``; Note [phased swap I/O] in
infinity/_offload/_nvme_optimizer_store.py). ``--no-working-set``: train and count only (the
largest model this machine trains, its peak RSS against RAM).

    python -m benchmarks.large_model [--params 2e9 | --layers 24 --hidden 2560] [--nvme-path DIR]
    python -m benchmarks.large_model --params 3e9 --dtype bf16 --seq-len 64 --warmup 0 --no-working-set

Checks the free disk first and removes the swap files afterwards. fp32 by default (bf16 matmuls
crawl on CPUs without native bf16, which would make the step compute-bound; ``--dtype bf16``
halves the parameter files), 1 x 16 tokens: the regime is the optimizer's traffic, not the compute.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from . import _disk, _flags, _harness, _models
from ._harness import Cell

BENCH = "large_model"
GB = 1e9
# Disk per parameter: fp32 reads its parameters from the master (Note [parameters from the master] in _placement.py),
# so the master, both moments and the gradients, 16 bytes; bf16 adds its shards (2) and Init's fp32 chunks (4).
DISK_BYTES_PER_PARAM = {"fp32": 16, "bf16": 22}
PAIRS = (("infinity-nvme", "disk-serial"), ("infinity-nvme", "disk-at-once"), ("update-phased", "update-overlap"))


def nvme_bytes(tel: dict) -> dict:
    return {k: v for k, v in tel.items() if k.startswith("nvme_") and k.endswith("_bytes")}


def compare_swap_io(trainer, spec: dict) -> dict:
    """Updates timed alone, the swapper's I/O overlapped and phased in turns on the same files."""
    out = {"update-overlap": [], "update-phased": []}
    batches = _models.batches(spec["shape"], spec["micro_batch"], spec["seq_len"], 2 * spec["compare"], seed=2)
    for i, ids in enumerate(batches):
        phased = i % 2 == 1
        trainer.opt.engine.opt_store.pipeline.phased = phased
        trainer.model(input_ids=ids, labels=ids).loss.backward()
        trainer.telemetry()  # reset the byte counts: the update's own follow
        seconds = _harness.timed(lambda: (trainer.opt.step(), trainer.opt.wait_step()))
        moved = sum(nvme_bytes(trainer.telemetry()).values())
        trainer.opt.zero_grad()
        out["update-phased" if phased else "update-overlap"].append((seconds, moved))
    return {name: _harness.sample([s for s, _ in runs], extra={"gbps": round(statistics.median(
        b / s for s, b in runs) / GB, 3)}) for name, runs in out.items()}


def timed_windows(trainer, spec: dict) -> dict:
    """Window i, start(i) .. start(i + 1): step i's forward and backward, the wait for the previous
    step's overlapped update and the start of its own; the bytes are those moved in that window."""
    n = spec["warmup"] + spec["steps"]
    batches = _models.batches(spec["shape"], spec["micro_batch"], spec["seq_len"], n)
    starts, moved, cpu, stalls = [], [], [], []
    for i in range(n + 1):
        if i == n:
            trainer.finish()  # the last timed step's overlapped update ends here
        tel = trainer.telemetry()  # the NVMe bytes since the previous boundary, then reset
        starts.append(time.perf_counter())
        t = os.times()
        cpu.append(t.user + t.system)  # the process's CPU seconds, every thread: is the step CPU-bound?
        moved.append(nvme_bytes(tel))
        stalls.append({k: round(v, 2) for k, v in tel["stall_s"].items() if v >= 0.05})  # where the main thread waited
        if i < n:
            loss = trainer.step(batches[i])
            print(f"  step {i}: loss {float(loss):.4f}, {time.perf_counter() - starts[-1]:.1f} s, host peak "
                  f"{_flags.host_peak_bytes() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    timed = range(spec["warmup"], n)
    return {"times": [starts[i + 1] - starts[i] for i in timed], "moved": [moved[i + 1] for i in timed],
            "stalls": [stalls[i + 1] for i in timed],
            "cores_busy": [(cpu[i + 1] - cpu[i]) / (starts[i + 1] - starts[i]) for i in timed]}


def disk_contenders(run: dict, ws: dict) -> dict:
    read = [sum(v for k, v in m.items() if k.endswith("_read_bytes")) for m in run["moved"]]
    write = [sum(v for k, v in m.items() if k.endswith("_write_bytes")) for m in run["moved"]]
    serial = [r / ws["read"] + w / ws["write"] for r, w in zip(read, write)]
    at_once = [(r + w) / ws["mixed"] for r, w in zip(read, write)]
    figures = {"read_gbps": round(ws["read"] / GB, 3), "write_gbps": round(ws["write"] / GB, 3),
               "at_once_gbps": round(ws["mixed"] / GB, 3)}
    return {"disk-serial": _harness.sample(serial, extra=figures), "disk-at-once": _harness.sample(at_once, extra=figures)}


def measure(spec: dict) -> dict:
    import torch

    import infinity
    from infinity.config import AioConfig
    from infinity.testing import chunk_elems
    from infinity.train import probe_disk

    from ._trainers import InfinityTrainer, infinity_config

    torch.set_num_threads(spec["threads"])
    spec["shape"] = _models.Shape.of(spec["layers"], spec["hidden"])
    cfg = infinity_config("nvme", spec["dtype"], spec["scratch"], clip=None,
                          zero={"offload_optimizer": {"swap_io": spec["swap_io"]}})
    t0 = time.perf_counter()
    with infinity.Init(config=cfg):
        model = _models.build(spec["shape"])
    trainer = InfinityTrainer(model, cfg)
    engine = trainer.opt.engine
    states = engine.model_state_bytes()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    extra = {"setup_s": round(time.perf_counter() - t0, 1), "host_peak_since": "start",
             "tiers_gib": {t: _harness.gib(b) for t, b in engine.tier_bytes().items()},
             "model_states_gib": _harness.gib(sum(states.values())), "ram_gib": _harness.gib(ram),
             "model_states_over_ram": round(sum(states.values()) / ram, 2)}
    run = timed_windows(trainer, spec)
    extra.update(nvme_gb_per_step={k[5:-6]: round(statistics.median(m.get(k, 0) for m in run["moved"]) / GB, 2)
                                   for k in sorted({k for m in run["moved"] for k in m})},
                 stalls_s=run["stalls"], cores_busy=round(statistics.median(run["cores_busy"]), 2))
    out = {"infinity-nvme": _harness.sample(run["times"], params=sum(p.numel() for p in trainer.model.parameters()),
                                            tokens_per_step=spec["micro_batch"] * spec["seq_len"], dtype=spec["dtype"],
                                            host_peak=_flags.host_peak_bytes(), extra=extra)}
    if spec["compare"]:
        out.update(compare_swap_io(trainer, spec))
    if spec["working_set"]:
        aio, chunk = AioConfig(), chunk_elems(None, 1 << 62) * 4  # the swapper's default chunk, in bytes
        files = _disk.files_under(spec["scratch"])
        ws = _disk.working_set_bandwidth(files, chunk, 1, aio)  # 1 group ahead: the swapper reads 1 chunk ahead
        probe = probe_disk(spec["scratch"], aio, 256 << 20) or {}
        extra.update(working_set={"files": len(files), "gb": round(sum(n for _, n in files) / GB, 1),
                                  "chunk_mib": chunk >> 20},
                     probe_256mib_gbps={k: round(v / GB, 2) for k, v in probe.items()})
        out.update(disk_contenders(run, ws))
    trainer.close()
    return _harness.side_by_side(out)


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=2, warmup=1, seq_len=16, micro_batch=1, timeout=7200.0, budget=14400.0)
    p.add_argument("--params", type=float, default=2e9, help="about this many parameters (GPT-2's proportions)")
    p.add_argument("--layers", type=int, default=0, help="with --hidden: this shape instead")
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--dtype", default="fp32", choices=("bf16", "fp32"))
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--swap-io", default="overlap", choices=("overlap", "phased"),
                   help="zero.offload_optimizer.swap_io (Note [phased swap I/O] in _nvme_optimizer_store.py)")
    p.add_argument("--compare-swap-io", type=int, default=0, metavar="N",
                   help="after the timed steps, N pairs of updates timed alone, overlapped and phased in turns")
    p.add_argument("--no-working-set", action="store_true", help="train and count only; no disk measurement")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.steps, args.seq_len = 2, 128, 2, 8
    shape = _models.Shape.of(args.layers, args.hidden) if args.layers and args.hidden else _models.Shape.for_params(args.params)
    _disk.check_disk(args.nvme_path, shape.params * DISK_BYTES_PER_PARAM[args.dtype])
    contenders = ("infinity-nvme",) + ("update-overlap", "update-phased") * bool(args.compare_swap_io) + \
        ("disk-serial", "disk-at-once") * (not args.no_working_set)
    spec = {"layers": shape.layers, "hidden": shape.hidden, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
            "dtype": args.dtype, "warmup": args.warmup, "steps": args.steps, "swap_io": args.swap_io,
            "compare": args.compare_swap_io, "working_set": not args.no_working_set, "threads": args.threads}
    records = _harness.run_cells(BENCH, "benchmarks.large_model", [Cell("large", shape.name, side_by_side=contenders)],
                                 lambda cell, scratch: dict(spec, scratch=scratch), args, dtype=args.dtype)
    return _harness.finish(BENCH, records, args, PAIRS, extra=("cores_busy", "model_states_over_ram", "gbps"),
                           ratio_extra=("gbps",))


if __name__ == "__main__":
    sys.exit(main())
