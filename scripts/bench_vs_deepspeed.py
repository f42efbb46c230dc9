"""The head-to-head: infinity against DeepSpeed (ZeRO-3 CPU offload, ZeRO-Infinity NVMe) and plain PyTorch.

GPT-2 124M (12 x 768, vocab 50257), fp32 on both sides (this CPU has no fast bf16), the same
random token batches (seeded), AdamW lr 1e-4, no weight decay, gradient clipping 1.0, one rank
on the CPU. Contenders:

  plain           torch.optim.AdamW, everything in memory
  ds_cpu          DeepSpeed ZeRO-3, offload_param and offload_optimizer on cpu (DeepSpeedCPUAdam)
  ds_nvme         DeepSpeed ZeRO-Infinity, both on NVMe, its defaults (max_in_cpu keeps up to 1e9
                  parameter elements in host memory, so a 124M model's parameters never leave it)
  ds_nvme_swapped the same with max_in_cpu 0: parameters really swapped. Fails here with DeepSpeed
                  0.19.8 on the CPU accelerator: at its first gather with async_io built
                  ("AssertionError: Not enough buffers 0 for swapping 1" in its parameter
                  swapper); in earlier runs "RuntimeError: self and mat2 must have the same
                  dtype, but got Float and BFloat16". Its ``Init._set_dtype`` reads
                  ``dtype or torch.float16 if is_fp16_supported() else torch.bfloat16 if ...``, so
                  on an accelerator without fp16 the fp32 dtype it is given becomes bf16 and the
                  parameter swapper's buffers are bf16; ``deepspeed.zero.Init`` (which would pass
                  the config) fails on torch 2.13 with "TypeError: Signature mismatch between
                  ...new_tensor and tensor_pynew".
  inf_cpu         infinity, stage 3, parameters and optimizer on cpu
  inf_nvme        infinity, stage 3, parameters and optimizer on NVMe

DeepSpeed is installed on first use into its own virtual environment (``--venv``, default
~/.cache/infinity/deepspeed-<version>; ``--system-site-packages`` so the installed torch is
used, DS_BUILD_OPS=0 so its ops build just in time: cpu_adam and, with libaio-dev present,
async_io), never into this project's environment; it runs with DS_ACCELERATOR=cpu over gloo.
Each contender is one process per round that builds once and then trains ``--steps`` timed
steps after ``--warmup`` (only one is alive at a time: together they would not fit in host
memory); rounds alternate the order. Reported per contender (medians over rounds): step time,
tokens/s, peak RSS (VmHWM), disk bytes per step (/proc/self/io: real block I/O, O_DIRECT
included), and the ratios to plain PyTorch and infinity to DeepSpeed at the same placement.

    python scripts/bench_vs_deepspeed.py [--rounds 2] [--steps 3] [--only plain,inf_nvme,ds_nvme]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's infinity
from _child import ChildFailed, spawn_child  # noqa: E402 - after the path insert

from benchmarks import _models  # noqa: E402

DEEPSPEED = "0.19.8"  # works with torch 2.13's CPU build (DeepSpeedCPUAdam JIT-built with ninja)
GiB, MiB = 2**30, 2**20
VOCAB = _models.VOCAB
SHAPE = _models.shape_of("124m")
CONTENDERS = ("plain", "ds_cpu", "ds_nvme", "ds_nvme_swapped", "inf_cpu", "inf_nvme")


# ------------------------------------------------------------------ the DeepSpeed environment


def default_venv() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "infinity", f"deepspeed-{DEEPSPEED}")


def ensure_libaio() -> None:
    """DeepSpeed's async_io op (its NVMe contenders) builds against Debian's libaio-dev; as
    root it is installed here, otherwise the command to run is printed and those contenders
    fail with DeepSpeed's "Unable to JIT load the async_io op"."""
    if os.path.exists("/usr/include/libaio.h"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing libaio-dev (DeepSpeed's async_io op builds against it)", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev"], check=False, capture_output=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if not os.path.exists("/usr/include/libaio.h"):
        print("libaio-dev is missing and could not be installed: DeepSpeed's NVMe contenders will fail; "
              "run `apt-get install libaio-dev` as root", flush=True)


def ensure_deepspeed(venv: str) -> str:
    """The venv's python, with DeepSpeed installed (once)."""
    ensure_libaio()
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", "import deepspeed, sys; sys.exit(deepspeed.__version__ != %r)" % DEEPSPEED]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing DeepSpeed {DEEPSPEED} into {venv} (first use)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    env = dict(os.environ, DS_BUILD_OPS="0")
    subprocess.run([python, "-m", "pip", "install", "-q", f"deepspeed=={DEEPSPEED}"], check=True, env=env)
    return python


# ------------------------------------------------------------------ a contender's process


def ds_config(kind: str, nvme: str, micro_batch: int) -> dict:
    zero = {"stage": 3}
    if kind == "ds_cpu":
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    else:
        param = {"device": "nvme", "nvme_path": nvme}
        if kind == "ds_nvme_swapped":
            param["max_in_cpu"] = 0
        zero.update(offload_param=param, offload_optimizer={"device": "nvme", "nvme_path": nvme})
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "gradient_clipping": 1.0, "zero_optimization": zero, "fp16": {"enabled": False},
            "bf16": {"enabled": False}}


def inf_config(kind: str, nvme: str) -> dict:
    tier = "cpu" if kind == "inf_cpu" else "nvme"
    return {"zero": {"stage": 3, "offload_param": {"device": tier, "nvme_path": nvme},
                     "offload_optimizer": {"device": tier, "nvme_path": nvme}},
            "precision": {"dtype": "fp32"}, "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
            "gradient_clipping": 1.0}


def make_trainer(kind: str, nvme: str, micro_batch: int):
    """A function running one training step on a batch of token ids."""
    import torch

    torch.manual_seed(0)
    if kind == "plain":
        model = _models.build(SHAPE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return step
    if kind.startswith("ds_"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        cfg = ds_config(kind, nvme, micro_batch)
        # Built whole, then partitioned by deepspeed.initialize: deepspeed.zero.Init fails on torch
        # 2.13 ("TypeError: Signature mismatch between ...new_tensor and tensor_pynew": it replaces
        # torch.Tensor.__new__, whose signature torch now checks). A 124M model fits either way.
        model = _models.build(SHAPE)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        return step
    import infinity

    cfg = inf_config(kind, nvme)
    with infinity.Init(config=cfg):
        model = _models.build(SHAPE)
    model, opt = infinity.initialize(model, cfg)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    step.finish = opt.wait_step
    return step


def io_bytes() -> dict:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def child(spec: dict) -> dict:
    import torch

    from infinity.testing import peak_rss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    step = make_trainer(spec["kind"], spec["nvme"], spec["micro_batch"])
    out = {"setup_s": time.perf_counter() - t0, "steps": [], "io": []}
    gen = torch.Generator().manual_seed(1)
    for i in range(spec["warmup"] + spec["steps"]):
        ids = torch.randint(VOCAB, (spec["micro_batch"], spec["seq_len"]), generator=gen)
        io0, t = io_bytes(), time.perf_counter()
        step(ids)
        if i == spec["warmup"] + spec["steps"] - 1 and hasattr(step, "finish"):
            step.finish()  # the overlapped update of the last step belongs to it
        io1 = io_bytes()
        if i >= spec["warmup"]:
            out["steps"].append(time.perf_counter() - t)
            out["io"].append({k: io1[k] - io0[k] for k in io1})
    out["peak_rss"] = peak_rss()
    return out


def spawn(kind: str, args, python: str) -> dict:
    from infinity.testing import free_port

    nvme = tempfile.mkdtemp(prefix=f"bench_{kind}_", dir=args.nvme_path)
    spec = {"kind": kind, "nvme": nvme, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
            "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "port": free_port()}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if kind.startswith("ds_"):
        env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    try:
        return spawn_child(__file__, spec, args.timeout, what=kind, python=python if kind.startswith("ds_") else sys.executable,
                         env=env, capture_stderr=True)
    except ChildFailed as e:
        return {"error": str(e)}
    finally:
        subprocess.run(["rm", "-rf", nvme])


# ------------------------------------------------------------------ report


def summarize(results: dict, tokens: int) -> dict:
    out = {}
    for kind, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out[kind] = {"error": runs[-1]["error"]}
            continue
        step = statistics.median(s for r in ok for s in r["steps"])
        out[kind] = {"step": step, "tokens_s": tokens / step, "peak": statistics.median(r["peak_rss"] for r in ok),
                     "read": statistics.median(io["read"] for r in ok for io in r["io"]),
                     "write": statistics.median(io["write"] for r in ok for io in r["io"]),
                     "setup": statistics.median(r["setup_s"] for r in ok)}
    return out


def report(summary: dict, args) -> None:
    print(f"\nGPT-2 124M, fp32, {args.micro_batch} x {args.seq_len} tokens, 1 rank, {args.threads} threads; "
          f"medians over {args.rounds} round(s) x {args.steps} step(s)")
    print(f"{'contender':16s} {'step s':>8s} {'tokens/s':>9s} {'peak RSS':>9s} {'disk read/step':>15s} "
          f"{'disk write/step':>16s} {'setup s':>8s}")
    for kind, m in summary.items():
        if "error" in m:
            print(f"{kind:16s} FAILED: {m['error']}")
            continue
        print(f"{kind:16s} {m['step']:8.2f} {m['tokens_s']:9.1f} {m['peak'] / GiB:7.2f} G {m['read'] / MiB:12.0f} MiB "
              f"{m['write'] / MiB:13.0f} MiB {m['setup']:8.1f}")
    pairs = [("inf_cpu", "plain"), ("inf_nvme", "plain"), ("ds_cpu", "plain"), ("ds_nvme", "plain"),
             ("ds_nvme_swapped", "plain"), ("inf_cpu", "ds_cpu"), ("inf_nvme", "ds_nvme"), ("inf_nvme", "ds_nvme_swapped")]
    print("\nratios (step time, peak RSS):")
    for a, b in pairs:
        if "step" in summary.get(a, {}) and "step" in summary.get(b, {}):
            print(f"  {a:9s} / {b:16s} step {summary[a]['step'] / summary[b]['step']:.2f}x   "
                  f"peak RSS {summary[a]['peak'] / summary[b]['peak']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--venv", default=default_venv(), help="DeepSpeed's own virtual environment")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per contender process")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    kinds = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = set(kinds) - set(CONTENDERS)
    if unknown:
        ap.error(f"--only: unknown contender(s) {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    python = ensure_deepspeed(args.venv) if any(k.startswith("ds_") for k in kinds) else sys.executable
    results = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            res = spawn(kind, args, python)
            results[kind].append(res)
            brief = res.get("error", "").splitlines()[-1:] if "error" in res else \
                f"step {statistics.median(res['steps']):.2f} s, peak RSS {res['peak_rss'] / GiB:.2f} GiB"
            print(f"round {r} {kind}: {brief}", flush=True)
    summary = summarize(results, args.micro_batch * args.seq_len)
    report(summary, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
