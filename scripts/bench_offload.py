"""Benchmark of ZeRO-3 offload tiers against plain PyTorch, measured in the same run.

(a) default: a GPT-2 that fits in RAM (12 x 768, vocab 50257: GPT-2 124M), bf16, trained with
    offload none / cpu / nvme (parameters and optimizer states on the same tier), beside plain
    PyTorch (bf16 model + fp32 master weights + AdamW). Every contender runs in its own process
    so its peak RSS (ru_maxrss) is its own; step time is the median of --steps steps after one
    warm-up step. Prints a table and the ratios against plain.

(b) --big: the largest GPT-style model this machine trains with everything on NVMe: built
    partitioned under infinity.Init on NVMe, stage 3, bf16, a tiny batch. Prints step time,
    peak RSS against physical RAM, the bytes each NVMe store moved, and the model-state bytes
    (16-20 B/param) against RAM. Plain AdamW keeps ~16 B/param in RAM, so it tops out near
    RAM / 16 parameters.

    python scripts/bench_offload.py [--quick] [--micro-batch 4 --seq-len 256 --steps 3]
    python scripts/bench_offload.py --big [--params 3e9] [--nvme-path DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from _child import spawn_child  # noqa: E402 - after the path insert

from benchmarks import _models, _trainers  # noqa: E402

GiB = 2**30
VOCAB = _models.VOCAB
CONTENDERS = ["plain", "none", "cpu", "nvme"]
# Disk the --big run needs per parameter: Init's fp32 chunks (4), bf16 parameter shards (2),
# fp32 master + two moments (12), fp32 gradients (4).
DISK_BYTES_PER_PARAM = 22


def physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def gpt_shape(params: float) -> tuple[int, int]:
    """(layers, hidden) of a GPT-2-style model with about ``params`` parameters."""
    widths = [768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192]
    hidden = max([w for w in widths if w * w * 12 * 32 <= params] or [widths[0]])
    per_layer = 12 * hidden * hidden + 13 * hidden
    layers = max(1, math.ceil((params - (VOCAB + 1024) * hidden) / per_layer))
    return layers, hidden


def gpt_param_count(layers: int, hidden: int) -> int:
    return layers * (12 * hidden * hidden + 13 * hidden) + (VOCAB + 1024) * hidden + 2 * hidden


def infinity_config(tier: str, nvme_path: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": tier, "nvme_path": nvme_path},
                     "offload_optimizer": {"device": tier, "nvme_path": nvme_path}},
            "precision": {"dtype": "bf16"}, "optimizer": {"lr": 1e-4}, "gradient_clipping": 1.0}


# ------------------------------------------------------------------ child processes


class PlainTrainer:
    """The reference (benchmarks/_trainers.py's PlainTrainer on the CPU, bf16 with fp32 master
    weights); ``step`` returns (forward and backward seconds, update seconds)."""

    def __init__(self, model):
        import torch

        self.trainer = _trainers.PlainTrainer(model, torch.device("cpu"), "bf16")
        self.model = self.trainer.model

    def step(self, ids) -> tuple[float, float]:
        return _trainers.timed_parts(self.trainer, ids)


class InfinityTrainer:
    def __init__(self, model, cfg):
        self.trainer = _trainers.InfinityTrainer(model, cfg)
        self.model, self.opt = self.trainer.model, self.trainer.opt

    def step(self, ids) -> tuple[float, float]:
        return _trainers.timed_parts(self.trainer, ids)

    def moved(self) -> dict:
        out = {}
        for name in ("store", "param_store"):
            store = getattr(self.opt, name, None)
            if store is not None and hasattr(store, "bytes_read"):
                out[name] = {"read": store.bytes_read, "written": store.bytes_written}
        return out


def _delta(after: dict, before: dict) -> dict:
    return {k: {d: after[k][d] - before.get(k, {}).get(d, 0) for d in after[k]} for k in after}


def run_child(spec: dict) -> dict:
    import torch

    import infinity

    torch.set_num_threads(2)
    torch.manual_seed(0)
    base_rss = peak_rss()
    t0 = time.perf_counter()
    if spec["kind"] == "plain":
        trainer = PlainTrainer(_models.build(_models.Shape.of(spec["layers"], spec["hidden"])))
    else:
        cfg = infinity_config(spec["kind"], spec["nvme_path"])
        with infinity.Init(config=cfg):
            model = _models.build(_models.Shape.of(spec["layers"], spec["hidden"]))
        build_s = time.perf_counter() - t0
        build_rss = peak_rss()
        trainer = InfinityTrainer(model, cfg)
    setup_s = time.perf_counter() - t0
    out = {"params": sum(p.numel() for p in trainer.model.parameters()), "base_rss": base_rss,
           "setup_s": setup_s, "steps": []}
    if spec["kind"] != "plain":
        out.update(build_s=build_s, build_rss=build_rss, tiers=trainer.opt.engine.tier_bytes(),
                   states=trainer.opt.engine.model_state_bytes())
    gen = torch.Generator().manual_seed(0)
    try:
        moved0 = {}
        for i in range(spec["warmup"] + spec["steps"]):
            if i == spec["warmup"] and spec["kind"] != "plain":
                moved0 = trainer.moved()
            ids = torch.randint(VOCAB, (spec["micro_batch"], spec["seq_len"]), generator=gen)
            out["steps"].append(trainer.step(ids))
            if spec.get("verbose"):
                fb, st = out["steps"][-1]
                print(f"  step {i}: fwd+bwd {fb:.2f}s  optimizer {st:.2f}s  peak RSS {peak_rss() / GiB:.2f} GiB",
                      file=sys.stderr, flush=True)
        if spec["kind"] != "plain":
            out["moved_total"] = trainer.moved()
            out["moved_per_step"] = {k: {d: v // spec["steps"] for d, v in io.items()}
                                     for k, io in _delta(out["moved_total"], moved0).items()}
    finally:
        if spec["kind"] != "plain":
            trainer.opt.engine.close()
    out["peak_rss"] = peak_rss()
    return out


def spawn(spec: dict, timeout: float) -> dict:
    return spawn_child(__file__, spec, timeout, what=f"{spec['kind']} run")


# ------------------------------------------------------------------ reporting


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def warn_if_loaded() -> None:
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) * 0.5:
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores before the run; other processes "
              f"share the CPU and disk, so the times below are inflated")


def check_disk(nvme_path: str, need: int) -> None:
    warn_if_loaded()
    os.makedirs(nvme_path, exist_ok=True)
    free = shutil.disk_usage(nvme_path).free
    print(f"disk under {nvme_path}: {fmt_bytes(free)} free, this run needs about {fmt_bytes(need)}")
    if free < need:
        sys.exit(f"not enough disk: free {fmt_bytes(need - free)} more under {nvme_path}, or point --nvme-path "
                 f"at a disk with {fmt_bytes(need)} free, or lower --params")


def median_step(r: dict, warmup: int) -> tuple[float, float, float]:
    timed = r["steps"][warmup:]
    total = statistics.median(a + b for a, b in timed)
    return total, statistics.median(a for a, _ in timed), statistics.median(b for _, b in timed)


def bench_placements(args) -> None:
    layers, hidden = (2, 256) if args.quick else (args.layers or 12, args.hidden or 768)
    mb, seq = (2, 64) if args.quick else (args.micro_batch, args.seq_len)
    nvme_root = tempfile.mkdtemp(prefix="bench_offload_", dir=args.nvme_path)
    check_disk(nvme_root, gpt_param_count(layers, hidden) * DISK_BYTES_PER_PARAM)
    print(f"GPT-2 {layers} x {hidden}, vocab {VOCAB}, bf16, micro-batch {mb} x {seq} tokens, "
          f"median of {args.steps} steps after 1 warm-up, 2 threads, one process per contender\n")
    results = {}
    try:
        for kind in CONTENDERS:
            spec = {"kind": kind, "layers": layers, "hidden": hidden, "micro_batch": mb, "seq_len": seq,
                    "warmup": 1, "steps": args.steps, "nvme_path": nvme_root}
            results[kind] = spawn(spec, timeout=args.timeout)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    plain_step = median_step(results["plain"], 1)[0]
    plain_rss = results["plain"]["peak_rss"]
    print(f"params: {results['plain']['params'] / 1e6:.1f} M")
    print(f"{'contender':<10} {'step s':>8} {'fwd+bwd s':>10} {'optim s':>8} {'tok/s':>8} {'peak RSS':>10} "
          f"{'RSS-base':>10} {'x plain time':>13} {'x plain RSS':>12}")
    for kind, r in results.items():
        step, fb, st = median_step(r, 1)
        name = "plain" if kind == "plain" else f"offload {kind}"
        print(f"{name:<12} {step:>6.3f} {fb:>10.3f} {st:>8.3f} {mb * seq / step:>8.0f} "
              f"{fmt_bytes(r['peak_rss']):>10} {fmt_bytes(r['peak_rss'] - r['base_rss']):>10} "
              f"{step / plain_step:>13.2f} {r['peak_rss'] / plain_rss:>12.2f}")
    for kind in ("cpu", "nvme"):
        r = results[kind]
        moved = ", ".join(f"{k} read {fmt_bytes(v['read'])} written {fmt_bytes(v['written'])}"
                          for k, v in r.get("moved_per_step", {}).items() if v["read"] or v["written"])
        tiers = ", ".join(f"{t} {fmt_bytes(n)}" for t, n in r["tiers"].items())
        print(f"offload {kind}: tiers [{tiers}]" + (f"; NVMe per step: {moved}" if moved else ""))


def bench_big(args) -> None:
    layers, hidden = (args.layers, args.hidden) if args.layers and args.hidden else gpt_shape(args.params)
    n = gpt_param_count(layers, hidden)
    ram = physical_ram()
    nvme_root = tempfile.mkdtemp(prefix="bench_offload_big_", dir=args.nvme_path)
    print(f"GPT-2-style {layers} x {hidden} (heads {hidden // 64}), vocab {VOCAB}: {n / 1e9:.2f} B parameters; "
          f"bf16, stage 3, parameters and optimizer states on NVMe, built under infinity.Init, "
          f"micro-batch {args.big_batch} x {args.big_seq} tokens, {args.big_steps} steps")
    print(f"physical RAM {fmt_bytes(ram)}; plain AdamW (~16 B/param in RAM) tops out near {ram / 16 / 1e9:.2f} B "
          f"parameters; model states here at 16 B/param = {fmt_bytes(16 * n)} ({16 * n / ram:.2f}x RAM)")
    try:
        check_disk(nvme_root, n * DISK_BYTES_PER_PARAM)
        spec = {"kind": "nvme", "layers": layers, "hidden": hidden, "micro_batch": args.big_batch,
                "seq_len": args.big_seq, "warmup": 0, "steps": args.big_steps, "nvme_path": nvme_root,
                "verbose": True}
        r = spawn(spec, timeout=args.timeout)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    states = r["states"]
    print(f"\nparameters: {r['params'] / 1e9:.3f} B")
    print(f"build under Init: {r['build_s']:.1f} s (peak RSS by then {fmt_bytes(r['build_rss'])}); "
          f"build + initialize: {r['setup_s']:.1f} s")
    for i, (fb, st) in enumerate(r["steps"]):
        print(f"step {i}: {fb + st:.1f} s (fwd+bwd {fb:.1f} s, optimizer {st:.1f} s), "
              f"{args.big_batch * args.big_seq / (fb + st):.1f} tok/s")
    print(f"peak RSS {fmt_bytes(r['peak_rss'])} = {r['peak_rss'] / ram:.1%} of physical RAM "
          f"({fmt_bytes(r['base_rss'])} of it after imports)")
    print("bytes per tier held: " + ", ".join(f"{t} {fmt_bytes(b)}" for t, b in r["tiers"].items()))
    print("model states (engine): " + ", ".join(f"{k} {fmt_bytes(b)}" for k, b in states.items()) +
          f"; total {fmt_bytes(sum(states.values()))} = {sum(states.values()) / r['params']:.1f} B/param = "
          f"{sum(states.values()) / ram:.2f}x RAM")
    for key, label in (("moved_per_step", "NVMe per step"), ("moved_total", "NVMe in all (incl. setup)")):
        print(f"{label}: " + "; ".join(f"{k} read {fmt_bytes(v['read'])} written {fmt_bytes(v['written'])}"
                                       for k, v in r[key].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="(a) on a 2 x 256 GPT-2 and 2 x 64 tokens")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=0, help="override the model depth")
    ap.add_argument("--hidden", type=int, default=0, help="override the model width (a multiple of 64)")
    ap.add_argument("--steps", type=int, default=3, help="(a) timed steps per contender (median)")
    ap.add_argument("--big", action="store_true", help="(b) the big model, everything on NVMe")
    ap.add_argument("--params", type=float, default=3e9, help="(b) target parameter count")
    ap.add_argument("--big-batch", type=int, default=1)
    ap.add_argument("--big-seq", type=int, default=64)
    ap.add_argument("--big-steps", type=int, default=2)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir(), help="directory for the swap files")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per child process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the figures are medians)")
    if args.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (heads of 64)")
    bench_big(args) if args.big else bench_placements(args)


if __name__ == "__main__":
    main()
