"""The optimizer states split over host memory and NVMe (Note [split tiers] in infinity/_offload/_split.py).

A wide, shallow GPT-2 (``--layers`` x ``--hidden``, 4 x 1536 by default: about 190M parameters,
whose optimizer traffic dominates the step) in fp32, one rank, parameters in host memory, the
optimizer states' tier the contender: ``all-cpu``, ``split-50`` (cpu 0.5, nvme 0.5), ``split-25``
(cpu 0.25, nvme 0.75) and ``all-nvme``, each in a process of its own, rounds rotated; every NVMe
contender with no host cache and the gradient shards in a swap file, so that its disk traffic is
the split's alone. ``extra``: the optimizer's NVMe MiB read and written per step (medians, from
the engine's telemetry) and ``saved``, the share of what all-NVMe costs over all-cpu a split saves,
1 - (split - cpu) / (nvme - cpu), computed by the ratio lines. Ratios: each against all-nvme.

    python -m benchmarks.split_tiers [--steps 3] [--layers 4] [--hidden 1536] [--smoke]
"""
from __future__ import annotations

import statistics
import sys

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "split_tiers"
SPLITS = {"all-cpu": None, "split-50": 0.5, "split-25": 0.25, "all-nvme": 0.0}
COUNTERS = ("nvme_optimizer_read_bytes", "nvme_optimizer_write_bytes")
MIB = tuple(k.replace("_bytes", "_mib") for k in COUNTERS)
PAIRS = tuple((name, "all-nvme") for name in SPLITS if name != "all-nvme")


def config(contender: str, scratch: str, chunk: int) -> dict:
    from ._trainers import infinity_config

    host = SPLITS[contender]
    cfg = infinity_config("cpu", "fp32", scratch, optimizer_tier="cpu" if host is None else "nvme",
                          zero={"offload_optimizer": {"chunk_size": chunk}})
    if host is not None:
        cfg["zero"]["offload_optimizer"].update(host_cache=0, gradients="nvme")
        if host:
            cfg["zero"]["offload_optimizer"]["split"] = {"cpu": host, "nvme": 1 - host}
    return cfg


def measure(spec: dict) -> dict:
    import torch

    import infinity

    torch.manual_seed(0)
    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    model, opt = infinity.initialize(_models.build(shape), config(spec["contender"], spec["scratch"], spec["chunk"]))
    ids = _models.batches(shape, spec["micro_batch"], spec["seq_len"], 1)[0]
    times, rows, losses = [], [], []
    for step in range(spec["warmup"] + spec["steps"]):
        before = opt.engine.telemetry()

        def one():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            opt.wait_step()
            losses.append(loss.item())

        seconds = _harness.timed(one)
        after = opt.engine.telemetry()
        if step >= spec["warmup"]:
            times.append(seconds)
            rows.append({k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS})
    params = sum(p.numel() for p in model.parameters())
    opt.engine.close()
    extra = {m: round(statistics.median(r[k] for r in rows) / 2**20, 1) for k, m in zip(COUNTERS, MIB)}
    return _harness.sample(times, losses=losses[spec["warmup"]:], params=params,
                           tokens_per_step=spec["micro_batch"] * spec["seq_len"], dtype="fp32", extra=extra)


def saved(records: list) -> dict:
    """Per split, the share of all-NVMe's extra cost over all-cpu that it saves."""
    step = {r["contender"]: r.get("step_s") for r in records if r.get("status") == "ok"}
    cpu, nvme = step.get("all-cpu"), step.get("all-nvme")
    if cpu is None or nvme is None or nvme <= cpu:
        return {}
    return {name: round(1 - (step[name] - cpu) / (nvme - cpu), 3) for name in ("split-50", "split-25") if name in step}


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=3, warmup=1, seq_len=32, micro_batch=1, timeout=1800.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--chunk", type=int, default=1 << 22, help="zero.offload_optimizer.chunk_size")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.steps, args.seq_len, args.chunk = 1, 64, 1, 16, 4096
    cells = [Cell(name, f"{args.layers}x{args.hidden}") for name in SPLITS]
    records = _harness.run_cells(BENCH, "benchmarks.split_tiers", cells, lambda cell, scratch: {
        "contender": cell.contender, "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
        "warmup": args.warmup, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "chunk": args.chunk,
        "scratch": scratch}, args, dtype="fp32")
    for name, share in saved(records).items():
        print(f"{name} saves {share:.0%} of what all-nvme costs over all-cpu (target: at least 40% for split-50)")
    return _harness.finish(BENCH, records, args, PAIRS, extra=MIB, ratio_extra=MIB)


if __name__ == "__main__":
    sys.exit(main())
