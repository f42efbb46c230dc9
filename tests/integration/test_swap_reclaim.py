"""Swap directories that clean up after the dead (Note [swap directories] in _swap.py).

A real training job on NVMe is killed with SIGKILL mid-run: its run directory stays (nothing
in the process could remove it); the next job on the same nvme_path removes it, says how much
it reclaimed, and leaves the directory empty when it ends. The owner file's flock is what
decides: a directory whose owner file names a live pid but whose lock nobody holds is
reclaimed, one whose lock is held is not.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from infinity._offload._swap import OWNER, SwapDir, _owner_line, reclaim_stale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 258, "n_positions": 64}


def _job(tmp_path, nvme, steps, name):
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                    "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
           "precision": {"dtype": "fp32"},
           "train": {"model": TINY, "steps": steps, "seq_len": 32, "micro_batch_size": 2, "save": False,
                     "output_dir": str(tmp_path / name)}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    return [sys.executable, "-m", "infinity.train", "--config", str(path)], env


def _wait_for_a_step(telemetry, proc, limit=120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if telemetry.exists() and '"event": "step"' in telemetry.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"no step within {limit}s")


def test_a_killed_training_job_is_reclaimed_by_the_next(tmp_path):
    nvme = tmp_path / "nvme"
    cmd, env = _job(tmp_path, nvme, 100_000, "killed")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_a_step(tmp_path / "killed" / "telemetry.jsonl", proc)
        left = [n for n in os.listdir(nvme) if n.startswith("infinity-")]
        assert len(left) == 1
        stale = nvme / left[0]
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(stale) for f in fs)
        assert size > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert stale.exists()  # a SIGKILLed process removes nothing

    cmd, env = _job(tmp_path, nvme, 1, "next")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not stale.exists()
    assert f"reclaimed {size / (1 << 20):.1f} MiB ({size} bytes)" in done.stderr and left[0] in done.stderr
    assert os.listdir(nvme) == []  # and the second job removed its own


def test_the_lock_decides_not_the_pid(tmp_path):
    """An owner file naming this (live) process without its lock held is a dead owner's (the
    pid was reused); a directory whose lock is held stays."""
    held = SwapDir(str(tmp_path), rank=0)  # locked by this process
    orphan = tmp_path / "infinity-orphan" / "rank0"
    orphan.mkdir(parents=True)
    (orphan / OWNER).write_text(_owner_line(os.getpid()))  # a live pid, but no lock
    (orphan / "params.swp").write_bytes(b"\0" * 8192)
    removed = reclaim_stale(str(tmp_path))
    assert [os.path.basename(p) for p, _ in removed] == ["infinity-orphan"]
    assert os.path.isdir(held.path)
    held.remove()
    assert os.listdir(tmp_path) == []
