"""A trillion parameters planned by the engine itself, on the two nodes of the docs, each in a
process of its own: ``python -m infinity.estimate --plan`` for a 1T decoder (128 layers x 25,600
hidden) on a DGX-2 (16 ranks, 8 drives; Llama, tiled 8 ways: 32 GB GPUs) and on a DGX H100
(8 ranks, 8 drives; GPT-2). Prints each plan, then the wall time and peak RSS of each process.

    python scripts/plan_trillion.py [--json]
"""
import argparse
import os
import subprocess
import sys
import time

RUNS = {
    "dgx2": ["--hardware", "dgx2", "--layers", "128", "--hidden", "25600", "--arch", "llama", "--tiling-factor", "8"],
    "h100x8": ["--hardware", "h100x8", "--layers", "128", "--hidden", "25600", "--arch", "gpt2"],
}


def run(args):
    """(output, wall seconds, peak RSS bytes) of ``python -m infinity.estimate --plan ARGS``."""
    began = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "infinity.estimate", "--plan", *args], stdout=subprocess.PIPE,
                             text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the plan {' '.join(args)} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return out, wall, usage.ru_maxrss * 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print each plan as JSON")
    args = p.parse_args()
    figures = []
    for name, flags in RUNS.items():
        out, wall, rss = run(flags + (["--json"] if args.json else []))
        print(f"$ python -m infinity.estimate --plan {' '.join(flags)}\n{out}")
        figures.append((name, wall, rss))
    for name, wall, rss in figures:
        print(f"{name}: {wall:.1f} s wall, peak RSS {rss / 2**30:.2f} GiB (the whole process: interpreter, torch, "
              f"transformers, the model on the meta device)")


if __name__ == "__main__":
    main()
