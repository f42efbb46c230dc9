"""Accuracy and cost of compressed Adam moments on NVMe (``zero.offload_optimizer.moments``).

A GPT-2 (byte-level, vocab 256, built from a config: nothing downloads) is first pretrained
briefly with plain torch AdamW on this repository's English prose (README.md, docs/) and saved
with ``save_pretrained``; then it is fine-tuned from that checkpoint on different text, this
repository's Python source, with everything on NVMe (parameters, master weights, moments,
gradients; no host cache), fp32 compute, once per moments mode: fp32, bf16, int8. The three
runs live side by side in this process and take their steps in turns (round robin), on the
same batches, so their step times share the machine's noise.

Printed: the training-loss curves' deviation from the fp32-moments run (max and mean of
|loss - loss_fp32|, raw and over a 20-step moving average), the final eval loss of each on
held-out source, the optimizer swap bytes per step (moments and all), the step time (median)
and the time the step spent compressing and expanding the moments. The tolerance is stated
and checked: mean |dloss| <= 1% of the fp32 run's mean loss and the final eval loss within 1%
(relative) of fp32's.

    python scripts/bench_compressed_states.py [--steps 300] [--nvme-path DIR] [--quick]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("fp32", "bf16", "int8")
TOLERANCE = 0.01  # relative: mean |dloss| / mean loss, and |eval - eval_fp32| / eval_fp32


def corpus(patterns) -> torch.Tensor:
    """The bytes of the repository's files matching ``patterns`` (sorted), as a uint8 tensor."""
    files = sorted({f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True)})
    data = b"\n".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def sample(data: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def pretrain(args, out_dir: str) -> None:
    """Plain torch AdamW on the prose; saved with save_pretrained."""
    model = build(args)
    prose = corpus(["README.md", "docs/**/*.md", "native/**/*.md"])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for step in range(args.pretrain_steps):
        ids = sample(prose, args.batch, args.seq, g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == args.pretrain_steps - 1:
            print(f"  pretrain step {step:4d} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out_dir)
    print(f"  pretrained {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {prose.numel()} bytes "
          f"of prose in {time.perf_counter() - t0:.0f} s; saved to {out_dir}")


def config(mode: str, nvme: str, args) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                     "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "gradients": "nvme", "host_cache": 0,
                                           "chunk_size": args.chunk, "moments": mode}},
            "precision": {"dtype": "fp32"}, "optimizer": {"lr": args.lr, "weight_decay": 0.01}}


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


def evaluate(model, held: torch.Tensor, args) -> float:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        losses = [model(input_ids=ids, labels=ids).loss.item()
                  for ids in (sample(held, args.batch, args.seq, g) for _ in range(args.eval_batches))]
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
        model, opt = infinity.initialize(model, config(mode, nvme, args))
        runs[mode] = {"model": model, "opt": opt, "losses": [], "times": [], "clock": CodecClock(opt.store),
                      "codec": [], "io": None}
    g = torch.Generator().manual_seed(3)
    for step in range(args.steps):
        ids = sample(train, args.batch, args.seq, g)
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


def report(runs: dict, args) -> bool:
    ref = runs["fp32"]
    mean_loss = statistics.fmean(ref["losses"])
    w = args.warmup
    print(f"\nfine-tune: {args.steps} steps, batch {args.batch} x {args.seq} bytes, lr {args.lr}, fp32 compute, "
          f"everything on NVMe, chunk {args.chunk}; {ref['params'] / 1e6:.2f}M optimizer elements on this rank")
    print(f"tolerance: mean |dloss| <= {TOLERANCE:.0%} of the fp32 run's mean loss ({mean_loss:.4f}), "
          f"final eval loss within {TOLERANCE:.0%} of fp32's\n")
    head = ("moments", "max|dloss|", "mean|dloss|", "max|d avg20|", "eval loss", "eval vs fp32", "moment MB/step",
            "opt MB/step", "step ms", "codec ms", "ok")
    rows, ok_all = [head], True
    for mode in MODES:
        r = runs[mode]
        d = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
        dm = [abs(a - b) for a, b in zip(moving(r["losses"]), moving(ref["losses"]))]
        rel_eval = (r["eval"] - ref["eval"]) / ref["eval"]
        ok = statistics.fmean(d) <= TOLERANCE * mean_loss and abs(rel_eval) <= TOLERANCE
        ok_all &= ok
        rows.append((mode, f"{max(d):.4f}", f"{statistics.fmean(d):.4f}", f"{max(dm):.4f}", f"{r['eval']:.4f}",
                     f"{rel_eval:+.2%}", f"{r['moment_bytes_per_step'] / 1e6:.2f}", f"{r['bytes_per_step'] / 1e6:.2f}",
                     f"{statistics.median(r['times'][w:]) * 1e3:.1f}", f"{statistics.median(r['codec'][w:]) * 1e3:.1f}",
                     "yes" if ok else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.rjust(wd) for c, wd in zip(row, widths)))
    t32 = statistics.median(ref["times"][w:])
    for mode in MODES[1:]:
        r = runs[mode]
        print(f"{mode}: moment bytes per step {ref['moment_bytes_per_step'] / r['moment_bytes_per_step']:.2f}x fewer, "
              f"optimizer bytes per step {ref['bytes_per_step'] / r['bytes_per_step']:.2f}x fewer, step time "
              f"{statistics.median(r['times'][w:]) / t32:.2f}x fp32's (codec {statistics.median(r['codec'][w:]) / t32:.1%} "
              f"of an fp32 step)")
    return ok_all


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timings and byte counts")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chunk", type=int, default=1 << 16, help="optimizer swap chunk (elements)")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 40 pretrain and 40 fine-tune steps")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.pretrain_steps, args.eval_batches = 40, 40, 4
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    work = tempfile.mkdtemp(prefix="bench-compressed-", dir=args.nvme_path)
    try:
        pretrained = os.path.join(work, "pretrained")
        print("pretraining (plain PyTorch, fp32) on the repository's prose ...")
        pretrain(args, pretrained)
        print("fine-tuning on the repository's Python source, fp32 / bf16 / int8 moments in turns ...")
        ok = report(finetune(args, pretrained, os.path.join(work, "swap")), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nall modes within tolerance" if ok else "\nSOME MODE OUTSIDE TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
