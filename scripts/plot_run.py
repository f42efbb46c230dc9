#!/usr/bin/env python3
"""Turn a run of ``python -m infinity.train`` into PNG plots.

    python scripts/plot_run.py RUN [--out DIR]

RUN is the run's output directory (holding telemetry.jsonl) or the JSON-lines file itself;
a file several runs appended to is plotted for its last run. Writes loss.png,
step_time.png (forward / backward / optimizer / other per step, stall on top) and
bandwidth.png (bytes per second of each tier and of the network) into DIR (default:
RUN's directory / plots). matplotlib is installed with pip when it is missing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from typing import Dict, List

EXIT_NO_MATPLOTLIB = 3


def load_matplotlib():
    """pyplot with the Agg backend; installs matplotlib with pip if it is missing."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print("plot_run: matplotlib is missing; installing it with pip", file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=False)
        importlib.invalidate_caches()
        if done.returncode != 0:
            raise ImportError("matplotlib is not installed and `pip install matplotlib` failed; "
                              "install it by hand to plot runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_run(path: str) -> List[dict]:
    """The step records of the last run in a telemetry file (or a run directory)."""
    if os.path.isdir(path):
        path = os.path.join(path, "telemetry.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no telemetry at {path!r}; give a run's output directory or its "
                                f"telemetry.jsonl")
    steps: List[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: not a JSON line") from None
            if record.get("event") == "start":
                steps = []
            elif record.get("event") == "step":
                steps.append(record)
    if not steps:
        raise ValueError(f"{path} holds no step records; did the run get past its first step?")
    return steps


def series(steps: List[dict], key: str) -> List[float]:
    return [float(r.get(key, 0.0) or 0.0) for r in steps]


def plot_loss(plt, steps: List[dict], out: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(series(steps, "step"), series(steps, "loss"), color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_step_time(plt, steps: List[dict], out: str) -> None:
    x = series(steps, "step")
    parts = {name: series(steps, f"{name}_s") for name in ("forward", "backward", "optimizer")}
    total = series(steps, "step_s")
    parts["other"] = [max(0.0, t - sum(p[i] for p in parts.values())) for i, t in enumerate(total)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.stackplot(x, *parts.values(), labels=list(parts), alpha=0.85)
    ax.plot(x, series(steps, "stall_s"), color="black", linestyle="--", label="stall (inside the above)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("step-time breakdown")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def bandwidth_series(steps: List[dict]) -> Dict[str, List[float]]:
    """Bytes/s per step for each tier and direction found in the records, and the network."""
    keys = sorted({k for r in steps for k in r if k.startswith("tier.") and k.endswith("_bytes")})
    out = {}
    step_s = [max(1e-12, v) for v in series(steps, "step_s")]
    for key in keys:
        _, tier, direction = key.split(".")
        out[f"{tier} {direction[:-6]}"] = [b / s for b, s in zip(series(steps, key), step_s)]
    out["network (collectives)"] = [b / s for b, s in zip(series(steps, "comm_bytes"), step_s)]
    return out


def plot_bandwidth(plt, steps: List[dict], out: str) -> None:
    x = series(steps, "step")
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in bandwidth_series(steps).items():
        ax.plot(x, [v / 1e6 for v in values], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("MB/s")
    ax.set_title("bandwidth per tier")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot a run of python -m infinity.train as PNGs.")
    p.add_argument("run", help="the run's output directory or its telemetry.jsonl")
    p.add_argument("--out", help="directory for the PNGs (default: <run dir>/plots)")
    args = p.parse_args(argv)
    try:
        steps = read_run(args.run)
    except (FileNotFoundError, ValueError) as err:
        print(f"plot_run: error: {err}", file=sys.stderr)
        return 2
    try:
        plt = load_matplotlib()
    except ImportError as err:
        print(f"plot_run: error: {err}", file=sys.stderr)
        return EXIT_NO_MATPLOTLIB
    run_dir = args.run if os.path.isdir(args.run) else os.path.dirname(os.path.abspath(args.run))
    out = args.out or os.path.join(run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    for name, fn in (("loss.png", plot_loss), ("step_time.png", plot_step_time), ("bandwidth.png", plot_bandwidth)):
        fn(plt, steps, os.path.join(out, name))
        print(os.path.join(out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
