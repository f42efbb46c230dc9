"""Benchmark of the trace-based prefetcher, and the headline against plain PyTorch.

(a) prefetch study: stage 3, bf16, parameters on NVMe (and separately parameters and
    optimizer states on NVMe), prefetch off vs on, beside the compute-only step (stage 3, no
    offload) and the disk bandwidth measured in the same run with infinity.aio (O_DIRECT
    write then read of a 256 MiB file). Prints step time, stall per stage, bytes moved per
    step, the on/off speedup and the step time against its bound
    max(compute-only step, NVMe read bytes / read bandwidth + write bytes / write bandwidth).
    The batch is small so that I/O and compute are comparable.

(b) headline: Hugging Face GPT-2 124M (GPT2Config defaults), bf16, micro-batch 4 x 256
    tokens, one rank, parameters and optimizer states on NVMe (prefetch on), against plain
    PyTorch bf16 training (bf16 model, fp32 master weights, fused AdamW) in the same run.

Every contender runs in its own process; step times are medians of --steps steps after one
warm-up step (the step that records the trace).

    python scripts/bench_prefetch.py --quick
    python scripts/bench_prefetch.py [--steps 3] [--study-batch 1 --study-seq 128] [--nvme-path DIR]
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

MiB = 2**20
VOCAB = 50257
STAGES = ("nvme_read", "host_to_device", "all_gather", "reduce_scatter", "grad_offload", "optimizer_io")


def build_gpt(layers: int, hidden: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=hidden, n_layer=layers, n_head=hidden // 64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def infinity_config(param: str, optim: str, prefetch: bool, nvme_path: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": param, "nvme_path": nvme_path},
                     "offload_optimizer": {"device": optim, "nvme_path": nvme_path},
                     "prefetch": {"enabled": prefetch}},
            "precision": {"dtype": "bf16"}, "optimizer": {"lr": 1e-4}, "gradient_clipping": 1.0}


# ------------------------------------------------------------------ disk probe


def disk_bandwidth(directory: str, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(write, read) bytes/s of O_DIRECT transfers through infinity.aio, medians."""
    import torch

    from infinity.aio import AsyncIO, aligned_empty

    path = os.path.join(directory, "bandwidth_probe.bin")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(7)
    writes, reads = [], []
    try:
        with AsyncIO(fsync=True) as aio:
            for _ in range(repeats):
                start = time.perf_counter()
                aio.pwrite(buf, path, 0)
                aio.wait()
                writes.append(nbytes / (time.perf_counter() - start))
        with AsyncIO() as aio:
            for _ in range(repeats):
                start = time.perf_counter()
                aio.pread(buf, path, 0)
                aio.wait()
                reads.append(nbytes / (time.perf_counter() - start))
    finally:
        os.remove(path)
    return statistics.median(writes), statistics.median(reads)


# ------------------------------------------------------------------ child processes


class PlainTrainer:
    """The reference: bf16 model, fp32 master weights, fused torch AdamW, gradient clipping."""

    def __init__(self, model):
        import torch

        self.model = model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-4, weight_decay=0.01, fused=True)

    def step(self, ids) -> dict:
        import torch

        start = time.perf_counter()
        self.model(input_ids=ids, labels=ids).loss.backward()
        fwd_bwd = time.perf_counter() - start
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        return {"fwd_bwd": fwd_bwd}


class InfinityTrainer:
    def __init__(self, model, cfg):
        import infinity

        self.model, self.opt = infinity.initialize(model, cfg)
        self.engine = self.opt.engine
        self.engine.telemetry()  # setup traffic is not a step's

    def step(self, ids) -> dict:
        start = time.perf_counter()
        self.model(input_ids=ids, labels=ids).loss.backward()
        fwd_bwd = time.perf_counter() - start
        self.opt.step()
        self.opt.zero_grad()
        tel = self.engine.telemetry()  # counters of this step only
        moved = {k: v for k, v in tel.items() if k.startswith("nvme_") and k.endswith("_bytes")}
        return {"fwd_bwd": fwd_bwd, "stall_s": tel["stall_s"], "bytes": tel["bytes"], "hit_rate": tel["prefetch_hit_rate"],
                "divergences": tel["trace_divergences"],
                "nvme_read": sum(v for k, v in moved.items() if k.endswith("_read_bytes")),
                "nvme_written": sum(v for k, v in moved.items() if k.endswith("_write_bytes"))}


def run_child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model = build_gpt(spec["layers"], spec["hidden"])
    if spec["kind"] == "plain":
        trainer = PlainTrainer(model)
    else:
        trainer = InfinityTrainer(model, infinity_config(spec["param"], spec["optim"], spec["prefetch"],
                                                         spec["nvme_path"]))
    gen = torch.Generator().manual_seed(0)
    steps = []
    try:
        for _ in range(1 + spec["steps"]):
            ids = torch.randint(VOCAB, (spec["micro_batch"], spec["seq_len"]), generator=gen)
            start = time.perf_counter()
            info = trainer.step(ids)
            info["time"] = time.perf_counter() - start
            steps.append(info)
    finally:
        if spec["kind"] != "plain":
            trainer.engine.close()
    return {"params": sum(p.numel() for p in model.parameters()), "steps": steps[1:]}


def spawn(spec: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"contender {spec['name']} failed with exit code {proc.returncode} (stderr above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ reporting


def med(r: dict, key: str) -> float:
    return statistics.median(s[key] for s in r["steps"])


def med_stall(r: dict, stage: str) -> float:
    return statistics.median(s["stall_s"].get(stage, 0.0) for s in r["steps"])


def load_note() -> str:
    return "load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + \
        f" on {os.cpu_count()} cores"


def run_all(specs: list, args) -> dict:
    out = {}
    for spec in specs:
        print(f"  running {spec['name']} ...", file=sys.stderr, flush=True)
        out[spec["name"]] = spawn(spec, args.timeout)
    return out


def study(args, nvme_root: str, bw: tuple[float, float]) -> None:
    layers, hidden = (2, 256) if args.quick else (args.layers, args.hidden)
    mb, seq = (1, 32) if args.quick else (args.study_batch, args.study_seq)
    base = {"layers": layers, "hidden": hidden, "micro_batch": mb, "seq_len": seq, "steps": args.steps,
            "threads": args.threads, "nvme_path": nvme_root}
    specs = [dict(base, name="compute only (no offload)", kind="infinity", param="none", optim="none",
                  prefetch=True)]
    for param, optim, label in (("nvme", "none", "params on NVMe"), ("nvme", "nvme", "params+optim on NVMe")):
        for prefetch in (False, True):
            specs.append(dict(base, name=f"{label}, prefetch {'on' if prefetch else 'off'}", kind="infinity",
                              param=param, optim=optim, prefetch=prefetch))
    print(f"\n(a) prefetch study: GPT-2 {layers} x {hidden}, vocab {VOCAB}, bf16, stage 3, one rank, micro-batch "
          f"{mb} x {seq} tokens, median of {args.steps} steps after 1 warm-up")
    res = run_all(specs, args)
    compute = med(res[specs[0]["name"]], "time")
    write_bw, read_bw = bw
    print(f"params: {res[specs[0]['name']]['params'] / 1e6:.1f} M; disk: read {read_bw / MiB:.0f} MiB/s, "
          f"write {write_bw / MiB:.0f} MiB/s")
    head = f"{'contender':<34} {'step s':>7} {'fwd+bwd':>7} {'hit':>5} " + " ".join(f"{s[:12]:>12}" for s in STAGES) + \
        f" {'NVMe rd MiB':>11} {'NVMe wr MiB':>11} {'bound s':>8} {'x bound':>8}"
    print("stall seconds per stage (median per step):")
    print(head)
    for spec in specs:
        r = res[spec["name"]]
        step = med(r, "time")
        rd, wr = med(r, "nvme_read"), med(r, "nvme_written")
        bound = max(compute, rd / read_bw + wr / write_bw)
        hit = statistics.median(s["hit_rate"] or 0.0 for s in r["steps"])
        print(f"{spec['name']:<34} {step:>7.3f} {med(r, 'fwd_bwd'):>7.3f} {hit:>5.2f} " +
              " ".join(f"{med_stall(r, s):>12.3f}" for s in STAGES) +
              f" {rd / MiB:>11.1f} {wr / MiB:>11.1f} {bound:>8.3f} {step / bound:>8.2f}")
    print("bytes per stage per step (MiB, median): ")
    for spec in specs[1:]:
        r = res[spec["name"]]
        keys = sorted({k for s in r["steps"] for k in s["bytes"]})
        print(f"  {spec['name']:<34} " + ", ".join(
            f"{k} {statistics.median(s['bytes'].get(k, 0) for s in r['steps']) / MiB:.1f}" for k in keys))
    for label in ("params on NVMe", "params+optim on NVMe"):
        off = med(res[f"{label}, prefetch off"], "time")
        on = med(res[f"{label}, prefetch on"], "time")
        print(f"{label}: prefetch on/off speedup {off / on:.2f}x (target >= 1.5x where I/O ~ compute)")


def headline(args, nvme_root: str) -> None:
    layers, hidden = (2, 256) if args.quick else (12, 768)
    mb, seq = (2, 64) if args.quick else (4, 256)
    base = {"layers": layers, "hidden": hidden, "micro_batch": mb, "seq_len": seq, "steps": args.steps,
            "threads": args.threads, "nvme_path": nvme_root}
    specs = [dict(base, name="plain PyTorch bf16", kind="plain"),
             dict(base, name="infinity NVMe, prefetch on", kind="infinity", param="nvme", optim="nvme",
                  prefetch=True)]
    print(f"\n(b) headline: GPT-2 {layers} x {hidden} (GPT2Config defaults), bf16, micro-batch {mb} x {seq} tokens, "
          f"one rank, median of {args.steps} steps after 1 warm-up")
    res = run_all(specs, args)
    plain = med(res[specs[0]["name"]], "time")
    print(f"params: {res[specs[0]['name']]['params'] / 1e6:.1f} M")
    for spec in specs:
        t = med(res[spec["name"]], "time")
        print(f"{spec['name']:<30} step {t:7.3f} s (fwd+bwd {med(res[spec['name']], 'fwd_bwd'):.3f} s)  "
              f"{mb * seq / t:8.0f} tok/s  {t / plain:5.2f}x plain")
    nv = res[specs[1]["name"]]
    print("  NVMe stalls per step: " + ", ".join(f"{s} {med_stall(nv, s):.3f}s" for s in STAGES) +
          f"; NVMe read {med(nv, 'nvme_read') / MiB:.0f} MiB, written {med(nv, 'nvme_written') / MiB:.0f} MiB")
    print(f"headline: NVMe-offloaded step / plain PyTorch step = {med(nv, 'time') / plain:.2f}x (target <= 1.15x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 2 x 256 GPT-2, tiny batches, 64 MiB disk probe")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per contender (median)")
    ap.add_argument("--layers", type=int, default=12, help="(a) model depth")
    ap.add_argument("--hidden", type=int, default=768, help="(a) model width (a multiple of 64)")
    ap.add_argument("--study-batch", type=int, default=1, help="(a) micro-batch")
    ap.add_argument("--study-seq", type=int, default=128, help="(a) tokens per sequence")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-study", action="store_true", help="only (b)")
    ap.add_argument("--skip-headline", action="store_true", help="only (a)")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir(), help="directory for the swap files")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if args.steps < 3:
        ap.error("--steps must be at least 3 (the figures are medians)")
    if args.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (heads of 64)")
    print(load_note() + " (before the run; the machine may be shared)")
    nvme_root = tempfile.mkdtemp(prefix="bench_prefetch_", dir=args.nvme_path)
    try:
        bw = disk_bandwidth(nvme_root, (64 if args.quick else 256) * MiB)
        print(f"disk under {args.nvme_path}: O_DIRECT write {bw[0] / MiB:.0f} MiB/s, read {bw[1] / MiB:.0f} MiB/s "
              f"(infinity.aio, {64 if args.quick else 256} MiB, median of 3)")
        if not args.skip_study:
            study(args, nvme_root, bw)
        if not args.skip_headline:
            headline(args, nvme_root)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    print(load_note() + " (after the run)")


if __name__ == "__main__":
    main()
