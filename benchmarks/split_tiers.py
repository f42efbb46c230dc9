"""The optimizer states split over host memory and NVMe (Note [split tiers] in infinity/_offload/_split.py).

A wide, shallow GPT-2 (``--layers`` x ``--hidden``, 4 x 1536 by default: about 190M parameters,
whose optimizer traffic dominates the step) in fp32, one rank, parameters in host memory, the
optimizer states' tier the contender: ``all-cpu``, ``split-50`` (cpu 0.5, nvme 0.5), ``split-25``
(cpu 0.25, nvme 0.75) and ``all-nvme``, each in a process of its own, rounds rotated, the host
cache and the gradients' tier left to their defaults. ``extra``: the optimizer's NVMe MiB read and
written per step (medians, from the engine's telemetry), and the run model's prediction of the step
(``predicted_s``, Note [run model] in infinity/_apps/_runmodel.py, from rates measured on this machine
in the same child) with its error against the measured median (``model_error``). After the table,
each split's ``saved``: the share of what all-NVMe costs over all-cpu it saves, 1 - (split - cpu) /
(nvme - cpu). Ratios: each against all-nvme.

``--big``: a model whose states are about 1.5x this machine's host memory, ``auto`` (both sections
``device: auto``, Note [planned split] in infinity/_offload/_split.py) against ``all-nvme``, built
under ``infinity.Init`` with the contender's config (``auto``'s shards wait on NVMe until
``initialize`` plans them), so that the whole model is never in host memory: the room ``auto``
plans with is the machine's, not what a built model leaves of it.

``--host-allocator cache`` keeps every freed host block (``zero.host_allocator``, in ``extra``): under
``release``, the default, backward refaults the blocks over its cap and its time varies by 2-3x
from step to step on a 2-core machine, which can hide what a split saves.

    python -m benchmarks.split_tiers [--steps 3] [--layers 4] [--hidden 1536] [--only all-cpu,split-50] [--big] [--smoke]
"""
from __future__ import annotations

import statistics
import sys

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "split_tiers"
SPLITS = {"all-cpu": None, "split-50": 0.5, "split-25": 0.25, "all-nvme": 0.0, "auto": "auto"}
SMALL = ("all-cpu", "split-50", "split-25", "all-nvme")
BIG = ("auto", "all-nvme")
COUNTERS = ("nvme_optimizer_read_bytes", "nvme_optimizer_write_bytes")
MIB = tuple(k.replace("_bytes", "_mib") for k in COUNTERS)
PAIRS = tuple((name, "all-nvme") for name in SPLITS if name != "all-nvme")


def split_config(contender: str, scratch: str, chunk: int, big: bool = False) -> dict:
    from ._trainers import infinity_config

    host = SPLITS[contender]
    if host == "auto":
        cfg = infinity_config("nvme", "fp32", scratch, zero={"offload_optimizer": {"chunk_size": chunk}})
        cfg["zero"]["offload_optimizer"]["device"] = cfg["zero"]["offload_param"]["device"] = "auto"
        return cfg
    params = "nvme" if big else "cpu"
    cfg = infinity_config(params, "fp32", scratch, optimizer_tier="cpu" if host is None else "nvme",
                          zero={"offload_optimizer": {"chunk_size": chunk}})
    if host:
        cfg["zero"]["offload_optimizer"]["split"] = {"cpu": host, "nvme": 1 - host}
    return cfg


def measure(spec: dict) -> dict:
    import torch

    import infinity

    torch.manual_seed(0)
    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    cfg = split_config(spec["contender"], spec["scratch"], spec["chunk"], spec["big"])
    cfg["zero"]["host_allocator"] = spec.get("host_allocator", "release")
    if spec["big"]:  # built under Init with the run's own config: the shards wait on NVMe (auto's too), so the
        with infinity.Init(config=cfg):  # whole fp32 model is never in the host memory auto plans with
            model = _models.build(shape)
    else:
        model = _models.build(shape)
    model, opt = infinity.initialize(model, cfg)
    placement = opt.store, opt.param_store
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
    run = _run_of(spec, shape, params, *placement, units=len(opt.ops.units))
    opt.engine.close()
    extra = {m: round(statistics.median(r[k] for r in rows) / 2**20, 1) for k, m in zip(COUNTERS, MIB)}
    extra["host_allocator"] = cfg["zero"]["host_allocator"]
    extra.update(_model_step(run, spec["scratch"], statistics.median(times), spec["smoke"]))
    return _harness.sample(times, losses=losses[spec["warmup"]:], params=params,
                           tokens_per_step=spec["micro_batch"] * spec["seq_len"], dtype="fp32", extra=extra)


def _run_of(spec: dict, shape, params: int, store, param_store, units: int = 0):
    """The run model's description of this contender's run, its tiers and host shares as built."""
    from infinity.testing import Run

    def tier(s) -> str:
        return {"DEVICE": "none", "CPU": "cpu", "NVME": "nvme"}[s.tier.name] if s is not None else "cpu"

    return Run(params=params, layers=shape.layers, hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab,
               micro_batch=spec["micro_batch"], seq_len=spec["seq_len"], param_tier=tier(param_store),
               optimizer_tier=tier(store), opt_host_fraction=store.memory_elems / store.total if tier(store) == "nvme"
               else 0.0, param_host_fraction=param_store.host_upto / max(param_store.total, 1)
               if param_store is not None else 0.0, units=units)


def _model_step(run, scratch: str, measured: float, smoke: bool) -> dict:
    """The run model's step for ``run`` with this machine's rates, measured now, and its error."""
    from infinity.testing import Rates, step_time

    rates = Rates.measure(scratch, run, probe_bytes=_harness.disk_probe_bytes(smoke))
    predicted = step_time(run, rates)["predicted"]
    return {"predicted_s": round(predicted, 3), "model_error": round(predicted / measured - 1, 3)}


def saved(records: list) -> dict:
    """Per split, the share of all-NVMe's extra cost over all-cpu that it saves."""
    step = {r["contender"]: r.get("step_s") for r in records if r.get("status") == "ok"}
    cpu, nvme = step.get("all-cpu"), step.get("all-nvme")
    if cpu is None or nvme is None or nvme <= cpu:
        return {}
    return {name: round(1 - (step[name] - cpu) / (nvme - cpu), 3) for name in ("split-50", "split-25") if name in step}


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=3, warmup=1, seq_len=32, micro_batch=1, timeout=1800.0, only=",".join(SMALL))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--chunk", type=int, default=1 << 22, help="zero.offload_optimizer.chunk_size")
    p.add_argument("--big", action="store_true", help="auto against all-nvme, states about 1.5x host memory")
    p.add_argument("--host-allocator", default="release", choices=("release", "cache", "keep"),
                   help="zero.host_allocator of every contender (release, the default, refaults blocks over its cap)")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.steps, args.seq_len, args.chunk = 1, 64, 1, 16, 4096
    elif args.big:
        args.layers, args.hidden = _big_shape()
    unknown = [n for n in _flags.parse_list(args.only) if n not in SMALL]
    if unknown:
        p.error(f"--only: unknown contender(s) {', '.join(unknown)}; choose from {', '.join(SMALL)}")
    names = BIG if args.big else _flags.parse_list(args.only)
    cells = [Cell(name, f"{args.layers}x{args.hidden}") for name in names]
    records = _harness.run_cells(BENCH, "benchmarks.split_tiers", cells, lambda cell, scratch: {
        "contender": cell.contender, "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
        "warmup": args.warmup, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "chunk": args.chunk,
        "host_allocator": args.host_allocator,
        "scratch": scratch, "big": args.big, "smoke": args.smoke}, args, dtype="fp32")
    for name, share in saved(records).items():
        print(f"{name} saves {share:.0%} of what all-nvme costs over all-cpu (target: at least 40% for split-50)")
    pairs = (("auto", "all-nvme"),) if args.big else PAIRS
    return _harness.finish(BENCH, records, args, pairs, extra=MIB + ("predicted_s", "model_error"), ratio_extra=MIB)


def _big_shape() -> tuple:
    """(layers, hidden) of a 24-layer GPT-2 whose fp32 states (20 bytes per parameter: the
    parameters, master weights, both moments and the gradients) are about 1.5x the host memory
    available now (MemAvailable)."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    target = 1.5 * available / 20
    hidden = min(range(1024, 8193, 128), key=lambda h: abs(_models.Shape.of(24, h).params - target))
    return 24, hidden


if __name__ == "__main__":
    sys.exit(main())
