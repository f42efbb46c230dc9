"""Where host memory goes: GPT-2 124M, fp32, 4 x 256 tokens, everything on NVMe, against plain PyTorch.

Each contender runs in its own process (its peak RSS is its own), rounds alternate plain PyTorch
(glibc's default allocator, as users run it), with ``--before-tree`` infinity from that checkout
("before", e.g. ``git archive <commit>`` with the native libraries copied in, default
configuration) and infinity from this checkout three ways (``zero.host_allocator``): "release"
(the default: the block cache of Note [block cache] in native/host_alloc/host_alloc.cpp keeping
at most 256 MiB of freed blocks, and the optimizer's host cache released through forward),
"cache" (the block cache keeping every freed block) and "keep" (glibc's heap, Note [allocator
retained pages] in infinity/_offload/_memory_plan.py); every step is timed, with its minor page faults (the
cost of releasing). The account (Note [one memory
model] in infinity/_offload/_memory_plan.py) is printed after the first measured forward and step, at the peak
of the resident set (a thread samples it every 20 ms) and at the end: the engine's buffers by
category as resident and mapped (Note [released pages] in infinity/aio/_memory.py), the C heap
in use (activations, autograd's gradients, temporaries) and retained (freed pages the
allocator keeps), the block cache's blocks in use and cached, the rest of the resident set; and the plan's figures.

    python scripts/bench_host_memory.py [--rounds 2] [--steps 3] [--micro-batch 4 --seq-len 256] [--before-tree DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from _child import spawn_child  # noqa: E402 - after the path insert

from benchmarks import _models  # noqa: E402

GiB, MiB = 2**30, 2**20
VOCAB = _models.VOCAB


def nvme_config(path: str, allocator: str, dtype: str = "fp32") -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path},
                     "offload_optimizer": {"device": "nvme", "nvme_path": path},
                     "host_allocator": allocator},  # Note [block cache] in host_alloc.cpp: release is the default
            "precision": {"dtype": dtype}, "optimizer": {"lr": 1e-4}, "gradient_clipping": 1.0}


# Contenders: name -> zero.host_allocator. "release" is the default configuration.
INFINITY = {"release": "release", "cache": "cache", "keep": "keep"}


class PeakSampler:
    """Samples the host account every ``period`` seconds on a thread and keeps the sample of
    the largest resident set: the account at the peak, not at the end of a phase."""

    def __init__(self, period: float = 0.02):
        import threading

        self.period, self.best = period, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from infinity.testing import host_account

        while not self._stop.wait(self.period):
            acct = host_account()
            if self.best is None or acct["rss"] > self.best["rss"]:
                self.best = acct

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.best


def child(spec: dict) -> dict:
    if spec.get("tree"):  # "before": infinity from another checkout (e.g. an earlier commit)
        sys.path.insert(0, spec["tree"])
    import torch

    import infinity
    from infinity.testing import host_account, peak_rss, rss_now

    torch.set_num_threads(2)
    torch.manual_seed(0)
    out = {"base_rss": rss_now(), "steps": [], "accounts": {}}
    dtype, defaults = spec.get("dtype", "fp32"), spec.get("model_defaults", False)
    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    # plain PyTorch in bf16 as the Hugging Face Trainer runs it: fp32 weights and Adam, autocast
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=spec["kind"] == "plain" and dtype == "bf16")
    if spec["kind"] == "plain":
        model = _models.build(shape, user_defaults=defaults)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        cfg = nvme_config(spec["nvme_path"], spec["allocator"], dtype)
        with infinity.Init(config=cfg):
            model = _models.build(shape, user_defaults=defaults)
        model, opt = infinity.initialize(model, cfg)
        out["plan"] = opt.engine.memory_plan["categories"]
    out["setup_rss"] = rss_now()
    sampler = PeakSampler()
    gen = torch.Generator().manual_seed(0)
    for i in range(spec["warmup"] + spec["steps"]):
        if spec.get("toggle") == "allocator":  # odd steps: torch's blocks from glibc's heap, even: from the block cache
            from infinity.testing import RELEASE_CACHE_CAP, stop_block_cache, use_block_cache

            if i % 2:
                stop_block_cache()
            elif i:  # the engine installed it for step 0
                use_block_cache(RELEASE_CACHE_CAP)
        elif spec.get("toggle") == "host_cache":  # odd steps: the optimizer's host cache kept through forward; even:
            # released and read again (Note [host cache] in _nvme_optimizer_store.py)
            opt.engine.opt_store.release_cache = not i % 2
        ids = torch.randint(VOCAB, (spec["micro_batch"], spec["seq_len"]), generator=gen)
        t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        if spec["kind"] != "plain" and i == spec["warmup"]:
            out["accounts"]["after_forward"] = host_account()
        loss.backward()
        if spec["kind"] == "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out["steps"].append(time.perf_counter() - t0)
        out.setdefault("minor_faults", []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if spec["kind"] != "plain" and i == spec["warmup"]:
            out["accounts"]["after_step"] = host_account()
    out["accounts"]["at_peak"] = sampler.stop()
    if spec["kind"] != "plain":
        opt.wait_step()
        out["accounts"]["end"] = host_account()
        out["telemetry_keys"] = sorted(opt.engine.telemetry()["host_memory"])
        opt.engine.close()
    out["peak_rss"] = peak_rss()
    return out


def fault_cost(mib: int = 256, reps: int = 5) -> float:
    """Seconds per minor page fault on this machine: filling a fresh mapping of ``mib`` MiB
    (every page faults in) minus refilling it, divided by the faults counted; best of ``reps``."""
    import torch

    best = float("inf")
    for _ in range(reps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        t = torch.empty(mib << 18)  # float32: mib MiB, above any mmap threshold: a mapping of its own
        t.fill_(1.0)
        fresh, faults = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        t0 = time.perf_counter()
        t.fill_(2.0)
        best = min(best, (fresh - (time.perf_counter() - t0)) / max(faults, 1))
        del t
    return best


def spawn(spec: dict, timeout: float) -> dict:
    return spawn_child(__file__, spec, timeout, what=spec["kind"])


def show_account(name: str, acct: dict) -> None:
    resident = acct.get("resident", acct["mapped"])
    mapped = " ".join(f"{k}={resident.get(k, 0) / MiB:.0f}/{v / MiB:.0f}" for k, v in sorted(acct["mapped"].items()))
    print(f"  {name:14s} rss {acct['rss'] / MiB:6.0f} MiB | engine buffers resident/mapped (MiB): {mapped or '-'} | "
          f"heap in use {acct.get('heap_in_use', 0) / MiB:.0f}, retained {acct.get('heap_retained', 0) / MiB:.0f} | "
          f"block cache in use {acct.get('blocks_in_use', 0) / MiB:.0f}, cached {acct.get('blocks_cached', 0) / MiB:.0f} | "
          f"other {acct['other'] / MiB:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="infinity's precision.dtype; plain PyTorch runs bf16 as fp32 weights under autocast")
    ap.add_argument("--model-defaults", action="store_true",
                    help="the model as users build it: GPT2Config()'s dropout and use_cache (default: both off)")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated subset of plain,before,release,cache,keep (default: all that apply)")
    ap.add_argument("--before-tree", help="a checkout of an earlier commit (native libraries built) to run as 'before'")
    ap.add_argument("--before-allocator", default="keep", choices=("keep", "release", "cache"),
                    help="zero.host_allocator of 'before' (keep: trees older than the block cache; release: "
                         "a tree whose default it is, to compare the same configuration)")
    ap.add_argument("--toggle-steps", type=int, default=0,
                    help="also time N pairs of steps in two processes (release): torch's blocks from the block "
                         "cache and from glibc's heap on alternate steps, then the optimizer's host cache released "
                         "through forward and kept on alternate steps")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    base = dict(layers=args.layers, hidden=args.hidden, micro_batch=args.micro_batch, seq_len=args.seq_len,
                steps=args.steps, warmup=args.warmup, nvme_path=args.nvme_path, dtype=args.dtype,
                model_defaults=args.model_defaults)
    runs = {"plain": [], **({"before": []} if args.before_tree else {}), **{k: [] for k in INFINITY}}
    if args.contenders:
        wanted = set(args.contenders.split(",")) | {"plain"}  # every ratio is against plain PyTorch
        runs = {k: v for k, v in runs.items() if k in wanted}
    for r in range(args.rounds):
        for kind in runs:
            res = spawn({**base, "kind": kind, "tree": args.before_tree if kind == "before" else None,
                         "allocator": INFINITY.get(kind, args.before_allocator)}, 3600)
            runs[kind].append(res)
            print(f"round {r} {kind:9s}: peak RSS {res['peak_rss'] / GiB:.2f} GiB, "
                  f"step {statistics.median(res['steps'][args.warmup:]):.2f} s, minor page faults per step "
                  f"{statistics.median(res.get('minor_faults', [0])[args.warmup:] or [0]):.0f}", flush=True)
    for toggle, even, odd in (("allocator", "block cache", "glibc's heap"),
                              ("host_cache", "optimizer host cache released", "kept")):
        if not args.toggle_steps:
            break
        res = spawn({**base, "kind": "toggle", "allocator": "release", "steps": 2 * args.toggle_steps,
                     "warmup": 2, "toggle": toggle}, 3600)
        a, b = res["steps"][2::2], res["steps"][3::2]
        print(f"one process, alternate steps ({args.toggle_steps} each): {even} {statistics.median(a):.2f} s, "
              f"{odd} {statistics.median(b):.2f} s, ratio {statistics.median(a) / statistics.median(b):.2f}x", flush=True)
    if not args.rounds:  # --rounds 0: the alternating steps alone
        return
    cost = fault_cost()
    print(f"a minor page fault costs {cost * 1e6:.2f} us here (fresh vs reused 256 MiB, best of 5)")
    for k, v in runs.items():
        faults = statistics.median(f for x in v for f in x.get("minor_faults", [0])[args.warmup:] or [0])
        print(f"  {k:9s} minor page faults per step {faults:.0f}: {faults * cost:.2f} s of faults per step")
    med = {k: {"peak": statistics.median(x["peak_rss"] for x in v),
               "step": statistics.median(s for x in v for s in x["steps"][args.warmup:])} for k, v in runs.items()}
    print(f"\nGPT-2 {args.layers}x{args.hidden}, {args.dtype}, {args.micro_batch} x {args.seq_len} tokens, "
          f"{'the model as users build it (dropout, use_cache)' if args.model_defaults else 'dropout and cache off'}, "
          f"medians of {args.rounds} round(s):")
    for k, m in med.items():
        print(f"  {k:9s} peak RSS {m['peak'] / GiB:.2f} GiB   step {m['step']:.2f} s")
    for k in [k for k in runs if k != "plain"]:
        print(f"  ratio {k}/plain: peak RSS {med[k]['peak'] / med['plain']['peak']:.2f}x, "
              f"step time {med[k]['step'] / med['plain']['step']:.2f}x")
    for k in [k for k in runs if k not in ("plain", "keep") and "keep" in runs]:
        print(f"  ratio {k}/keep: peak RSS {med[k]['peak'] / med['keep']['peak']:.2f}x, "
              f"step time {med[k]['step'] / med['keep']['step']:.2f}x")
    if "before" in med:
        print(f"  ratio release/before: peak RSS {med['release']['peak'] / med['before']['peak']:.2f}x, "
              f"step time {med['release']['step'] / med['before']['step']:.2f}x")
    print("\nplain PyTorch's host memory at its peak (last round):")
    show_account("at_peak", runs["plain"][-1]["accounts"]["at_peak"])
    for kind in [k for k in runs if k != "plain"]:
        print(f"\ninfinity's host memory by category ({kind}, last round):")
        for name, acct in runs[kind][-1]["accounts"].items():
            show_account(name, acct)
    if "release" not in runs:
        return
    last = runs["release"][-1]
    print("  planned (MiB): " + " ".join(f"{k}={v / MiB:.0f}" for k, v in sorted(last["plan"]["host"].items())))
    peaks = last["accounts"]["end"]["mapped_peak"]
    print("  mapped peaks (MiB): " + " ".join(f"{k}={v / MiB:.0f}" for k, v in sorted(peaks.items())))


if __name__ == "__main__":
    main()
