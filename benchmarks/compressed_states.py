"""Accuracy and cost of compressed Adam moments on NVMe (``zero.offload_optimizer.moments``).

A GPT-2 (byte-level, vocab 256, built from a config: nothing downloads) is first pretrained
briefly with plain torch AdamW on this repository's English prose (README.md, docs/) and saved
with ``save_pretrained``; then it is fine-tuned from that checkpoint on different text, this
repository's Python source, with everything on NVMe (parameters, master weights, moments,
gradients; no host cache), fp32 compute, once per moments mode: contenders ``moments-fp32``,
``moments-bf16``, ``moments-int8``. The three runs live side by side in one process and take
their steps in turns (round robin), on the same batches, so their step times share the
machine's noise (Note [contenders side by side] in _harness.py).

Each record's losses are its fine-tuning curve; ``extra``: the curve's deviation from the fp32
run (max and mean of |loss - loss_fp32|, and the max over 20-step moving averages), the final
eval loss on held-out source and its relative difference from fp32's, the optimizer swap bytes
per step (moments and all), the time the step spent compressing and expanding the moments, and
``within_tolerance``: mean |dloss| <= 1% of the fp32 run's mean loss and the final eval loss
within 1% (relative) of fp32's. Ratios: each mode against fp32 (step time and bytes); the exit
status is 1 when a mode is outside the tolerance.

    python -m benchmarks.compressed_states [--steps 300] [--nvme-path DIR] [--smoke]
"""
from __future__ import annotations

import glob
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from . import _flags, _harness
from ._harness import ROOT, Cell

BENCH = "compressed_states"
MODES = ("fp32", "bf16", "int8")
TOLERANCE = 0.01  # relative: mean |dloss| / mean loss, and |eval - eval_fp32| / eval_fp32
PAIRS = (("moments-bf16", "moments-fp32"), ("moments-int8", "moments-fp32"))


def corpus(patterns):
    """The bytes of the repository's files matching ``patterns`` (sorted), as a uint8 tensor."""
    files = sorted({f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True)})
    data = b"\n".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def draw(data, batch: int, seq: int, g):
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def byte_gpt2(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def pretrain(args, out_dir: str) -> None:
    """Plain torch AdamW on the prose; saved with save_pretrained."""
    model = byte_gpt2(args)
    prose = corpus(["README.md", "docs/**/*.md", "native/**/*.md"])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for step in range(args.pretrain_steps):
        ids = draw(prose, args.micro_batch, args.seq_len, g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == args.pretrain_steps - 1:
            print(f"  pretrain step {step:4d} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out_dir)
    print(f"  pretrained {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {prose.numel()} bytes "
          f"of prose in {time.perf_counter() - t0:.0f} s; saved to {out_dir}")


def moments_config(mode: str, nvme: str, args) -> dict:
    from ._trainers import infinity_config

    return infinity_config("nvme", "fp32", nvme, clip=None, optimizer={"lr": args.lr, "weight_decay": 0.01},
                           zero={"offload_optimizer": {"gradients": "nvme", "host_cache": 0, "chunk_size": args.chunk,
                                                       "moments": mode}})


class CodecClock:
    """Seconds the store spent compressing and expanding moments (wraps its codec's calls)."""

    def __init__(self, store):
        self.seconds = 0.0
        codec = store.files.codec
        if codec is None:
            return
        for name in ("encode", "decode"):
            inner = getattr(codec, name)

            def timed(*a, _inner=inner, **k):
                t = time.perf_counter()
                _inner(*a, **k)
                self.seconds += time.perf_counter() - t

            setattr(codec, name, timed)


def evaluate(model, held, args) -> float:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        losses = [model(input_ids=ids, labels=ids).loss.item()
                  for ids in (draw(held, args.micro_batch, args.seq_len, g) for _ in range(args.eval_batches))]
    return sum(losses) / len(losses)


def finetune(args, pretrained: str, nvme_root: str) -> dict:
    from transformers import GPT2LMHeadModel

    import infinity

    code = corpus(["infinity/**/*.py"])
    cut = int(code.numel() * 0.9)
    train, held = code[:cut], code[cut:]
    runs = {}
    for mode in MODES:
        model = GPT2LMHeadModel.from_pretrained(pretrained)
        model.config.use_cache = False
        nvme = os.path.join(nvme_root, mode)
        os.makedirs(nvme, exist_ok=True)
        model, opt = infinity.initialize(model, moments_config(mode, nvme, args))
        runs[mode] = {"model": model, "opt": opt, "losses": [], "times": [], "clock": CodecClock(opt.store),
                      "codec": [], "io": None}
    g = torch.Generator().manual_seed(3)
    for step in range(args.steps):
        ids = draw(train, args.micro_batch, args.seq_len, g)
        order = MODES[step % 3:] + MODES[: step % 3]  # round robin: no mode always runs first
        for mode in order:
            r = runs[mode]
            if step == args.warmup:
                st = r["opt"].store
                r["io"] = (st.bytes_read + st.bytes_written, {k: sum(v) for k, v in st.array_io.items()})
            before = r["clock"].seconds
            t = time.perf_counter()
            loss = r["model"](input_ids=ids, labels=ids).loss
            loss.backward()
            r["opt"].step()
            r["opt"].zero_grad()
            r["opt"].wait_step()  # the whole step, the overlapped update included
            r["times"].append(time.perf_counter() - t)
            r["codec"].append(r["clock"].seconds - before)
            r["losses"].append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  step {step:4d} " + "  ".join(f"{m} {runs[m]['losses'][-1]:.4f}" for m in MODES), flush=True)
    for mode in MODES:
        r = runs[mode]
        st = r["opt"].store
        n = args.steps - args.warmup
        total0, arrays0 = r["io"]
        r["bytes_per_step"] = (st.bytes_read + st.bytes_written - total0) / n
        r["moment_bytes_per_step"] = sum(sum(st.array_io[k]) - arrays0[k] for k in ("exp_avg", "exp_avg_sq")) / n
        r["eval"] = evaluate(r["model"], held, args)
        r["params"] = st.total
        r["opt"].engine.close()
        del r["model"], r["opt"]
    return runs


def moving(xs, k=20):
    return [sum(xs[i : i + k]) / k for i in range(len(xs) - k + 1)]


def figures(runs: dict, args) -> dict:
    """Each mode's sample: its timed steps, its curve, and its deviation from the fp32 run."""
    ref, warmup = runs["fp32"], args.warmup
    mean_loss = statistics.fmean(ref["losses"])
    out = {}
    for mode in MODES:
        r = runs[mode]
        d = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
        dm = [abs(a - b) for a, b in zip(moving(r["losses"]), moving(ref["losses"]))] or [0.0]
        rel_eval = (r["eval"] - ref["eval"]) / ref["eval"]
        out[f"moments-{mode}"] = _harness.sample(r["times"][warmup:], losses=r["losses"], params=r["params"],
                                                 tokens_per_step=args.micro_batch * args.seq_len, dtype="fp32", extra={
            "max_dloss": round(max(d), 4), "mean_dloss": round(statistics.fmean(d), 5), "max_d_avg20": round(max(dm), 4),
            "eval_loss": round(r["eval"], 4), "eval_vs_fp32": round(rel_eval, 5),
            "moment_mb_per_step": round(r["moment_bytes_per_step"] / 1e6, 3),
            "optimizer_mb_per_step": round(r["bytes_per_step"] / 1e6, 3),
            "codec_ms": round(statistics.median(r["codec"][warmup:]) * 1e3, 2), "tolerance": TOLERANCE,
            "within_tolerance": statistics.fmean(d) <= TOLERANCE * mean_loss and abs(rel_eval) <= TOLERANCE})
    return out


def measure(spec: dict) -> dict:
    args = SimpleNamespace(**spec)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    pretrained = os.path.join(args.scratch, "pretrained")
    print("pretraining (plain PyTorch, fp32) on the repository's prose ...", file=sys.stderr)
    pretrain(args, pretrained)
    print("fine-tuning on the repository's Python source, fp32 / bf16 / int8 moments in turns ...", file=sys.stderr)
    return _harness.side_by_side(figures(finetune(args, pretrained, os.path.join(args.scratch, "swap")), args))


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=300, warmup=5, seq_len=64, micro_batch=8, timeout=4 * 3600.0, budget=4 * 3600.0)
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chunk", type=int, default=1 << 16, help="optimizer swap chunk (elements)")
    p.add_argument("--eval-batches", type=int, default=20)
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.steps, args.pretrain_steps, args.eval_batches, args.warmup, args.micro_batch = 6, 5, 1, 1, 2
    spec = {k: getattr(args, k) for k in ("steps", "warmup", "seq_len", "micro_batch", "pretrain_steps", "layers",
                                          "hidden", "lr", "chunk", "eval_batches")}
    records = _harness.run_cells(BENCH, "benchmarks.compressed_states", [Cell("moments", f"{args.layers}x{args.hidden}",
                                                                        side_by_side=tuple(f"moments-{m}" for m in MODES))],
                                 lambda cell, scratch: dict(spec, scratch=scratch), args, dtype="fp32")
    status = _harness.finish(BENCH, records, args, PAIRS, extra=(
        "mean_dloss", "max_d_avg20", "eval_loss", "eval_vs_fp32", "moment_mb_per_step", "codec_ms", "within_tolerance"),
        ratio_extra=("moment_mb_per_step", "optimizer_mb_per_step"))
    outside = [r["contender"] for r in records if r["status"] == "ok" and not r["extra"]["within_tolerance"]]
    print(f"outside the tolerance: {', '.join(outside)}" if outside else "every mode within the tolerance")
    return status or (1 if outside else 0)


if __name__ == "__main__":
    sys.exit(main())
