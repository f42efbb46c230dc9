"""The main job with checkpoints: ``--save-every``, ``--resume auto``, SIGTERM and SIGINT
(Note [preemption] in infinity/_checkpoint/_train.py).

A run stopped after 3 steps and resumed to 6 ends with the same weights, bit for bit, as an
uninterrupted 6-step run (one rank, fp32), and logs the same losses for steps 4-6. With
``--save-on-signal``, SIGTERM mid-run finishes the step, saves, exits 0 and says how to resume,
and the resumed run logs the losses of a run never stopped, bit for bit. Without it, SIGINT and
SIGTERM stop the job at once: exit 130 or 143, no traceback, the swap files removed, the last
complete checkpoint named and loaded by the next run.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
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


def _signalled(args, sig, ready):
    """Run the job, send ``sig`` once ``ready()``, and return (exit code, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "infinity.train"] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended or never started a step"
            time.sleep(0.2)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    return proc.returncode, stdout, stderr


def _stepped(out):
    telemetry = os.path.join(out, "telemetry.jsonl")
    return lambda: os.path.exists(telemetry) and '"step"' in open(telemetry).read()


def _latest(out) -> int:
    ck = os.path.join(out, "checkpoints")
    tag = open(os.path.join(ck, "latest")).read().strip()
    step = json.load(open(os.path.join(ck, tag, "manifest.json")))["step"]
    assert tag == f"step{step}" and step >= 1
    return step


def test_sigterm_saves_and_exits_zero(tmp_path):
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=10000, log_every=1))
    out = str(tmp_path / "run")
    code, stdout, stderr = _signalled(["--config", cfg, "--output-dir", out, "--save-on-signal"], signal.SIGTERM,
                                      _stepped(out))
    assert code == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout and "--resume auto" in stdout, stdout[-2000:]
    assert "not saved (stopped by SIGTERM" in stdout, stdout[-2000:]  # the weights: not for want of --output-dir
    step = _latest(out)
    first = _steps(out)
    assert sorted(first) == list(range(1, step + 1))  # the step in flight finished, then the job saved
    ref_out = str(tmp_path / "ref")
    again, ref = run_clis(["--config", cfg, "--output-dir", out, "--resume", "auto", "--steps", str(step + 2),
                           "--no-save"],
                          ["--config", cfg, "--output-dir", ref_out, "--steps", str(step + 2), "--no-save"])
    for proc in (again, ref):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"after step {step}" in again.stderr
    assert _steps(out) == _steps(ref_out)  # every loss, before the signal and after the resume, bit for bit


def test_sigterm_to_one_rank_of_two_saves_and_stops_both(tmp_path):
    """A signal may reach one rank only: the ranks agree on it at the step's end, each names it,
    saves its share of the checkpoint and skips the weights' export (a rank that exported alone
    would wait in gathers the other never issues: gloo aborts on the mismatch); both exit 0."""
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=10000, log_every=1))
    out = str(tmp_path / "run")
    procs, ends = _two_ranks(["--config", cfg, "--output-dir", out, "--save-on-signal"], out, signal.SIGTERM)
    for p, (_, stderr) in zip(procs, ends):
        assert p.returncode == 0 and "terminate called" not in stderr, stderr[-3000:]
    stdout = ends[0][0]
    assert "stopped by SIGTERM after step" in stdout and "not saved (stopped by SIGTERM" in stdout, stdout[-2000:]
    assert "Resume with: torchrun --nproc-per-node 2 -m infinity.train" in stdout, stdout[-2000:]
    assert not os.path.exists(os.path.join(out, "model"))
    assert sorted(_steps(out)) == list(range(1, _latest(out) + 1))


@pytest.mark.slow  # ~18 s: the flagless stop of one rank is test_a_signal_without_save_on_signal_stops_at_once's
def test_sigterm_to_one_rank_of_two_without_the_flag_stops_both(tmp_path):
    """Without ``--save-on-signal`` the signalled rank stops at once (exit 143); the other one
    learns it from the collective it waits in (the peer interrupted or gone) and exits 1 with a
    one-line message naming it, no traceback."""
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=10000, log_every=1))
    out = str(tmp_path / "run")
    procs, ends = _two_ranks(["--config", cfg, "--output-dir", out], out, signal.SIGTERM)
    assert procs[1].returncode == 143, ends[1][1][-3000:]
    stderr = ends[0][1]
    assert procs[0].returncode == 1 and "infinity.train: error: rank 0: " in stderr, stderr[-3000:]
    assert "rank 1" in stderr.split("infinity.train: error:")[1] and "Traceback" not in stderr, stderr[-3000:]


def _two_ranks(args, out, sig):
    """Two ranks of the job on this machine; ``sig`` to rank 1 once a step began; the processes
    and their (stdout, stderr)."""
    from infinity.testing import free_port

    env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-m", "infinity.train"] + args,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        deadline, ready = time.monotonic() + TIMEOUT, _stepped(out)
        while not ready():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no step began"
            time.sleep(0.2)
        procs[1].send_signal(sig)
        return procs, [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_save_on_signal_needs_an_output_dir(tmp_path):
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=1))
    proc = run_cli(["--config", cfg, "--save-on-signal"])
    assert proc.returncode == 2 and "--save-on-signal saves a checkpoint under --output-dir" in proc.stderr, proc.stderr


@pytest.mark.parametrize("sig,code", [pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),  # SIGINT: test_interrupts
                                      (signal.SIGTERM, 143)])
def test_a_signal_without_save_on_signal_stops_at_once(tmp_path, sig, code):
    cfg = write_config(tmp_path / "tiny.json", tiny_config(steps=10000, log_every=1))
    out, nvme = str(tmp_path / "run"), tmp_path / "nvme"
    args = ["--config", cfg, "--output-dir", out, "--save-every", "1", "--offload", "nvme", "--nvme-path", str(nvme),
            "--no-save"]
    code_, stdout, stderr = _signalled(args, sig, lambda: os.path.exists(os.path.join(out, "checkpoints", "latest")))
    assert code_ == code, stderr[-3000:]
    name = signal.Signals(sig).name
    assert f"stopped by {name} in step" in stderr and "without saving (--save-on-signal" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr[-3000:]
    assert not os.path.exists(nvme) or os.listdir(nvme) == []  # the swap files went with the job (and the
    # nvme_path it made: Note [swap directories] in _swap.py)
    step = _latest(out)
    assert f"the last complete checkpoint is {os.path.join(out, 'checkpoints', f'step{step}')}" in stderr
    if sig == signal.SIGTERM:  # the resume once (SIGINT's case)
        return
    again = run_cli(args[:-1] + ["--resume", "auto", "--steps", str(step + 1), "--no-save"])
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
