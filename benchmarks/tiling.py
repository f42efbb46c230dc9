"""Memory-centric tiling (paper 002 Fig. 6b), fp32: untiled against tiling factors 4 and 16.

One GPT-style block (``_blocks.GPTBlock``) trained with ZeRO stage 3, parameters on NVMe (so
every gather is charged to the device budget), optimizer states in host memory, under
``device_memory_limit``. Contenders ``factor-1``, ``factor-4``, ``factor-16``
(``zero.tiling.max_tile_params`` = the MLP weight / factor), side by side in one process per
cell (Note [contenders side by side] in _harness.py):

- ``largest`` (size ``limit-<--limit>``): the largest hidden size (a multiple of
  ``--hidden-step``) that trains. A size trains when initialize accepts it (Note [operator
  working memory] in infinity/_zero/_tiling.py) and two real steps run within the budget; the
  largest accepted size of each is trained (those two steps are its step times).
  ``extra.largest_hidden``, ``extra.device_peak_mib`` (gathered parameters), and
  ``extra.formula_hidden``: the same question answered by the working-memory formula alone at
  ``--paper-limit`` (256 MB, the device of the figure; training those sizes would need tens of
  GB of host memory).
- ``timing`` (size ``h<hidden>-<--timing-tier>``): at a hidden size where all three fit (the
  largest untiled, or ``--hidden``), the median of ``--steps`` steps taken in turns, and the
  device peak the engine charged, which follows the tile size.

    python -m benchmarks.tiling [--limit 16MB] [--hidden-step 128] [--steps 5] [--micro-batch 2 --seq-len 64]
    python -m benchmarks.tiling --only timing --hidden 1024 --timing-tier none
"""
from __future__ import annotations

import os
import sys

from . import _flags, _harness
from ._harness import Cell

BENCH = "tiling"
FACTORS = (1, 4, 16)
CONTENDERS = tuple(f"factor-{f}" for f in FACTORS)
PAIRS = tuple((f"factor-{f}", "factor-1") for f in FACTORS[1:])


def tiled_engine(h: int, factor: int, spec: dict, tier: str = "nvme"):
    import torch

    import infinity

    from ._blocks import GPTBlock, mlp_params
    from ._trainers import infinity_config

    zero = {"prefetch": {"persistence_threshold": 0}}
    if factor > 1:
        zero["tiling"] = {"enabled": True, "min_params": 0, "max_tile_params": -(-mlp_params(h) // factor)}
    cfg = infinity_config(tier, "fp32", spec["scratch"], optimizer_tier="cpu", clip=0.0, zero=zero,
                          device_memory_limit=spec["limit"])
    torch.manual_seed(0)
    return infinity.initialize(GPTBlock(h), cfg)


def block_step(model, opt, h: int, spec: dict) -> float:
    import torch

    x = torch.randn(spec["micro_batch"], spec["seq_len"], h, generator=torch.Generator().manual_seed(1))

    def one():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return _harness.timed(one)


def accepted(h: int, factor: int, spec: dict) -> bool:
    import infinity
    from infinity.errors import OutOfMemory

    try:
        model, _ = tiled_engine(h, factor, spec)
    except OutOfMemory:  # the device budget refused it
        return False
    infinity.close(model)
    return True


def largest(factor: int, spec: dict) -> int:
    """The largest multiple of the hidden step initialize accepts (doubling, then bisecting)."""
    step_h = spec["hidden_step"]
    lo, hi = 0, step_h
    while accepted(hi, factor, spec):
        lo, hi = hi, hi * 2
    while hi - lo > step_h:
        mid = (lo + hi) // 2 // step_h * step_h
        lo, hi = (mid, hi) if accepted(mid, factor, spec) else (lo, mid)
    return lo


def formula_hidden(factor: int, limit: int) -> int:
    """The largest h (steps of 256) whose working memory fits ``limit`` (gather_depth 1, fp32)."""
    from infinity.tiling import working_memory_bytes

    from ._blocks import mlp_params

    h = 256
    while working_memory_bytes(-(-mlp_params(h + 256) // factor), 4, 1) <= limit:
        h += 256
    return h


def measure_largest(spec: dict) -> dict:
    import infinity

    out = {}
    for factor in FACTORS:
        h = largest(factor, spec)
        model, opt = tiled_engine(h, factor, spec)
        times = [block_step(model, opt, h, spec) for _ in range(2)]
        peak = opt.engine.device_budget.stats().peak
        infinity.close(model)
        out[f"factor-{factor}"] = _harness.sample(times, dtype="fp32", extra={
            "largest_hidden": h, "device_peak_mib": round(peak / 2**20, 2),
            "formula_hidden": formula_hidden(factor, spec["paper_limit"])})
    return _harness.side_by_side(out)


def measure_timing(spec: dict) -> dict:
    import infinity

    h = spec["hidden"]
    runs = {f: tiled_engine(h, f, spec, spec["timing_tier"]) for f in FACTORS}
    times, peaks = {f: [] for f in FACTORS}, {f: 0 for f in FACTORS}
    for f in FACTORS:
        block_step(*runs[f], h, spec)  # warm-up
    for _ in range(spec["steps"]):
        for f in FACTORS:
            budget = runs[f][1].engine.device_budget
            budget.reset_peak()
            times[f].append(block_step(*runs[f], h, spec))
            peaks[f] = max(peaks[f], budget.stats().peak)
    out = {}
    for f in FACTORS:
        tile = max(u.full_numel for u in runs[f][1].engine.units)
        out[f"factor-{f}"] = _harness.sample(times[f], dtype="fp32", extra={
            "hidden": h, "largest_unit_params": tile, "device_peak_mib": round(peaks[f] / 2**20, 3)})
        infinity.close(runs[f][0])
    return _harness.side_by_side(out)


def measure(spec: dict) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: spinning OpenMP threads distort a shared machine's timings
    import torch

    import infinity

    torch.set_num_threads(spec["threads"])
    infinity.logger.setLevel("WARNING")
    return measure_largest(spec) if spec["part"] == "largest" else measure_timing(spec)


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=5, warmup=1, seq_len=64, micro_batch=2, only="largest,timing", timeout=3600.0)
    p.add_argument("--limit", default="16MB", help="device_memory_limit of the measured runs")
    p.add_argument("--paper-limit", default="256MB", help="device_memory_limit of the formula alone")
    p.add_argument("--hidden-step", type=int, default=128, help="the hidden sizes tried are multiples of this")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared machine: 1)")
    p.add_argument("--timing-tier", default="nvme", choices=("nvme", "cpu", "none"),
                   help="parameter tier of the timing cell (the device peak is charged on nvme only)")
    p.add_argument("--hidden", type=int, help="hidden size of the timing cell; default: the largest untiled")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.limit, args.hidden_step, args.steps, args.micro_batch, args.seq_len = "2MB", 64, 2, 1, 8
    from infinity.testing import parse_bytes

    parts = _flags.parse_list(args.only)
    if not set(parts) <= {"largest", "timing"}:
        p.error("--only: the cells are largest and timing")
    base = {"limit": parse_bytes(args.limit), "paper_limit": parse_bytes(args.paper_limit), "threads": args.threads,
            "hidden_step": args.hidden_step, "steps": args.steps, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "timing_tier": args.timing_tier}
    records = []
    if "largest" in parts:
        largest = Cell("largest", f"limit-{args.limit}", side_by_side=CONTENDERS)
        records += _harness.run_cells(BENCH, "benchmarks.tiling", [largest], lambda cell, scratch: dict(
            base, part="largest", scratch=scratch), args, dtype="fp32")
    if "timing" in parts:
        untiled = [r["extra"].get("largest_hidden") for r in records if r["contender"] == "factor-1" and r["status"] == "ok"]
        h = args.hidden or (untiled[0] if untiled else 512)
        records += _harness.run_cells(BENCH, "benchmarks.tiling", [Cell("timing", f"h{h}-{args.timing_tier}",
                                                                  side_by_side=CONTENDERS)],
                                      lambda cell, scratch: dict(base, part="timing", hidden=h, scratch=scratch), args,
                                      dtype="fp32")
    return _harness.finish(BENCH, records, args, PAIRS, extra=("largest_hidden", "device_peak_mib", "formula_hidden"),
                           ratio_extra=("largest_hidden", "device_peak_mib"))


if __name__ == "__main__":
    sys.exit(main())
