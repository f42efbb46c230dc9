"""The native CPU Adam against torch's AdamW, measured side by side in one process.

For each size (``--sizes``, default 64M and 256M parameters) and thread count (``--threads``,
default 2), one cell whose process holds every contender on the same buffers (torch's optimizer
state is pointed at our moment tensors, so no memory is duplicated) and runs them in turns,
step after step (Note [contenders side by side] in _harness.py), so background load hits all
of them alike:

  ours-fp32           infinity.optim.adam_step, fp32
  torch-fused-fp32    torch.optim.AdamW(fused=True)
  torch-foreach-fp32  torch.optim.AdamW(foreach=True)
  ours-mixed          fp32 master + bf16 gradients + bf16 params_out in one pass
  torch-mixed         the torch sequence doing the same work: cast the gradient to fp32, fused AdamW,
                      cast the parameters to bf16
  copy, add_          torch's copy (counting the write-allocate read of its destination) and in-place
                      add: the memory bandwidth here, the faster of the two

A step is one optimizer step; each record's ``extra`` holds its elements per second and, for
ours, the share of the memory-bandwidth bound (28 bytes a parameter over the bandwidth) it
reaches. Ratios: ours against each torch contender (a step quotient below 1: ours faster).

    python -m benchmarks.cpu_adam [--sizes 64M,256M] [--threads 2] [--steps 5]
    python -m benchmarks.cpu_adam --sizes 64M --threads 1,2,4,8,16   # the rate against thread count
    python -m benchmarks.cpu_adam --smoke

Where ours stops growing with threads while the bandwidth does not, the step is bound by
arithmetic; where both stop, by memory.
"""
from __future__ import annotations

import sys

from . import _flags, _harness
from ._harness import Cell

BENCH = "cpu_adam"
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
CONTENDERS = ("ours-fp32", "torch-fused-fp32", "torch-foreach-fp32", "ours-mixed", "torch-mixed", "copy", "add_")
PAIRS = (("ours-fp32", "torch-fused-fp32"), ("ours-fp32", "torch-foreach-fp32"), ("ours-mixed", "torch-mixed"))
BYTES_PER_PARAM = 28  # fp32 step: read p, g, m, v, write p, m, v; mixed: a bf16 gradient in, a bf16 copy out


def torch_adamw(param, exp_avg, exp_avg_sq, **kind):
    """A torch AdamW whose state is our moment tensors, so no memory is duplicated."""
    import torch

    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return opt


def contenders(n: int, threads: int) -> dict:
    """name -> one step of that contender on ``n`` parameters."""
    import torch

    from infinity.optim import adam_step

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen).requires_grad_()
    grad = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    grad_bf16, out_bf16, scratch = grad.bfloat16(), torch.empty(n, dtype=torch.bfloat16), torch.empty(n)
    param.grad = grad
    p = param.detach()
    fused = torch_adamw(param, exp_avg, exp_avg_sq, fused=True)
    foreach = torch_adamw(param, exp_avg, exp_avg_sq, foreach=True)
    steps = iter(range(1, 10**9))
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, num_threads=threads)

    def torch_mixed():
        grad.copy_(grad_bf16)
        fused.step()
        out_bf16.copy_(p)

    return {"ours-fp32": lambda: adam_step(p, grad, exp_avg, exp_avg_sq, step=next(steps), **hyper),
            "torch-fused-fp32": fused.step, "torch-foreach-fp32": foreach.step,
            "ours-mixed": lambda: adam_step(p, grad_bf16, exp_avg, exp_avg_sq, step=next(steps),
                                            params_out=out_bf16, **hyper),
            "torch-mixed": torch_mixed, "copy": lambda: scratch.copy_(grad), "add_": lambda: scratch.add_(grad)}


def measure(spec: dict) -> dict:
    import statistics

    import torch

    from infinity.optim import simd_path

    torch.set_num_threads(spec["threads"])
    n = spec["params"]
    steps = contenders(n, spec["threads"])
    for _ in range(max(1, spec["warmup"])):  # page faults, torch's lazy state, thread pools
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    for _ in range(spec["steps"]):
        for name, fn in steps.items():
            times[name].append(_harness.timed(fn))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    bandwidth = 12 * n / min(median["copy"], median["add_"])  # copy: 3 x 4 bytes; add_: read two, write one
    bound = BYTES_PER_PARAM * n / bandwidth
    out = {}
    for name, ts in times.items():
        extra = {"gelems_per_s": round(n / median[name] / 1e9, 3), "simd_path": simd_path(), "threads": spec["threads"],
                 "bandwidth_gbps": round(bandwidth / 1e9, 2)}
        if name.startswith("ours"):
            extra["of_bandwidth_bound"] = round(bound / median[name], 3)
        out[name] = _harness.sample(ts, params=n, dtype="mixed" if name.endswith("mixed") else "fp32", extra=extra)
    return _harness.side_by_side(out)


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=5, warmup=1, timeout=1800.0)
    p.add_argument("--sizes", default="64M,256M", help="parameter counts, comma-separated (K/M/G suffixes)")
    p.add_argument("--threads", default="2", help="a thread count, or a comma-separated list of them")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.sizes, args.threads, args.steps = "1M", "1", 3
    if args.steps < 3:
        p.error("--steps must be >= 3 (the figures are medians)")
    counts = [int(x) for x in _flags.parse_list(args.threads)]
    if any(c < 1 for c in counts):
        p.error("--threads: positive thread counts")
    sizes = [(size, _flags.parse_size(size)) for size in _flags.parse_list(args.sizes)]
    cells = [Cell("adam", f"{size}-t{t}", side_by_side=CONTENDERS) for t in counts for size, _ in sizes]
    n_of = {f"{size}-t{t}": (n, t) for t in counts for size, n in sizes}
    records = _harness.run_cells(BENCH, "benchmarks.cpu_adam", cells, lambda cell, scratch: {
        "params": n_of[cell.size][0], "threads": n_of[cell.size][1], "steps": args.steps, "warmup": args.warmup},
        args, dtype="fp32")
    return _harness.finish(BENCH, records, args, PAIRS,
                           extra=("gelems_per_s", "of_bandwidth_bound", "bandwidth_gbps", "simd_path"))


if __name__ == "__main__":
    sys.exit(main())
