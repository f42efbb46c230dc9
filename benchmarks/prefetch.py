"""The trace-based prefetcher, and the NVMe headline against plain PyTorch.

Both parts compute in bf16 where the CPU multiplies bf16 natively; on a CPU without native bf16
(torch's reference bf16 matmul is tens of times slower than fp32 there) ``--dtype auto``
measures every contender in fp32 and says so. Every contender trains ``_models.gpt2`` of its
shape in a process of its own, rounds rotated (Note [contender rounds] in _harness.py): after
``--warmup`` steps (the first records the trace), ``--steps`` timed steps, the last joining
infinity's overlapped update. ``extra``: the forward and backward's seconds, the stalls by stage
and the NVMe bytes per step, the prefetch hit rate and the trace's divergences.

- ``machine-overlap`` (first): the disk's O_DIRECT bandwidth under ``--nvme-path``
  (``infinity.train.probe_disk``) and how far this machine runs disk I/O beside computation
  (``extra.overlap``: matmuls beside an O_DIRECT write and read, 1 = side by side, 0 = as if one
  after the other); the bounds printed last are computed from it.
- the study (``study`` in ``--only``): stage 3 at ``--layers`` x ``--hidden``, ``--micro-batch`` x
  ``--seq-len`` tokens (GPT-2 124M, 1 x 16: the parameter I/O of a step about as long as its
  computation): ``compute-only`` (no offload); ``params-nvme-prefetch-off``/``-on`` (the optimizer
  states in host memory); ``all-nvme-prefetch-off``/``-on``. Ratios: prefetch on / off (the
  target: 1 / 1.5 where the I/O is about the compute); printed: each step against its bound,
  max(compute-only step, read bytes / read bandwidth + written bytes / write bandwidth), and
  against the step the machine allows at its measured overlap.
- the headline (``headline`` in ``--only``): GPT-2 124M, 4 x 256 tokens, one rank, ``plain``
  (bf16: a bf16 model, fp32 master weights, fused AdamW, clipping; fp32: AdamW on the
  parameters, clipping) against ``infinity-nvme`` (parameters and optimizer states on NVMe,
  prefetch on). Ratio: infinity-nvme / plain (the target: at most 1.15x).

    python -m benchmarks.prefetch --smoke
    python -m benchmarks.prefetch [--rounds 4 --steps 2] [--micro-batch 1 --seq-len 16] [--nvme-path DIR]
    python -m benchmarks.prefetch --only headline
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "prefetch"
MiB = 2**20
STAGES = ("nvme_read", "host_to_device", "all_gather", "reduce_scatter", "grad_offload", "optimizer_io")
STUDY = {"compute-only": ("none", "none", True), "params-nvme-prefetch-off": ("nvme", "cpu", False),
         "params-nvme-prefetch-on": ("nvme", "cpu", True), "all-nvme-prefetch-off": ("nvme", "nvme", False),
         "all-nvme-prefetch-on": ("nvme", "nvme", True)}  # name -> (parameters, optimizer states, prefetch)
HEADLINE = ("plain", "infinity-nvme")
PAIRS = (("params-nvme-prefetch-on", "params-nvme-prefetch-off"), ("all-nvme-prefetch-on", "all-nvme-prefetch-off"),
         ("infinity-nvme", "plain"))


def choose_dtype(requested: str) -> str:
    """``auto``: bf16 where this CPU multiplies bf16 matrices at least half as fast as fp32;
    otherwise fp32, said out loud (no avx512_bf16 / AMX: torch's reference bf16 matmul is tens
    of times slower, which would make every contender minutes per step and hide every overhead)."""
    if requested != "auto":
        return requested
    import torch

    def seconds(dtype) -> float:
        a, b = torch.randn(256, 768, dtype=dtype), torch.randn(768, 768, dtype=dtype)
        torch.mm(a, b)
        return _harness.timed(lambda: [torch.mm(a, b) for _ in range(3)])

    slowdown = seconds(torch.bfloat16) / seconds(torch.float32)
    if slowdown <= 2.0:
        return "bf16"
    print(f"note: bf16 matmul is {slowdown:.0f}x slower than fp32 on this CPU (no native bf16); measuring in fp32 "
          f"(--dtype bf16 forces it)", file=sys.stderr)
    return "fp32"


def machine_overlap(directory: str, nbytes: int, threads: int, repeats: int = 3) -> dict:
    """How far this machine runs computation and disk I/O at the same time: a matmul loop on
    ``threads`` threads and an O_DIRECT write then read of ``nbytes`` through infinity.aio on
    a background thread, timed alone and together (medians of ``repeats``). ``overlap`` =
    (sum of the two alone - together) / the shorter alone: 1 when they run fully side by
    side, 0 when together takes as long as one after the other. The loop is sized to take
    about as long as the I/O. A virtual machine whose host charges the guest's CPUs for its
    disk I/O (CPU steal time) slows the loop while the I/O runs; no prefetcher can then hide
    more than this fraction of the I/O behind computation."""
    import threading

    import torch

    from infinity.aio import AsyncIO, aligned_empty

    torch.set_num_threads(threads)
    path = os.path.join(directory, "overlap_probe.bin")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(3)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    with AsyncIO() as aio:
        def io() -> None:
            aio.pwrite(buf, path, 0)
            aio.wait()
            aio.pread(buf, path, 0)
            aio.wait()

        io()  # the file exists, the handle is warm
        iters = max(1, round(_harness.timed(io) / (_harness.timed(lambda: [torch.mm(a, b) for _ in range(8)]) / 8)))

        def matmuls() -> None:
            for _ in range(iters):
                torch.mm(a, b)

        def together() -> None:
            t = threading.Thread(target=io)
            t.start()
            matmuls()
            t.join()

        runs = [(_harness.timed(matmuls), _harness.timed(io), _harness.timed(together)) for _ in range(repeats)]
    compute, disk, both = (statistics.median(r[i] for r in runs) for i in range(3))
    overlap = (compute + disk - both) / min(compute, disk)
    return {"compute_s": compute, "io_s": disk, "together_s": both, "overlap": max(0.0, min(1.0, overlap)),
            "times": [r[2] for r in runs]}


def achievable(compute: float, io: float, overlap: float) -> float:
    """The step time if the I/O ran beside the computation as far as this machine allows."""
    return max(compute, io) + (1.0 - overlap) * min(compute, io)


def probe(spec: dict) -> dict:
    from infinity.config import AioConfig
    from infinity.train import probe_disk

    disk = probe_disk(spec["scratch"], AioConfig(), spec["probe_bytes"]) or {}
    ov = machine_overlap(spec["scratch"], spec["overlap_bytes"], spec["threads"])
    return _harness.sample(ov.pop("times"), extra={**{k: round(v, 4) for k, v in ov.items()},
                                                   "read_gbps": round(disk.get("read", 0) / 1e9, 3),
                                                   "write_gbps": round(disk.get("write", 0) / 1e9, 3)})


def trainer_of(spec: dict, model):
    import torch

    from ._trainers import InfinityTrainer, PlainTrainer, infinity_config

    if spec["contender"] == "plain":
        return PlainTrainer(model, torch.device("cpu"), spec["dtype"])
    param, optim, prefetch = STUDY.get(spec["contender"], ("nvme", "nvme", True))
    cfg = infinity_config(param, spec["dtype"], spec["scratch"], optimizer_tier=optim,
                          zero={"offload_optimizer": {"gradients": spec["gradients"]}, "prefetch": {"enabled": prefetch}})
    return InfinityTrainer(model, cfg)


def measure(spec: dict) -> dict:
    import torch

    from ._trainers import InfinityTrainer, timed_parts

    if spec["contender"] == "machine-overlap":
        return probe(spec)
    torch.set_num_threads(spec["threads"])
    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    model = _models.gpt2(shape)
    params = _models.param_count(model)
    trainer = trainer_of(spec, model)
    del model
    tel = trainer.telemetry if isinstance(trainer, InfinityTrainer) else dict
    batches = _models.batches(shape, spec["micro_batch"], spec["seq_len"], spec["warmup"] + spec["steps"])
    times, fwd_bwd = [], []
    for i, ids in enumerate(batches):
        if i == spec["warmup"]:
            trainer.finish()  # the warm-ups' overlapped update is not a timed step's
            tel()  # counters start at the first timed step
        start = time.perf_counter()
        fb, _ = timed_parts(trainer, ids)
        if i == len(batches) - 1:
            trainer.finish()  # the last step's overlapped update belongs to it
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
            fwd_bwd.append(fb)
    t, n = tel(), len(times)
    moved = {k: v for k, v in t.items() if k.startswith("nvme_") and k.endswith("_bytes")}
    extra = {"fwd_bwd_s": round(statistics.median(fwd_bwd), 4)}
    if t:
        extra.update(stall_s={s: round(t["stall_s"].get(s, 0.0) / n, 4) for s in STAGES},
                     mib_per_step={k: round(v / n / MiB, 1) for k, v in t["bytes"].items()},
                     nvme_read_mib=round(sum(v for k, v in moved.items() if k.endswith("_read_bytes")) / n / MiB, 1),
                     nvme_written_mib=round(sum(v for k, v in moved.items() if k.endswith("_write_bytes")) / n / MiB, 1),
                     hit_rate=t["prefetch_hit_rate"], divergences=t["trace_divergences"])
    trainer.close()
    return _harness.sample(times, params=params, tokens_per_step=spec["micro_batch"] * spec["seq_len"],
                           dtype=spec["dtype"], extra=extra)


def bounds(records: list) -> None:
    """Each NVMe contender's step against its bound and against what the machine allows."""
    by = {r["contender"]: r for r in records if r["status"] == "ok"}
    machine = by.get("machine-overlap")
    if machine is None or not machine["extra"].get("read_gbps"):
        return
    x = machine["extra"]
    read, write, overlap = x["read_gbps"] * 1e9, x["write_gbps"] * 1e9, x["overlap"]
    for name, compute_name in [(k, "compute-only") for k in STUDY if k != "compute-only"] + [("infinity-nvme", "plain")]:
        if name in by and compute_name in by:
            r, compute = by[name], by[compute_name]["step_s"]
            io = (r["extra"]["nvme_read_mib"] / read + r["extra"]["nvme_written_mib"] / write) * MiB
            allowed = achievable(compute, io, overlap)
            print(f"{name}: step {r['step_s']:.3f} s, its I/O {io:.3f} s (bytes / the disk's bandwidth); "
                  f"x{r['step_s'] / max(compute, io):.2f} its bound max({compute_name} step, I/O); "
                  f"x{r['step_s'] / allowed:.2f} the {allowed:.3f} s this machine allows at its overlap {overlap:.2f}")


def cells_of(args) -> list:
    only = [name for entry in _flags.parse_list(args.only) for name in
            {"study": tuple(STUDY), "headline": HEADLINE}.get(entry, (entry,))]
    unknown = sorted(set(only) - set(STUDY) - set(HEADLINE))
    if unknown:
        raise SystemExit(f"--only: unknown contender(s) {unknown}; choose from study, headline, "
                         f"{', '.join(STUDY)}, {', '.join(HEADLINE)}")
    study = f"{args.layers}x{args.hidden}-{args.micro_batch}x{args.seq_len}"
    headline = "2x256-2x64" if args.smoke else "124m-4x256"
    return [Cell("machine-overlap", "probe")] + [Cell(n, study if n in STUDY else headline) for n in dict.fromkeys(only)]


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=2, warmup=2, seq_len=16, micro_batch=1, only="study,headline", rounds=4,
                      timeout=3600.0, budget=4 * 3600.0)
    p.add_argument("--layers", type=int, default=12, help="the study's model depth")
    p.add_argument("--hidden", type=int, default=768, help="the study's model width (a multiple of 64)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in each contender")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute dtype of every contender; auto = bf16 unless this CPU lacks native bf16 matmul")
    p.add_argument("--gradients", choices=("auto", "cpu", "nvme"), default="auto",
                   help="zero.offload_optimizer.gradients of the NVMe optimizer tier (auto: host memory when they fit)")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.rounds, args.steps, args.warmup = 2, 256, 1, 1, 1
    if args.hidden % 64:
        p.error("--hidden must be a multiple of 64 (heads of 64)")
    print(_flags.load_note() + " (before the run; the machine may be shared)", file=sys.stderr)
    dtype = choose_dtype(args.dtype)
    headline = {"layers": 2, "hidden": 256, "micro_batch": 2, "seq_len": 64} if args.smoke else \
        {"layers": 12, "hidden": 768, "micro_batch": 4, "seq_len": 256}
    study = {"layers": args.layers, "hidden": args.hidden, "micro_batch": args.micro_batch, "seq_len": args.seq_len}
    base = {"dtype": dtype, "threads": args.threads, "gradients": args.gradients, "steps": args.steps,
            "warmup": args.warmup, "probe_bytes": (64 if args.smoke else 256) * MiB,
            "overlap_bytes": (128 if args.smoke else 1024) * MiB}
    records = _harness.run_cells(BENCH, "benchmarks.prefetch", cells_of(args), lambda cell, scratch: dict(
        base, **(study if cell.contender in STUDY else headline), contender=cell.contender, scratch=scratch),
        args, dtype=dtype)
    status = _harness.finish(BENCH, records, args, PAIRS, extra=("fwd_bwd_s", "nvme_read_mib", "nvme_written_mib",
                                                                 "hit_rate", "overlap"))
    bounds(records)
    print(_flags.load_note() + " (after the run)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
