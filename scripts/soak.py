"""A long two-rank run with every state on NVMe, checkpoints, one kill -9 and a resume.

    python scripts/soak.py --steps 1000 --save-every 100 --kill-at 450

Runs ``python -m infinity.train`` (the embedded tiny GPT-2, ZeRO stage 3, parameters and
optimizer on NVMe, fp32) under torchrun with two ranks twice: once uninterrupted, and once with
rank 1 killed by SIGKILL when the telemetry reaches ``--kill-at``, then resumed with
``--resume auto`` from the last complete checkpoint. Prints, per ``--save-every`` steps of each
run, both ranks' open file descriptors, threads and RSS and the bytes under the swap
directory, and at the end whether the resumed run's losses equal the uninterrupted run's, step
by step, and whether those resources stayed flat. Exits 1 on a loss mismatch or on growth
beyond ``--growth-mib`` of RSS or growth of threads, of the swap directory, or of descriptors by more than 16.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from infinity.testing import dir_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_cmd(args, out, nvme, resume=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(args.port), "-m", "infinity.train", "--steps", str(args.steps), "--stage", "3", "--offload", "nvme",
           "--nvme-path", nvme, "--dtype", "fp32", "--output-dir", out, "--save-every", str(args.save_every),
           "--keep-last", "2", "--no-save"]
    return cmd + (["--resume", "auto"] if resume else [])


def _losses(out):
    """step -> loss, the last record of each step (a resumed run repeats the steps after its checkpoint)."""
    losses = {}
    path = os.path.join(out, "telemetry.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("event") == "step":
                    losses[rec["step"]] = rec["loss"]
    return losses


def _ranks(proc):
    """The rank processes under a torchrun process."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return sorted((p for p in kids if "infinity.train" in " ".join(p.cmdline())), key=lambda p: p.pid)


def _sample(ranks, nvme):
    rows = []
    for p in ranks:
        try:
            with p.oneshot():
                rows.append((p.num_fds(), p.num_threads(), p.memory_info().rss))
        except psutil.NoSuchProcess:
            pass
    return rows, dir_bytes(nvme)


def run(args, out, nvme, kill_at=None, resume=False):
    """One torchrun job; returns (exit code, samples by step, killed?)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_train_cmd(args, out, nvme, resume), env=env, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(out, "stderr.txt"), "a"), start_new_session=True)
    samples, killed, next_mark = {}, False, None
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit(f"soak: a run exceeded {args.timeout} s; see {out}/stderr.txt")
        steps = _losses(out)
        last = max(steps) if steps else 0
        mark = last // args.save_every * args.save_every
        if mark and mark != next_mark and mark not in samples:
            ranks = _ranks(proc)
            if len(ranks) == 2:  # a resumed run's telemetry holds the killed run's steps before its ranks start
                samples[mark] = _sample(ranks, nvme)
                next_mark = mark
        if kill_at is not None and not killed and last >= kill_at:
            ranks = _ranks(proc)
            if len(ranks) == 2:
                ranks[1].send_signal(signal.SIGKILL)
                killed = True
                print(f"  killed rank 1 (pid {ranks[1].pid}) at step {last}", flush=True)
        time.sleep(0.2)
    return proc.returncode, samples, killed


def _report(name, samples):
    print(f"{name}: per {len(samples) and min(samples)}-step mark: (fds, threads, RSS MiB) of each rank, swap MiB")
    for step in sorted(samples):
        rows, swap = samples[step]
        cells = ", ".join(f"({fds}, {threads}, {rss >> 20})" for fds, threads, rss in rows)
        print(f"  step {step:5d}: {cells}; swap {swap >> 20}")


FD_SLACK = 16  # descriptors open for a moment (a checkpoint's files, a probe) when a sample lands


def _grew(samples, growth_mib):
    """Growth from the second mark to the last (the first mark includes warm-up)."""
    marks = [samples[s][0] for s in sorted(samples) if len(samples[s][0]) == 2]
    if len(marks) < 3:
        return []
    first, last = marks[1], marks[-1]
    out = []
    swaps = [samples[s][1] for s in sorted(samples) if len(samples[s][0]) == 2]
    if swaps[-1] > swaps[1]:
        out.append(f"swap directory {swaps[1] >> 20} -> {swaps[-1] >> 20} MiB")
    for r in range(2):
        if last[r][0] > first[r][0] + FD_SLACK:
            out.append(f"rank {r}: file descriptors {first[r][0]} -> {last[r][0]}")
        if last[r][1] > first[r][1]:
            out.append(f"rank {r}: threads {first[r][1]} -> {last[r][1]}")
        if last[r][2] - first[r][2] > growth_mib << 20:
            out.append(f"rank {r}: RSS {first[r][2] >> 20} -> {last[r][2] >> 20} MiB")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--kill-at", type=int, default=450)
    ap.add_argument("--growth-mib", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--dir", help="where the runs write (default: a temporary directory, removed after)")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="infinity-soak-")
    try:
        outs = {k: os.path.join(base, k) for k in ("whole", "killed")}
        for k, d in outs.items():
            os.makedirs(os.path.join(d, "nvme"), exist_ok=True)
        t = time.monotonic()
        code, whole, _ = run(args, outs["whole"], os.path.join(outs["whole"], "nvme"))
        print(f"uninterrupted run: exit {code}, {time.monotonic() - t:.0f} s", flush=True)
        _report("uninterrupted", whole)
        t = time.monotonic()
        code1, first, killed = run(args, outs["killed"], os.path.join(outs["killed"], "nvme"), kill_at=args.kill_at)
        code2, second, _ = run(args, outs["killed"], os.path.join(outs["killed"], "nvme"), resume=True)
        print(f"killed run: exit {code1} (killed: {killed}), resumed: exit {code2}, {time.monotonic() - t:.0f} s")
        _report("resumed", second)
        a, b = _losses(outs["whole"]), _losses(outs["killed"])
        same = len(a) == args.steps and a == b
        diff = [s for s in a if a[s] != b.get(s)][:5]
        print(f"losses of {len(a)} steps identical to the uninterrupted run: {same}" +
              ("" if same else f" (first differing steps: {diff})"))
        growth = _grew(whole, args.growth_mib) + _grew(second, args.growth_mib)
        print("resources flat" if not growth else "growth: " + "; ".join(growth))
        ok = code == 0 and killed and code2 == 0 and same and not growth
        return 0 if ok else 1
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
