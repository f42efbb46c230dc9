"""The main job with checkpoints: ``--save-every``, ``--resume auto`` and SIGTERM.

A run stopped after 3 steps and resumed to 6 ends with the same weights, bit for bit, as an
uninterrupted 6-step run (one rank, fp32), and logs the same losses for steps 4-6. SIGTERM
mid-run finishes the step, saves, exits 0 and says how to resume.
"""
import json
import os
import signal
import subprocess
import sys
import time

import torch
from test_train import TIMEOUT, _env, load_saved, read_jsonl, run_cli, run_clis, tiny_config, write_config


def _steps(out):
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(out, "telemetry.jsonl")) if r["event"] == "step"}


def test_resume_auto_matches_uninterrupted_run(tmp_path):
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=6))
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    a, b1 = run_clis(["--config", cfg, "--output-dir", whole],
                     ["--config", cfg, "--output-dir", split, "--steps", "3", "--save-every", "3", "--no-save"])
    first = _steps(split)
    b2 = run_cli(["--config", cfg, "--output-dir", split, "--resume", "auto", "--save-every", "2", "--keep-last", "1"])
    for proc in (a, b1, b2):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in b2.stderr and "after step 3" in b2.stderr
    ref, resumed = _steps(whole), _steps(split)
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [1, 2, 3, 4, 5, 6]  # telemetry appends
    assert [ref[s] for s in (1, 2, 3)] == [first[s] for s in (1, 2, 3)]
    assert [ref[s] for s in (4, 5, 6)] == [resumed[s] for s in (4, 5, 6)]  # bit for bit
    ours, theirs = load_saved(os.path.join(split, "model")), load_saved(os.path.join(whole, "model"))
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(p, q), name
    assert sorted(os.listdir(os.path.join(split, "checkpoints"))) == ["latest", "step6"]


def test_sigterm_saves_and_exits_zero(tmp_path):
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=10000, log_every=1))
    out = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "infinity.train", "--config", cfg, "--output-dir", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + TIMEOUT
        telemetry = os.path.join(out, "telemetry.jsonl")
        while not (os.path.exists(telemetry) and '"step"' in open(telemetry).read()):
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended or never started a step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout and "--resume auto" in stdout, stdout[-2000:]
    ck = os.path.join(out, "checkpoints")
    tag = open(os.path.join(ck, "latest")).read().strip()
    step = json.load(open(os.path.join(ck, tag, "manifest.json")))["step"]
    assert tag == f"step{step}" and step >= 1
    again = run_cli(["--config", cfg, "--output-dir", out, "--resume", "auto", "--steps", str(step + 1), "--no-save"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"after step {step}" in again.stderr


def test_save_async_resumes_like_blocking_saves(tmp_path):
    """--save-async: each save goes on while the next steps run; the run, and a resume from
    its checkpoint, log the same losses as with blocking saves."""
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=6))
    sync_out, async_out = str(tmp_path / "sync"), str(tmp_path / "async")
    a, b = run_clis(["--config", cfg, "--output-dir", sync_out, "--steps", "4", "--save-every", "2", "--no-save"],
                    ["--config", cfg, "--output-dir", async_out, "--steps", "4", "--save-every", "2", "--save-async",
                     "--keep-last", "1", "--no-save"])
    for proc in (a, b):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(sync_out) == _steps(async_out)
    assert sorted(os.listdir(os.path.join(async_out, "checkpoints"))) == ["latest", "step4"]
    c, d = run_clis(["--config", cfg, "--output-dir", async_out, "--resume", "auto", "--no-save"],
                    ["--config", cfg, "--output-dir", sync_out, "--resume", "auto", "--no-save"])
    for proc in (c, d):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after step 4" in c.stderr
    assert _steps(sync_out) == _steps(async_out)
