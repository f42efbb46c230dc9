"""Fetch units per block against one per module (Note [fetch unit grouping] in _unit_plan.py).

GPT-2 (``_models.gpt2``, default 12 x 768: GPT-2 124M), stage 3, fp32, parameters on
``--offload`` (cpu by default) with the optimizer states in host memory, at each rank count of
``--ranks`` (gloo ranks from ``infinity.testing.run_ranks``, one cell each). In a cell, both
groupings (contenders ``module`` and ``block``) are built in the same rank processes and take
``--steps`` timed steps in turns after one warm-up step each, the order alternating (Note
[contenders side by side] in _harness.py), so the ratio compares like with like on a machine
that drifts. ``extra``: fetch units, all-gathers and reduce-scatters per step (counted by
infinity's collectives), and whether both groupings gave the same losses (``same_losses``).

    python -m benchmarks.fetch_units [--layers 12 --hidden 768 --seq-len 128 --micro-batch 2]
                                     [--ranks 1,2] [--steps 6] [--offload cpu|nvme]
"""
from __future__ import annotations

import sys

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "fetch_units"
GROUPS = ("module", "block")


def one_step(model, opt, batch) -> tuple:
    """(seconds, all-gathers and reduce-scatters, loss) of one step, its overlapped update joined."""
    import time

    from infinity.testing import collective_calls

    before, t = collective_calls(), time.perf_counter()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    opt.wait_step()
    seconds, after = time.perf_counter() - t, collective_calls()
    return seconds, {k: after.get(k, 0) - before.get(k, 0) for k in ("all_gather", "reduce_scatter")}, loss.item()


def rank(spec: dict) -> dict:
    """On one rank of the job: both groupings, in turns."""
    import infinity

    from ._trainers import infinity_config

    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    batch = _models.batches(shape, spec["micro_batch"], spec["seq_len"], 1)[0]
    built = {}
    for g in GROUPS:
        cfg = infinity_config(spec["offload"], "fp32", spec["scratch"], optimizer_tier="cpu",
                              zero={"fetch_units": {"group": g}})
        built[g] = infinity.initialize(_models.gpt2(shape), cfg)
    out = {g: {"units": len(built[g][1].engine.units), "times": [], "losses": [], "calls": []} for g in GROUPS}
    for g in GROUPS:
        out[g]["losses"].append(one_step(*built[g], batch)[2])  # warm-up: records the trace
    for i in range(spec["steps"]):
        for g in (GROUPS if i % 2 == 0 else GROUPS[::-1]):
            seconds, calls, loss = one_step(*built[g], batch)
            out[g]["times"].append(seconds)
            out[g]["calls"].append(calls)
            out[g]["losses"].append(loss)
    for g in GROUPS:
        built[g][1].engine.close()
    return out


def measure(spec: dict) -> dict:
    import statistics

    from infinity.testing import run_ranks

    res = run_ranks(rank, spec["ranks"], spec, timeout=spec["timeout"])[0]
    same = res["module"]["losses"] == res["block"]["losses"]
    out = {}
    for g in GROUPS:
        r = res[g]
        per = {k: statistics.median(c[k] for c in r["calls"]) for k in ("all_gather", "reduce_scatter")}
        out[g] = _harness.sample(r["times"], losses=r["losses"], dtype="fp32", extra={
            "units": r["units"], "all_gathers_per_step": per["all_gather"],
            "reduce_scatters_per_step": per["reduce_scatter"], "same_losses": same, "ranks": spec["ranks"]})
    return _harness.side_by_side(out)


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=6, warmup=1, seq_len=128, micro_batch=2, timeout=3600.0)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (a cell each)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="cpu", help="the parameters' tier")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.steps, args.seq_len, args.micro_batch, args.ranks = 2, 64, 2, 16, 1, "1"
    cells = [Cell("grouping", f"{n}rank", side_by_side=GROUPS) for n in map(int, _flags.parse_list(args.ranks))]
    records = _harness.run_cells(BENCH, "benchmarks.fetch_units", cells, lambda cell, scratch: {
        "ranks": int(cell.size[:-4]), "layers": args.layers, "hidden": args.hidden, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "steps": args.steps, "offload": args.offload, "scratch": scratch,
        "timeout": args.timeout}, args, dtype="fp32")
    return _harness.finish(BENCH, records, args, (("module", "block"),),
                           extra=("units", "all_gathers_per_step", "reduce_scatters_per_step", "same_losses"),
                           ratio_extra=("all_gathers_per_step",))


if __name__ == "__main__":
    sys.exit(main())
