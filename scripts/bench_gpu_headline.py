"""The headline on one GPU: GPT-2 124M trained by plain PyTorch on the GPU and by infinity with
every model state offloaded (ZeRO-3, offload_param and offload_optimizer on cpu, then on nvme).

Both sides train the same way, that of infinity's ``precision.dtype: bf16``: bf16 parameters
and activations, fp32 master weights, AdamW (lr 1e-4, weight decay 0.01), gradient clipping
1.0: scripts/bench_offload.py's PlainTrainer (on the GPU, torch's fused AdamW) and
InfinityTrainer with that script's ``infinity_config``. The model is GPT2Config's
GPT-2 small (12 x 768, vocab 50257, 124M parameters) with dropout off, built in the child
from a fixed seed; batches are random tokens from a fixed seed, the same for every
contender, put on ``infinity.device()``. Each contender runs in a process of its own (its
GPU peak is its own), guarded: one that crashes or runs out of time is recorded with its
error and the others still run. One JSON line per contender, as it finishes:

- ``step_s``: median over the steps after the warm-ups, each timed from a
  ``torch.cuda.synchronize()`` before to one after (the last step waits for infinity's
  overlapped update);
- ``tflops``: 6 x parameters x tokens per step / step_s / 1e12 (the dense-matmul estimate,
  no attention term);
- ``gpu_peak_gib``: ``torch.cuda.max_memory_allocated()`` over the whole process;
- ``nvme_gbps``: bytes the NVMe stores read and wrote in the timed steps (the engine's
  telemetry) over their time; ``vs_plain``: step_s over plain's.

    python scripts/bench_gpu_headline.py [--only plain,cpu,nvme] [--steps 5] [--tiny]
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))  # this checkout's infinity
sys.path.insert(0, SCRIPTS)
from bench_offload import InfinityTrainer, PlainTrainer, infinity_config  # noqa: E402 - after the path insert

GiB = 2**30
FULL = {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50257, "positions": 1024}
TINY = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 512, "positions": 64}


# ------------------------------------------------------------------ a contender's process


def build_gpt(shape: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=shape["vocab"], n_positions=shape["positions"], n_embd=shape["hidden"],
                     n_layer=shape["layers"], n_head=shape["heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def compute_device():
    import infinity

    public = getattr(infinity, "device", None)  # the public name, once it exists
    if public is not None:
        return public()
    from infinity._runtime import _accelerator

    return _accelerator.device()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def child(spec: dict) -> dict:
    import torch

    from infinity._runtime._telemetry import flatten, stall_seconds, tier_traffic

    torch.manual_seed(spec["seed"])
    shape = TINY if spec["tiny"] else FULL
    t0 = time.perf_counter()
    model = build_gpt(shape)
    params = sum(p.numel() for p in model.parameters())
    device = compute_device()
    if spec["kind"] == "plain":
        trainer = PlainTrainer(model.to(device))
        engine = None
    else:
        trainer = InfinityTrainer(model, infinity_config(spec["kind"], spec["nvme"]))
        engine = trainer.opt.engine
    loss = {}  # the last forward's, read after the step's clock stopped (no sync inside the step)
    trainer.model.register_forward_hook(lambda module, args, output: loss.update(value=output.loss.detach()))
    out = {"contender": spec["kind"], "device": str(device), "precision": "bf16 parameters, fp32 master weights",
           "tflops_is": "6*params*tokens/step_s", "params": params,
           "tokens_per_step": spec["micro_batch"] * spec["seq_len"], "setup_s": round(time.perf_counter() - t0, 1)}
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        ids = torch.randint(shape["vocab"], (spec["micro_batch"], spec["seq_len"]), generator=gen).to(device)
        if i == spec["warmup"] and engine is not None:
            engine.telemetry(reset=True)  # counters start at the timed steps
        sync()
        start = time.perf_counter()
        trainer.step(ids)
        if i == spec["warmup"] + spec["steps"] - 1 and engine is not None:
            trainer.opt.wait_step()  # the overlapped update of the last step belongs to it
        sync()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
        losses.append(loss["value"].item())
    step_s = statistics.median(times)
    out.update(step_s=round(step_s, 4), steps_s=[round(t, 4) for t in times],
               tflops=float(f"{6 * params * out['tokens_per_step'] / step_s / 1e12:.4g}"),
               loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
               peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
    if torch.cuda.is_available():
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
    if engine is not None:
        flat = flatten(engine.telemetry())
        nvme = tier_traffic(flat).get("nvme", {"read": 0.0, "write": 0.0})
        out.update(nvme_read_gb_per_step=round(nvme["read"] / len(times) / 1e9, 3),
                   nvme_write_gb_per_step=round(nvme["write"] / len(times) / 1e9, 3),
                   nvme_gbps=round((nvme["read"] + nvme["write"]) / sum(times) / 1e9, 3),
                   stall_s_per_step=round(stall_seconds(flat) / len(times), 4))
        engine.close()
    return out


# ------------------------------------------------------------------ the parent


def innermost_infinity_frame(stderr: str) -> str:
    frames = re.findall(r'File "([^"]*/infinity/[^"]+)", line (\d+)', stderr)
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path[path.rindex('/infinity/') + 1:]}:{line}"


def run_contender(spec: dict, timeout: float) -> dict:
    """The child's record, or the contender with its error: the last line it printed to stderr."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        sys.stderr.write(err)
        return {"contender": spec["kind"], "error": f"timed out after {timeout:.0f} s",
                "where": innermost_infinity_frame(err)}
    sys.stderr.write(proc.stderr)
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {"contender": spec["kind"], "error": f"exit {proc.returncode}: {tail[-1] if tail else ''}",
            "where": innermost_infinity_frame(proc.stderr)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="plain,cpu,nvme", help="contenders, in this order (plain, cpu, nvme)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-ups (median)")
    p.add_argument("--nvme-path", default=os.environ.get("GPU_CHECK_DISK", "/var/tmp"),
                   help="a temp dir for the nvme contender's swap files is made and removed under it")
    p.add_argument("--budget", type=float, default=140.0, help="seconds for all contenders together")
    p.add_argument("--child-timeout", type=float, default=75.0, help="seconds one contender may take at most")
    p.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2, 2 x 32 tokens, 2 + 2 steps (CPU checks)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.tiny:
        args.micro_batch, args.seq_len, args.warmup, args.steps = 2, 32, 2, 2
    deadline = time.time() + args.budget
    plain, failed = None, 0
    for kind in args.only.split(","):
        nvme = tempfile.mkdtemp(prefix="headline_nvme_", dir=args.nvme_path)
        spec = {"kind": kind, "tiny": args.tiny, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                "warmup": args.warmup, "steps": args.steps, "nvme": nvme, "seed": 0}
        left = min(args.child_timeout, deadline - time.time())
        try:
            record = run_contender(spec, left) if left > 5 else {"contender": kind, "error": "no time left"}
        finally:
            shutil.rmtree(nvme, ignore_errors=True)
        if kind == "plain" and "step_s" in record:
            plain = record
        elif plain is not None and "step_s" in record:
            record["vs_plain"] = round(record["step_s"] / plain["step_s"], 2)
        failed += "error" in record
        print(json.dumps(record), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
