"""kill -9 at random moments of a loop of checkpoint saves; check what is left every time.

    python scripts/checkpoint_kill_loop.py --trials 20 [--dir DIR] [--seed S] [--async]

Each trial starts a child that trains a model with every state on NVMe and saves a
checkpoint after every step (keep_last=2); once it has saved at least once, the child gets
SIGKILL at a random moment (most land inside a save: a save takes most of a step's time).
Then, in this process: ``latest`` must name a checkpoint whose every file matches the
manifest, and that checkpoint must load into a fresh model. Prints ``K/K trials`` and exits
0 when every trial passed (Note [crash-safe commit] in infinity/_checkpoint/_save.py).
``--async``: the child saves with ``blocking=False`` (each save waits for the one before), so
most kills land while a save's thread writes or commits and the next step runs.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

DIM, DEPTH = 512, 8  # 2.1M parameters: ~34 MB per checkpoint, a save takes a good part of a step


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(DEPTH)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def config(nvme: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                     "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
            "precision": {"dtype": "fp32"}, "optimizer": {"lr": 1e-3}}


def child(directory: str, asynchronous: bool) -> None:
    import infinity

    torch.manual_seed(0)
    model, opt = infinity.initialize(Stack(), config(os.path.join(directory, "nvme")))
    x = torch.randn(4, DIM)
    first = True
    while True:
        model(x).backward()
        opt.step()
        opt.zero_grad()
        saved = infinity.save_checkpoint(os.path.join(directory, "ck"), model, opt, keep_last=2,
                                         blocking=not asynchronous)
        if first and asynchronous:
            saved.wait()  # the parent kills only once a checkpoint exists
        first = False
        print("saved", flush=True)


def check(directory: str) -> str:
    """'' when ``latest`` names a complete checkpoint that loads, else what is wrong."""
    import infinity
    from infinity.testing import verify_checkpoint

    ck = os.path.join(directory, "ck")
    with open(os.path.join(ck, "latest")) as f:
        tag = f.read().strip()
    manifest = verify_checkpoint(os.path.join(ck, tag))
    model, opt = infinity.initialize(Stack(), config(os.path.join(directory, "nvme")))
    try:
        infinity.load_checkpoint(ck, model, opt)
        step = opt.step_count(next(model.parameters()))  # every parameter steps at every step here
        if step != manifest["step"]:
            return f"loaded step {step}, the manifest of {tag} says {manifest['step']}"
    finally:
        infinity.close(model)
    return ""


def trial(directory: str, rng: random.Random, asynchronous: bool = False) -> tuple:
    """(what is wrong or '', whether the kill landed inside a save: a partial directory left)"""
    proc = subprocess.Popen([sys.executable, __file__, "--child", directory] + (["--async"] if asynchronous else []),
                            stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "saved":
            return f"the child exited with {proc.wait()} before its first save", False
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        proc.kill()
        proc.wait()
    leftovers = [n for n in os.listdir(os.path.join(directory, "ck")) if n.startswith(".tmp-")]
    try:
        problem = check(directory)
    except Exception as e:  # noqa: BLE001 - reported as the trial's failure
        problem = f"{type(e).__name__}: {e}"
    return problem and f"{problem} (partial saves left: {leftovers})", bool(leftovers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--dir", help="scratch directory (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async", dest="asynchronous", action="store_true", help="the child saves with blocking=False")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.asynchronous)
        return 0
    torch.set_num_threads(1)
    base = args.dir or tempfile.mkdtemp(prefix="infinity-kill-")
    rng = random.Random(args.seed)
    passed = inside = 0
    for t in range(args.trials):
        directory = os.path.join(base, f"trial{t}")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        problem, during_save = trial(directory, rng, args.asynchronous)
        print(f"trial {t + 1}: {'ok' if not problem else 'FAILED: ' + problem}"
              f"{' (killed during a save)' if during_save else ''}", flush=True)
        passed += not problem
        inside += during_save
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{passed}/{args.trials} trials left latest at a complete checkpoint that loads "
          f"({inside} killed during a save, the others between saves)")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
