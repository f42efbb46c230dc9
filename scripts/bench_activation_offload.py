"""Activation checkpoint offload on this machine (paper 002 Fig. 6e), fp32 (no fast bf16 here).

A stack of GPT-style blocks, each checkpointed with torch.utils.checkpoint (non-reentrant),
trained with ZeRO stage 3, with ``activation_checkpointing.offload`` none and cpu, over a few
hidden sizes. For each: the device bytes of activation checkpoints at their peak (offload off:
every tensor autograd keeps across the forward->backward gap, alive from the end of forward
until backward reaches it, measured with a counting saved-tensor hook; offload on: those the
offloader holds on the device, the one in use plus its prefetch window, from its counters),
and the median step time of both, measured in interleaved rounds in this run.

The device tier is CPU memory on this machine, so the offloaded copies also live in RAM and
the "device" figures are the bytes held in the device role; on CUDA those are device memory.

    python scripts/bench_activation_offload.py [--hidden 256 512 1024] [--layers 8] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared 2-core machine: spinning OpenMP threads distort timings

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import infinity  # noqa: E402
from infinity.testing import is_parameter_like  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tiling import GPTBlock  # noqa: E402


class Stack(nn.Module):
    def __init__(self, h: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(h) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.pow(2).mean()


class SavedBytes:
    """Bytes autograd keeps across the forward->backward gap outside the checkpointed regions
    (the same tensors the offloader would take), each storage counted once."""

    def __init__(self):
        self.seen, self.nbytes = set(), 0

    def pack(self, t):
        if not is_parameter_like(t):
            key = t.untyped_storage().data_ptr()
            if key not in self.seen:
                self.seen.add(key)
                self.nbytes += t.untyped_storage().nbytes()
        return t


def run(h: int, layers: int, tokens: tuple, offload: str):
    torch.manual_seed(0)
    cfg = {"zero": {"stage": 3}, "precision": {"dtype": "fp32"}, "gradient_clipping": 0.0,
           "optimizer": {"lr": 1e-4}, "activation_checkpointing": {"offload": offload}}
    return infinity.initialize(Stack(h, layers), cfg)


def step(model, opt, h: int, tokens: tuple, counter=None) -> float:
    x = torch.randn(*tokens, h, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    if counter is not None:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = model(x)
    else:
        loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    infinity.logger.setLevel("WARNING")
    tokens = (args.batch, args.seq)
    print(f"{args.layers} checkpointed GPT blocks, batch {args.batch} x seq {args.seq}, fp32, stage 3, "
          f"{args.threads} thread(s)")
    print(f"{'hidden':>6} | {'ckpt bytes off':>14} | {'ckpt bytes on':>13} | {'ratio':>6} | {'step off':>9} | "
          f"{'step on':>9} | {'time on/off':>11}")
    for h in args.hidden:
        off, on = run(h, args.layers, tokens, "none"), run(h, args.layers, tokens, "cpu")
        counter = SavedBytes()
        step(*off, h, tokens, counter)  # warm-up of both; the counter sees one forward
        step(*on, h, tokens)
        offloader = on[1].engine.activation_offload
        offloader.reset_peak()
        times = {"off": [], "on": []}
        for _ in range(args.rounds):
            times["off"].append(step(*off, h, tokens))
            times["on"].append(step(*on, h, tokens))
        t_off, t_on = statistics.median(times["off"]), statistics.median(times["on"])
        peak_on = offloader.stats()["peak_device_bytes"]
        print(f"{h:>6} | {counter.nbytes / 2**20:>10.2f} MiB | {peak_on / 2**20:>9.2f} MiB | "
              f"{counter.nbytes / max(1, peak_on):>5.1f}x | {t_off * 1e3:>6.0f} ms | {t_on * 1e3:>6.0f} ms | "
              f"{t_on / t_off:>10.2f}x")
        for model, _ in (off, on):
            infinity.close(model)


if __name__ == "__main__":
    main()
