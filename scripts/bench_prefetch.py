"""Benchmark of the trace-based prefetcher, and the headline against plain PyTorch.

Both parts compute in bf16, as the issue asks, where the CPU multiplies bf16 natively; on a
CPU without native bf16 (torch's reference bf16 matmul is tens of times slower than fp32
there) ``--dtype auto`` measures both contenders in fp32 and says so.

(a) prefetch study: stage 3, parameters on NVMe with the optimizer states in host memory
    (and separately parameters and optimizer states on NVMe), prefetch off vs on, beside the
    compute-only step (stage 3, no offload) and the disk bandwidth measured in the same run
    with infinity.aio (O_DIRECT write then read of a 256 MiB file). Prints step time, stall
    per stage, bytes moved per step, the on/off speedup and the step time against its bound
    max(compute-only step, NVMe read bytes / read bandwidth + write bytes / write bandwidth).
    The default shape (GPT-2 124M, 1 x 16 tokens) makes the parameter I/O of a step about as
    long as its computation; both are printed side by side.

Before both, the script measures the disk (O_DIRECT bandwidth) and how far this machine runs
disk I/O beside computation (``machine_overlap``); (a) and (b) print, beside the issue's bound,
an estimate of the step the machine allows at that overlap.

(b) headline: Hugging Face GPT-2 124M (GPT2Config defaults), micro-batch 4 x 256 tokens, one
    rank, parameters and optimizer states on NVMe (prefetch on), against plain PyTorch training
    of the same model (bf16: bf16 model, fp32 master weights, fused AdamW, clipping; fp32:
    AdamW on the parameters, clipping).

Note [interleaved rounds]: the machine drifts (the same step varies by a third between runs
minutes apart), so contenders are not run one after the other. Each is a persistent child
process with its own memory and threads (forked from a server that imported torch, transformers
and infinity once) driven over a pipe; after one warm-up step each (the step that records the
trace), the parent runs --rounds rounds, and in each round asks every contender in turn for
--block timed steps, rotating which goes first. Only one child computes at a time. Every block
measures the steady state: it starts with one untimed lead-in step and ends by joining
infinity's overlapped optimizer step (a background thread that runs during the next forward)
with ``wait_step()``, untimed, so it never runs during another contender's block. Each timed
step therefore carries exactly one optimizer step's cost: its own step() call plus the part of
the previous step's background update it waited for or competed with, as in a long run. A
block's time is the mean of its timed steps; ratios are taken within a round and the reported
ratio is the median over rounds.

    python scripts/bench_prefetch.py --quick
    python scripts/bench_prefetch.py [--rounds 4 --block 2] [--study-batch 1 --study-seq 16] [--nvme-path DIR]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from benchmarks import _models, _trainers  # noqa: E402 - after the path insert

MiB = 2**20
VOCAB = _models.VOCAB
STAGES = ("nvme_read", "host_to_device", "all_gather", "reduce_scatter", "grad_offload", "optimizer_io")


def infinity_config(param: str, optim: str, prefetch: bool, nvme_path: str, dtype: str,
                    gradients: str = "auto") -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": param, "nvme_path": nvme_path},
                     "offload_optimizer": {"device": optim, "nvme_path": nvme_path, "gradients": gradients},
                     "prefetch": {"enabled": prefetch}},
            "precision": {"dtype": dtype}, "optimizer": {"lr": 1e-4}, "gradient_clipping": 1.0}


def choose_dtype(requested: str) -> str:
    """``auto``: bf16 (the issue's setting) where this CPU multiplies bf16 matrices at least
    half as fast as fp32; otherwise fp32, said out loud. CPUs without native bf16 (no
    avx512_bf16 / AMX) run torch's bf16 matmul on a reference path tens of times slower,
    which would make both contenders minutes per step and hide every overhead."""
    if requested != "auto":
        return requested
    import torch

    def seconds(dtype) -> float:
        a, b = torch.randn(256, 768, dtype=dtype), torch.randn(768, 768, dtype=dtype)
        torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b)
        return time.perf_counter() - start

    slowdown = seconds(torch.bfloat16) / seconds(torch.float32)
    if slowdown <= 2.0:
        return "bf16"
    print(f"note: bf16 matmul is {slowdown:.0f}x slower than fp32 on this CPU (no native bf16); measuring in fp32 "
          f"(--dtype bf16 forces it)")
    return "fp32"


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


def machine_overlap(directory: str, nbytes: int, threads: int, repeats: int = 3) -> dict:
    """How far this machine runs computation and disk I/O at the same time: a matmul loop on
    ``threads`` threads and an O_DIRECT write then read of ``nbytes`` through infinity.aio on
    a background thread, timed alone and together (medians of ``repeats``). ``overlap`` =
    (sum of the two alone - together) / the shorter alone: 1 when they run fully side by
    side, 0 when together takes as long as one after the other. The loop is sized to take
    about as long as the I/O. A virtual machine whose host charges the guest's CPUs for its
    disk I/O (CPU steal time) slows the loop while the I/O runs; no prefetcher can then hide
    more than this fraction of the I/O behind computation."""
    import threading

    import torch

    from infinity.aio import AsyncIO, aligned_empty

    torch.set_num_threads(threads)
    path = os.path.join(directory, "overlap_probe.bin")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.fill_(3)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def io(aio) -> None:
        aio.pwrite(buf, path, 0)
        aio.wait()
        aio.pread(buf, path, 0)
        aio.wait()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    try:
        with AsyncIO() as aio:
            io(aio)  # the file exists, the handle is warm
            t_io = timed(lambda: io(aio))
            t_mm = timed(lambda: [torch.mm(a, b) for _ in range(8)]) / 8
            iters = max(1, round(t_io / t_mm))

            def matmuls() -> None:
                for _ in range(iters):
                    torch.mm(a, b)

            def together() -> None:
                t = threading.Thread(target=io, args=(aio,))
                t.start()
                matmuls()
                t.join()

            runs = [(timed(matmuls), timed(lambda: io(aio)), timed(together)) for _ in range(repeats)]
    finally:
        os.remove(path)
    compute, disk, both = (statistics.median(r[i] for r in runs) for i in range(3))
    overlap = (compute + disk - both) / min(compute, disk)
    return {"compute": compute, "io": disk, "together": both, "overlap": max(0.0, min(1.0, overlap))}


def achievable(compute: float, io: float, overlap: float) -> float:
    """The step time if the I/O ran beside the computation as far as this machine allows."""
    return max(compute, io) + (1.0 - overlap) * min(compute, io)


# ------------------------------------------------------------------ the contenders (child side)


class PlainTrainer:
    """The reference (benchmarks/_trainers.py's PlainTrainer on the CPU): the model in the
    compute dtype, fp32 master weights (the parameters themselves in fp32), fused torch AdamW,
    gradient clipping."""

    def __init__(self, model, dtype: str):
        import torch

        self.trainer = _trainers.PlainTrainer(model, torch.device("cpu"), dtype)

    def step(self, ids) -> dict:
        fwd_bwd, update = _trainers.timed_parts(self.trainer, ids)
        return {"time": fwd_bwd + update, "fwd_bwd": fwd_bwd}

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class InfinityTrainer:
    def __init__(self, model, cfg):
        self.trainer = _trainers.InfinityTrainer(model, cfg)
        self.trainer.telemetry()  # setup traffic is not a step's

    def settle(self) -> None:
        self.trainer.finish()  # see Note [interleaved rounds]

    def step(self, ids) -> dict:
        fwd_bwd, update = _trainers.timed_parts(self.trainer, ids)
        tel = self.trainer.telemetry()  # counters since the previous step's call
        moved = {k: v for k, v in tel.items() if k.startswith("nvme_") and k.endswith("_bytes")}
        return {"time": fwd_bwd + update, "fwd_bwd": fwd_bwd, "stall_s": tel["stall_s"], "bytes": tel["bytes"],
                "hit_rate": tel["prefetch_hit_rate"], "divergences": tel["trace_divergences"],
                "nvme_read": sum(v for k, v in moved.items() if k.endswith("_read_bytes")),
                "nvme_written": sum(v for k, v in moved.items() if k.endswith("_write_bytes"))}

    def close(self) -> None:
        self.trainer.close()


def serve(spec: dict, conn) -> None:
    """Child main loop: build the contender, then answer each command sent over ``conn``."""
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model = _models.build(_models.Shape.of(spec["layers"], spec["hidden"]))
    if spec["kind"] == "plain":
        trainer = PlainTrainer(model, spec["dtype"])
    else:
        trainer = InfinityTrainer(model, infinity_config(spec["param"], spec["optim"], spec["prefetch"],
                                                         spec["nvme_path"], spec["dtype"], spec["gradients"]))
    gen = torch.Generator().manual_seed(0)  # every contender sees the same batches in the same order
    conn.send({"params": sum(p.numel() for p in model.parameters())})
    try:
        while (n := conn.recv()) != 0:  # timed steps to run after a lead-in step (-n: no lead-in); 0 closes
            ids = [torch.randint(VOCAB, (spec["micro_batch"], spec["seq_len"]), generator=gen)
                   for _ in range(abs(n) + (n > 0))]
            out = [trainer.step(x) for x in ids]
            trainer.settle()  # untimed: nothing of this contender runs during another's block
            conn.send(out[1:] if n > 0 else out)
    finally:
        trainer.close()
    conn.send("closed")


# ------------------------------------------------------------------ driving the contenders (parent side)


def fork_context():
    """Children forked from one server that imported torch, transformers and infinity once: a
    fresh interpreter per contender would pay those imports (~5 s of CPU) each."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.models.gpt2.modeling_gpt2", "infinity"])
    return ctx


class Contender:
    """A persistent child process running one contender, driven over a pipe."""

    def __init__(self, ctx, spec: dict, timeout: float):
        self.spec, self.name, self.timeout = spec, spec["name"], timeout
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(spec, child_conn), name=spec["name"])
        self.proc.start()
        child_conn.close()
        self.params = None
        self.warmup: list = []
        self.blocks: list = []  # per round, the steps of this contender's block

    def recv(self):
        try:
            if self.conn.poll(self.timeout):
                return self.conn.recv()
            why = f"sent nothing for {self.timeout:.0f} s"
        except EOFError:
            self.proc.join(5)
            why = f"exited with code {self.proc.exitcode}"
        self.proc.kill()
        raise RuntimeError(f"contender {self.name!r} {why} (its stderr is above)")

    def started(self) -> None:
        self.params = self.recv()["params"]

    def run(self, n: int) -> list:
        self.conn.send(n)
        return self.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(0)
                self.recv()
            except (OSError, RuntimeError):
                pass
            self.proc.join(60)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.conn.close()

    # results

    def steps(self) -> list:
        return [s for block in self.blocks for s in block]

    def block_time(self, r: int) -> float:
        return statistics.mean(s["time"] for s in self.blocks[r])

    def step_time(self) -> float:
        """Median over rounds of the block means (steady-state steps, Note [interleaved rounds])."""
        return statistics.median(self.block_time(r) for r in range(len(self.blocks)))

    def med(self, key: str) -> float:
        return statistics.median(s[key] for s in self.steps())

    def med_stall(self, stage: str) -> float:
        return statistics.median(s["stall_s"].get(stage, 0.0) for s in self.steps())

    def med_hit(self) -> float:
        return statistics.median(s["hit_rate"] or 0.0 for s in self.steps())


def interleaved(specs: list, args) -> dict:
    """Contenders by name after warm-up and --rounds rounds of --block steps each (Note [interleaved rounds])."""
    ctx = fork_context()
    contenders = [Contender(ctx, spec, args.timeout) for spec in specs]
    try:
        for c in contenders:
            c.started()
        print(f"  {len(contenders)} contenders started; warm-up", file=sys.stderr, flush=True)
        for c in contenders:
            c.warmup = c.run(-1)
        for r in range(args.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                c.blocks.append(c.run(args.block))
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{c.name} {c.block_time(r):.3f}s" for c in contenders) + f" (load {os.getloadavg()[0]:.1f})",
                file=sys.stderr, flush=True)
    finally:
        for c in contenders:
            c.close()
    return {c.name: c for c in contenders}


def round_ratios(num: Contender, den: Contender) -> list:
    return [num.block_time(r) / den.block_time(r) for r in range(len(num.blocks))]


def ratio_note(ratios: list) -> str:
    return f"{statistics.median(ratios):.2f}x (median of {len(ratios)} interleaved rounds; " \
        f"range {min(ratios):.2f}-{max(ratios):.2f})"


# ------------------------------------------------------------------ reporting


def load_note() -> str:
    return "load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + \
        f" on {os.cpu_count()} cores"


def rounds_note(args) -> str:
    return (f"1 warm-up step each, then {args.rounds} interleaved rounds of 1 lead-in + {args.block} timed steps "
            f"per contender (steady state)")


def study(args, nvme_root: str, bw: tuple[float, float], overlap: float) -> None:
    layers, hidden = (2, 256) if args.quick else (args.layers, args.hidden)
    mb, seq = (1, 16) if args.quick else (args.study_batch, args.study_seq)
    base = {"layers": layers, "hidden": hidden, "micro_batch": mb, "seq_len": seq, "threads": args.threads,
            "nvme_path": nvme_root, "kind": "infinity", "dtype": args.dtype, "gradients": args.gradients}
    specs = [dict(base, name="compute only (no offload)", param="none", optim="none", prefetch=True)]
    for param, optim, label in (("nvme", "cpu", "params on NVMe"), ("nvme", "nvme", "params+optim on NVMe")):
        for prefetch in (False, True):
            specs.append(dict(base, name=f"{label}, prefetch {'on' if prefetch else 'off'}", param=param,
                              optim=optim, prefetch=prefetch))
    print(f"\n(a) prefetch study: GPT-2 {layers} x {hidden}, vocab {VOCAB}, {args.dtype}, stage 3, one rank, micro-batch "
          f"{mb} x {seq} tokens; gradient shards of the NVMe optimizer tier: {args.gradients}; {rounds_note(args)}")
    res = interleaved(specs, args)
    first = res[specs[0]["name"]]
    compute = first.step_time()
    write_bw, read_bw = bw
    print(f"params: {first.params / 1e6:.1f} M; disk: read {read_bw / MiB:.0f} MiB/s, write {write_bw / MiB:.0f} MiB/s")
    head = f"{'contender':<34} {'step s':>7} {'fwd+bwd':>7} {'hit':>5} " + " ".join(f"{s[:12]:>12}" for s in STAGES) + \
        f" {'NVMe rd MiB':>11} {'NVMe wr MiB':>11} {'I/O s':>7} {'bound s':>8} {'x bound':>8} {'machine s':>9} {'x machine':>9}"
    print("step time (median of block means) and stall seconds per stage (medians per step); bound = max(compute-only "
          "step, I/O s); machine = estimate with the I/O beside the computation only as far as the machine overlap "
          "allows:")
    print(head)
    for spec in specs:
        c = res[spec["name"]]
        step = c.step_time()
        rd, wr = c.med("nvme_read"), c.med("nvme_written")
        io = rd / read_bw + wr / write_bw
        bound = max(compute, io)
        print(f"{spec['name']:<34} {step:>7.3f} {c.med('fwd_bwd'):>7.3f} {c.med_hit():>5.2f} " +
              " ".join(f"{c.med_stall(s):>12.3f}" for s in STAGES) +
              f" {rd / MiB:>11.1f} {wr / MiB:>11.1f} {io:>7.3f} {bound:>8.3f} {step / bound:>8.2f}"
              f" {achievable(compute, io, overlap):>9.3f} {step / achievable(compute, io, overlap):>9.2f}")
    print("bytes per stage per step (MiB, median): ")
    for spec in specs[1:]:
        steps = res[spec["name"]].steps()
        keys = sorted({k for s in steps for k in s["bytes"]})
        print(f"  {spec['name']:<34} " + ", ".join(
            f"{k} {statistics.median(s['bytes'].get(k, 0) for s in steps) / MiB:.1f}" for k in keys))
    for label in ("params on NVMe", "params+optim on NVMe"):
        off, on = res[f"{label}, prefetch off"], res[f"{label}, prefetch on"]
        io = off.med("nvme_read") / read_bw + off.med("nvme_written") / write_bw
        ceiling = off.step_time() / compute  # no prefetcher makes a step faster than the compute-only step
        print(f"{label}: compute-only step {compute:.3f} s vs its NVMe I/O {io:.3f} s per step "
              f"(bytes / measured bandwidth, I/O / compute {io / compute:.2f}); prefetch on/off speedup "
              f"{ratio_note(round_ratios(off, on))} (target >= 1.5x where I/O ~ compute); ceiling {ceiling:.2f}x (prefetch-off "
              f"step / compute-only step: all of its I/O hidden)")


def headline(args, nvme_root: str, bw: tuple[float, float], overlap: float) -> None:
    layers, hidden = (2, 256) if args.quick else (12, 768)
    mb, seq = (2, 64) if args.quick else (4, 256)
    base = {"layers": layers, "hidden": hidden, "micro_batch": mb, "seq_len": seq, "threads": args.threads,
            "nvme_path": nvme_root, "dtype": args.dtype, "gradients": args.gradients}
    specs = [dict(base, name=f"plain PyTorch {args.dtype}", kind="plain"),
             dict(base, name="infinity NVMe, prefetch on", kind="infinity", param="nvme", optim="nvme",
                  prefetch=True)]
    print(f"\n(b) headline: GPT-2 {layers} x {hidden} (GPT2Config defaults), {args.dtype}, micro-batch {mb} x {seq} tokens, "
          f"one rank; gradient shards: zero.offload_optimizer.gradients={args.gradients}; {rounds_note(args)}")
    res = interleaved(specs, args)
    plain, nv = res[specs[0]["name"]], res[specs[1]["name"]]
    print(f"params: {plain.params / 1e6:.1f} M")
    for c in (plain, nv):
        t = c.step_time()
        blocks = [c.block_time(r) for r in range(args.rounds)]
        print(f"{c.name:<30} step {t:7.3f} s (fwd+bwd {c.med('fwd_bwd'):.3f} s)  {mb * seq / t:8.0f} tok/s; "
              f"per-round block means " + " ".join(f"{b:.3f}" for b in blocks))
    print("  NVMe stalls per step (median): " + ", ".join(f"{s} {nv.med_stall(s):.3f}s" for s in STAGES) +
          f"; NVMe read {nv.med('nvme_read') / MiB:.0f} MiB, written {nv.med('nvme_written') / MiB:.0f} MiB; "
          f"prefetch hit rate {nv.med_hit():.2f}, trace divergences {sum(s['divergences'] for s in nv.steps())}")
    io = nv.med("nvme_read") / bw[1] + nv.med("nvme_written") / bw[0]
    allowed = achievable(plain.step_time(), io, overlap)
    print(f"  NVMe I/O per step {io:.3f} s (bytes / measured bandwidth, reads and writes one after the other); "
          f"estimate of the step this machine allows at its overlap ({overlap:.2f}): {allowed:.3f} s = "
          f"{allowed / plain.step_time():.2f}x plain (rough: the disk reads and writes at once, and the probe's "
          f"matmuls are not this model's mix)")
    ratios = round_ratios(nv, plain)
    print("  per-round ratios: " + " ".join(f"{x:.2f}" for x in ratios))
    print(f"headline: NVMe-offloaded step / plain PyTorch step = {statistics.median(ratios):.2f}x "
          f"(median of {len(ratios)} interleaved rounds; range {min(ratios):.2f}-{max(ratios):.2f}; target <= 1.15x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: a 2 x 256 GPT-2, tiny batches, 64 MiB disk "
                    "probe, 3 rounds of 1 step")
    ap.add_argument("--rounds", type=int, help="interleaved rounds, the ratios are medians over them (default 4, "
                    "3 with --quick)")
    ap.add_argument("--block", type=int, help="steps per contender per round (default 2, 1 with --quick)")
    ap.add_argument("--layers", type=int, default=12, help="(a) model depth")
    ap.add_argument("--hidden", type=int, default=768, help="(a) model width (a multiple of 64)")
    ap.add_argument("--study-batch", type=int, default=1, help="(a) micro-batch")
    ap.add_argument("--study-seq", type=int, default=16, help="(a) tokens per sequence")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="compute dtype of both contenders; auto = bf16 unless this CPU lacks native bf16 matmul")
    ap.add_argument("--gradients", choices=("auto", "cpu", "nvme"), default="auto",
                    help="zero.offload_optimizer.gradients of the NVMe optimizer tier (auto: host memory when they fit)")
    ap.add_argument("--skip-study", action="store_true", help="only (b)")
    ap.add_argument("--skip-headline", action="store_true", help="only (a)")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir(), help="directory for the swap files")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds to wait for any one reply of a contender")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 3 if args.quick else 4
    if args.block is None:
        args.block = 1 if args.quick else 2
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (the ratios are medians over rounds)")
    if args.block < 1:
        ap.error("--block must be at least 1")
    if args.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (heads of 64)")
    print(load_note() + " (before the run; the machine may be shared)")
    args.dtype = choose_dtype(args.dtype)
    nvme_root = tempfile.mkdtemp(prefix="bench_prefetch_", dir=args.nvme_path)
    try:
        bw = disk_bandwidth(nvme_root, (64 if args.quick else 256) * MiB)
        print(f"disk under {args.nvme_path}: O_DIRECT write {bw[0] / MiB:.0f} MiB/s, read {bw[1] / MiB:.0f} MiB/s "
              f"(infinity.aio, {64 if args.quick else 256} MiB, median of 3)")
        ov = machine_overlap(nvme_root, (128 if args.quick else 1024) * MiB, args.threads)
        print(f"machine overlap: {ov['compute']:.3f} s of matmuls and {ov['io']:.3f} s of disk I/O (write + read of "
              f"{128 if args.quick else 1024} MiB) take {ov['together']:.3f} s together: overlap {ov['overlap']:.2f} "
              f"(1 = side by side, 0 = as if one after the other; medians of 3)")
        if not args.skip_study:
            study(args, nvme_root, bw, ov["overlap"])
        if not args.skip_headline:
            headline(args, nvme_root, bw, ov["overlap"])
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    print(load_note() + " (after the run)")


if __name__ == "__main__":
    main()
