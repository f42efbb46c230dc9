"""Benchmark of the native CPU Adam against torch, measured in the same run.

For each size (default 64M and 256M parameters) and thread count (default 2):
  fp32:  infinity adam_step vs torch.optim.AdamW(fused=True) and (foreach=True)
  mixed: fp32 master + bf16 grads + bf16 params_out in one pass, vs the torch sequence
         doing the same work (cast grad to fp32, fused AdamW, cast params to bf16)
  bound: bytes the step must touch / memory bandwidth measured here with torch
         (a copy, counting the write-allocate read of its destination, and an in-place
         add; the faster of the two), and our fraction of it.

Contenders run interleaved, round after round, on the same buffers (torch's optimizer
state is pointed at our moment tensors), so background load hits all of them alike.
Each figure is the median of --reps rounds ([min-max] beside it shows the noise).

    python scripts/bench_cpu_adam.py [--sizes 64M,256M] [--threads 2] [--reps 5]
    python scripts/bench_cpu_adam.py --sizes 64M --threads 1,2,4,8,16   # the rate against thread count

With several thread counts a last table gives, per count, the mixed step's rate (elements per
second) for ours and torch's, and the memory bandwidth measured at that count: where ours
stops growing with threads, the step is bound by memory, not by arithmetic.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

import torch

from benchmarks._flags import parse_size
from infinity.optim import adam_step, simd_path

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_adamw(param: torch.Tensor, exp_avg, exp_avg_sq, **kind) -> torch.optim.Optimizer:
    """A torch AdamW whose state is our moment tensors, so no memory is duplicated."""
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return opt


def run_size(n: int, threads: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen).requires_grad_()
    grad = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    grad_bf16 = grad.bfloat16()
    out_bf16 = torch.empty(n, dtype=torch.bfloat16)
    scratch = torch.empty(n)
    param.grad = grad
    p = param.detach()
    fused = torch_adamw(param, exp_avg, exp_avg_sq, fused=True)
    foreach = torch_adamw(param, exp_avg, exp_avg_sq, foreach=True)
    steps = iter(range(1, 10**9))

    def ours_fp32():
        adam_step(p, grad, exp_avg, exp_avg_sq, step=next(steps), lr=LR, betas=BETAS, eps=EPS,
                  weight_decay=WD, num_threads=threads)

    def ours_mixed():
        adam_step(p, grad_bf16, exp_avg, exp_avg_sq, step=next(steps), lr=LR, betas=BETAS, eps=EPS,
                  weight_decay=WD, params_out=out_bf16, num_threads=threads)

    def torch_mixed():
        grad.copy_(grad_bf16)
        fused.step()
        out_bf16.copy_(p)

    contenders = {
        "ours fp32": ours_fp32,
        "torch fused fp32": fused.step,
        "torch foreach fp32": foreach.step,
        "ours mixed": ours_mixed,
        "torch mixed": torch_mixed,
        "copy": lambda: scratch.copy_(grad),
        "add_": lambda: scratch.add_(grad),
    }
    times = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up: page faults, torch's lazy state, thread pools
        fn()
    for _ in range(reps):
        for name, fn in contenders.items():
            times[name].append(timed(fn))
    return times


def report(n: int, times: dict, threads: int) -> dict:
    gb = 1e9
    t = {name: statistics.median(ts) for name, ts in times.items()}
    # Copy: read src + write dst + the write-allocate read of dst (ordinary stores).
    # add_: read two operands, write one in place (no write-allocate).
    bw_copy = 12 * n / t["copy"]
    bw_add = 12 * n / t["add_"]
    bw = max(bw_copy, bw_add)
    # fp32 step: read p, g, m, v; write p, m, v.  mixed: read p, g(bf16), m, v; write p, m, v, out(bf16)
    bytes_fp32, bytes_mixed = 28 * n, 28 * n
    bound_fp32, bound_mixed = bytes_fp32 / bw, bytes_mixed / bw
    print(f"\n== {n / 2**20:.0f}M parameters, {threads} threads, path {simd_path()} ==")
    print(f"memory bandwidth: copy {bw_copy / gb:.1f} GB/s, in-place add {bw_add / gb:.1f} GB/s -> {bw / gb:.1f} GB/s")
    rows = [  # (label, contender, the "ours" it is compared with)
        ("fp32  ours", "ours fp32", None),
        ("fp32  torch AdamW(fused=True)", "torch fused fp32", "ours fp32"),
        ("fp32  torch AdamW(foreach=True)", "torch foreach fp32", "ours fp32"),
        ("mixed ours (bf16 grad + bf16 params_out)", "ours mixed", None),
        ("mixed torch (cast grad, fused AdamW, cast params)", "torch mixed", "ours mixed"),
    ]
    for label, name, ours in rows:
        ratio = f"  speed-up of ours {t[name] / t[ours]:.2f}x" if ours else ""
        lo, hi = min(times[name]), max(times[name])
        print(f"  {label:52s} {t[name] * 1e3:8.1f} ms  [{lo * 1e3:.0f}-{hi * 1e3:.0f}]{ratio}")
    print(f"  bandwidth bound fp32 {bound_fp32 * 1e3:.1f} ms: ours at {bound_fp32 / t['ours fp32']:.0%} of it; "
          f"mixed {bound_mixed * 1e3:.1f} ms: ours at {bound_mixed / t['ours mixed']:.0%}")
    return {"threads": threads, "params": n, "ours_mixed_gelems": n / t["ours mixed"] / 1e9,
            "torch_mixed_gelems": n / t["torch mixed"] / 1e9, "bandwidth_gbps": bw / gb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,256M", help="comma-separated parameter counts (K/M/G suffixes)")
    ap.add_argument("--threads", default="2", help="thread count, or a comma-separated list of them")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.reps < 3:
        ap.error("--reps must be >= 3 (figures are medians)")
    counts = [int(x) for x in args.threads.split(",")]
    if any(c < 1 for c in counts):
        ap.error("--threads: positive thread counts")
    rows = []
    for threads in counts:
        torch.set_num_threads(threads)
        for size in args.sizes.split(","):
            n = parse_size(size)
            rows.append(report(n, run_size(n, threads, args.reps), threads))
    if len(counts) > 1:
        print("\nthreads | params | ours mixed (G elements/s) | torch mixed (G elements/s) | bandwidth (GB/s)")
        for r in rows:
            print(f"{r['threads']:7d} | {r['params'] / 2**20:5.0f}M | {r['ours_mixed_gelems']:25.2f} | "
                  f"{r['torch_mixed_gelems']:26.2f} | {r['bandwidth_gbps']:.1f}")


if __name__ == "__main__":
    main()
