"""Fetch units per block against one per module (Note [fetch unit grouping] in _unit_plan.py).

GPT-2 (default 12 x 768, vocab 50257: GPT-2 124M), stage 3, fp32, parameters on --offload
(cpu by default) with the optimizer states in host memory, at 1 and 2 gloo ranks. In each rank
count, both groupings are built in the same processes and run in interleaved rounds (one
warm-up step each, then --rounds rounds of --block steps, alternating which goes first), so
the ratio compares like with like on a machine that drifts. Prints, per grouping: fetch units,
all-gathers and reduce-scatters per step (counted by infinity's collectives), the median step
time, and the ratios. Also checks that both groupings give the same losses.

    python scripts/bench_fetch_units.py [--layers 12 --hidden 768 --seq-len 128 --micro-batch 2]
                                        [--ranks 1 2] [--rounds 3 --block 2] [--offload cpu|nvme]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

GROUPS = ("module", "block")


def _model(layers: int, hidden: int, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # the two groupings see the same math
    return GPT2LMHeadModel(cfg)


def _contender(group: str, args, nvme: str):
    import infinity

    z = {"stage": 3, "fetch_units": {"group": group},
         "offload_param": {"device": args.offload, "nvme_path": nvme},
         "offload_optimizer": {"device": "cpu"}}
    cfg = infinity.Config.from_dict({"zero": z, "precision": {"dtype": "fp32"}, "optimizer": {"lr": 1e-4},
                                     "gradient_clipping": 1.0})
    model, opt = infinity.initialize(_model(args.layers, args.hidden, 0), cfg)
    return model, opt


def _steps(model, opt, batch, n: int):
    """``n`` steps; (seconds per step, all-gathers and reduce-scatters per step, losses)."""
    from infinity.testing import collective_calls

    before = collective_calls()
    losses = []
    t = time.perf_counter()
    for _ in range(n):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.wait_step()
    dt = (time.perf_counter() - t) / n
    after = collective_calls()
    per = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in ("all_gather", "reduce_scatter")}
    return dt, per, losses


def run(args) -> dict:
    """On one rank of the job: both groupings, interleaved."""
    import torch

    torch.manual_seed(1)
    batch = torch.randint(0, 50257, (args.micro_batch, args.seq_len))
    nvme = tempfile.mkdtemp(prefix="fetch-units-", dir=args.nvme_path)
    built = {g: _contender(g, args, nvme) for g in GROUPS}
    out = {g: {"units": len(built[g][1].engine.units), "times": [], "losses": []} for g in GROUPS}
    for g in GROUPS:
        _, _, losses = _steps(*built[g], batch, 1)  # warm-up: records the trace
        out[g]["losses"] += losses
    for r in range(args.rounds):
        for g in (GROUPS if r % 2 == 0 else GROUPS[::-1]):
            dt, per, losses = _steps(*built[g], batch, args.block)
            out[g]["times"].append(dt)
            out[g]["per_step"] = per
            out[g]["losses"] += losses
    for g in GROUPS:
        built[g][1].engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="cpu")
    p.add_argument("--nvme-path", default=None)
    args = p.parse_args()

    from infinity.testing import run_ranks

    print(f"GPT-2 {args.layers} x {args.hidden}, {args.micro_batch} x {args.seq_len} tokens, stage 3, fp32, "
          f"parameters on {args.offload}, optimizer states on cpu")
    for n in args.ranks:
        results = run_ranks(run, n, args, timeout=3600)
        res = results[0]
        print(f"\n{n} rank(s):")
        print(f"  {'grouping':8} {'units':>6} {'all-gathers/step':>17} {'reduce-scatters/step':>21} {'step s':>8}")
        med = {}
        for g in GROUPS:
            med[g] = statistics.median(res[g]["times"])
            per = res[g]["per_step"]
            print(f"  {g:8} {res[g]['units']:6d} {per['all_gather']:17.0f} {per['reduce_scatter']:21.0f} {med[g]:8.3f}")
        ratios = [a / b for a, b in zip(res["module"]["times"], res["block"]["times"])]
        fewer = res["module"]["per_step"]["all_gather"] / max(1, res["block"]["per_step"]["all_gather"])
        print(f"  block vs module: {fewer:.1f}x "
              f"fewer all-gathers, step time module/block {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds)")
        same = res["module"]["losses"] == res["block"]["losses"]
        print(f"  losses identical: {same}" + ("" if same else f" (module {res['module']['losses'][:3]}, "
                                                                 f"block {res['block']['losses'][:3]})"))


if __name__ == "__main__":
    main()
