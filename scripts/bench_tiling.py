"""Memory-centric tiling on this machine (paper 002 Fig. 6b), fp32 (this CPU has no fast bf16).

A one-layer GPT-style block (LayerNorm, attention projections h->3h and h->h, LayerNorm, MLP
h->4h->h) trained with ZeRO stage 3, parameters on NVMe (so every gather is charged to the
device budget), optimizer states in host memory, under ``device_memory_limit``:

(a) the largest hidden size (a multiple of --step) that trains without tiling and with tiling
    factors 4 and 16 (zero.tiling.max_tile_params = the MLP weight / factor). A size "trains"
    when initialize accepts it (Note [operator working memory] in infinity/_zero/_tiling.py) and two
    real steps run without exceeding the budget; the largest accepted size of each is trained.
(b) the same question answered by the working-memory formula alone at --paper-limit (256 MB,
    the device of the figure; training those sizes would need tens of GB of host memory here).
(c) at a hidden size where all three fit: median step time (interleaved rounds) and the device
    peak the engine charged (gathered parameters), which follows the tile size.

    python scripts/bench_tiling.py [--limit 16MB] [--step 128] [--rounds 5] [--batch 2 --seq 64] [--nvme-path DIR]
    python scripts/bench_tiling.py --only-timing --hidden 1024 --timing-tier none   # (c) alone
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared 2-core machine: spinning OpenMP threads distort timings

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import infinity  # noqa: E402
from infinity.errors import OutOfMemory  # noqa: E402
from infinity.testing import parse_bytes  # noqa: E402
from infinity.tiling import tile_params_to_fit, working_memory_bytes  # noqa: E402

FACTORS = (1, 4, 16)
TOKENS = [2, 16]  # (batch, seq) of a step; --batch / --seq


class GPTBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.heads = max(1, h // 64)
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def mlp_params(h: int) -> int:
    return 4 * h * h + 4 * h  # the largest operator: h -> 4h with its bias


def config(h: int, factor: int, limit: int, nvme: str, tier: str = "nvme") -> dict:
    zero = {"stage": 3, "offload_param": {"device": tier, "nvme_path": nvme},
            "offload_optimizer": {"device": "cpu"}, "prefetch": {"persistence_threshold": 0}}
    if factor > 1:
        zero["tiling"] = {"enabled": True, "min_params": 0, "max_tile_params": -(-mlp_params(h) // factor)}
    return {"zero": zero, "precision": {"dtype": "fp32"}, "gradient_clipping": 0.0, "device_memory_limit": limit,
            "optimizer": {"lr": 1e-4}}


def build(h: int, factor: int, limit: int, nvme: str, tier: str = "nvme"):
    torch.manual_seed(0)
    return infinity.initialize(GPTBlock(h), config(h, factor, limit, nvme, tier))


def step(model, opt, h: int) -> float:
    x = torch.randn(*TOKENS, h, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def accepted(h: int, factor: int, limit: int, nvme: str) -> bool:
    try:
        model, _ = build(h, factor, limit, nvme)
    except OutOfMemory:  # the device budget refused it
        return False
    infinity.close(model)
    return True


def largest(factor: int, limit: int, step_h: int, nvme: str) -> int:
    """The largest multiple of ``step_h`` initialize accepts (doubling, then bisecting)."""
    lo, hi = 0, step_h
    while accepted(hi, factor, limit, nvme):
        lo, hi = hi, hi * 2
    while hi - lo > step_h:
        mid = (lo + hi) // 2 // step_h * step_h
        lo, hi = (mid, hi) if accepted(mid, factor, limit, nvme) else (lo, mid)
    return lo


def trains(h: int, factor: int, limit: int, nvme: str) -> tuple:
    model, opt = build(h, factor, limit, nvme)
    budget = opt.engine.device_budget
    for _ in range(2):
        step(model, opt, h)
    peak = budget.stats().peak
    infinity.close(model)
    return True, peak


def paper_table(limit: int) -> list:
    """(b): the largest h whose working memory fits ``limit`` (gather_depth 1, fp32)."""
    rows = []
    for factor in FACTORS:
        h = 256
        while working_memory_bytes(-(-mlp_params(h + 256) // factor), 4, 1) <= limit:
            h += 256
        rows.append((factor, h))
    return rows


def sections_a_b(args, limit: int, paper: int, nvme: str) -> dict:
    print(f"(a) device_memory_limit {limit / 1e6:.0f} MB, fp32, stage 3, parameters on NVMe, "
          f"batch {args.batch} x seq {args.seq}, {args.threads} thread(s)")
    found = {}
    for factor in FACTORS:
        h = largest(factor, limit, args.step, nvme)
        _, peak = trains(h, factor, limit, nvme)
        found[factor] = h
        print(f"  tiling factor {factor:>2}: largest hidden {h:>5} (MLP weight {4 * h * h / 1e6:.1f}M params), "
              f"trained 2 steps, device peak {peak / 2**20:.1f} MiB")
    for factor in FACTORS[1:]:
        print(f"  hidden x{found[factor] / found[1]:.2f} with factor {factor} vs untiled")
    print(f"(b) formula only at {paper / 1e6:.0f} MB (not trained here):")
    for factor, h in paper_table(paper):
        print(f"  tiling factor {factor:>2}: largest hidden {h}")
    print(f"    max_tile_params that fits {paper / 1e6:.0f} MB: {tile_params_to_fit(paper, 4, 1)}")
    return found


def section_c(args, h: int, limit: int, nvme: str) -> None:
    print(f"(c) hidden {h} (fits all three), parameters on {args.timing_tier}, median of {args.rounds} steps "
          f"after a warm-up, interleaved:")
    runs = {f: build(h, f, limit, nvme, args.timing_tier) for f in FACTORS}
    times = {f: [] for f in FACTORS}
    peaks = {}
    for f in FACTORS:
        step(*runs[f], h)
    for _ in range(args.rounds):
        for f in FACTORS:
            budget = runs[f][1].engine.device_budget
            budget.reset_peak()
            times[f].append(step(*runs[f], h))
            peaks[f] = max(peaks.get(f, 0), budget.stats().peak)
    base = statistics.median(times[1])
    for f in FACTORS:
        med = statistics.median(times[f])
        tile = max(u.full_numel for u in runs[f][1].engine.units)
        print(f"  factor {f:>2}: step {med * 1e3:8.1f} ms (x{med / base:.2f} of untiled), largest unit {tile} "
              f"params, device peak {peaks[f] / 2**20:.2f} MiB")
    for f in FACTORS:
        infinity.close(runs[f][0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", default="16MB", help="device_memory_limit for the measured runs")
    p.add_argument("--paper-limit", default="256MB", help="device_memory_limit of the formula-only table")
    p.add_argument("--step", type=int, default=128, help="hidden sizes tried are multiples of this")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per contender in (c)")
    p.add_argument("--nvme-path", default=None, help="directory for the parameter swap files")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timing-tier", default="nvme", choices=("nvme", "cpu", "none"),
                   help="parameter tier of the step-time runs in (c) (the device peak is charged on nvme only)")
    p.add_argument("--only-timing", action="store_true", help="skip (a) and (b); time (c) at --hidden")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of (c); default: the largest untiled")
    args = p.parse_args()
    TOKENS[:] = [args.batch, args.seq]
    limit, paper = parse_bytes(args.limit), parse_bytes(args.paper_limit)
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="bench_tiling_")
    torch.set_num_threads(args.threads)
    infinity.logger.setLevel("WARNING")
    try:
        found = {} if args.only_timing else sections_a_b(args, limit, paper, nvme)
        section_c(args, args.hidden or found.get(1) or 512, limit, nvme)
    finally:
        if args.nvme_path is None:
            shutil.rmtree(nvme, ignore_errors=True)


if __name__ == "__main__":
    main()
