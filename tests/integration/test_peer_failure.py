"""A dead or hung peer ends in an error naming the collective, within seconds (Note [comm
timeout] in _comm.py).

Two real gloo ranks, each its own process started like torchrun starts them (so infinity
makes the process group, bounded by ``comm.timeout``), train a tiny GPT-2 at ZeRO stage 3 or
stage 2; at the start of step 2's forward rank 1 either dies (``os._exit``) or hangs (sleeps).
Rank 0 must fail with CommTimeout: for a death within a few seconds saying rank 1 died, for a
hang after the configured 3 s timeout saying it timed out via ``comm.timeout``. Every
process has a wall-clock limit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infinity.testing import free_port

_RANK = r"""
import json, os, sys, time
import torch
sys.path.insert(0, os.environ["TESTS_DIR"])
from _configs import zero_config
from _models import batches, gpt2
import infinity

rank, fault, stage = int(os.environ["RANK"]), sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
cfg = zero_config(stage, lr=1e-3)
cfg["comm"] = {"timeout": 3}
model, opt = infinity.initialize(gpt2(seed=0), config=cfg)
step = {"n": 0}

def fault_here(module, args):
    if rank == 1 and step["n"] == 2:
        if fault == "die":
            os._exit(7)
        time.sleep(120)  # hung: the test kills it

model.transformer.h[1].register_forward_pre_hook(fault_here)
started = None
try:
    for ids in batches(3):
        step["n"] += 1
        started = time.monotonic()
        loss = model(input_ids=ids.chunk(2)[rank], labels=ids.chunk(2)[rank]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(json.dumps({"error": None}), flush=True)
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "step": step["n"],
                      "after_s": time.monotonic() - started}), flush=True)
    os._exit(1)
"""


def _run(fault: str, stage: int) -> dict:
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               TESTS_DIR=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, fault, str(stage)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"rank 0 reported nothing; stderr:\n{err[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_dead_peer_is_named_within_seconds(stage):
    report = _run("die", stage)
    assert report["error"] == "CommTimeout", report
    assert report["step"] == 2
    assert "rank 1 died" in report["message"] and "timed out" not in report["message"]
    assert report["message"].startswith("rank 0: ")  # then the collective's name
    assert report["after_s"] < 10, report


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hung_peer_ends_at_the_configured_timeout(stage):
    report = _run("hang", stage)
    assert report["error"] == "CommTimeout", report
    assert report["step"] == 2
    assert "timed out after 3s (comm.timeout)" in report["message"], report
    assert 2.5 < report["after_s"] < 20, report


def test_the_config_key_wins_over_the_variable(monkeypatch):
    from infinity._runtime import _comm
    from infinity.config import Config

    monkeypatch.setattr(_comm, "DEFAULT_TIMEOUT_S", 600.0)  # restored after the test: the setting is per process
    monkeypatch.setattr(_comm, "_TIMEOUT_SOURCE", "INFINITY_COMM_TIMEOUT")
    _comm.configure(Config())  # no key: the variable's value stays
    assert _comm.timeout_s() == 600.0
    _comm.configure(Config.from_dict({"comm": {"timeout": 7}}))
    assert _comm.timeout_s() == 7.0 and _comm._TIMEOUT_SOURCE == "comm.timeout"
    monkeypatch.setenv("INFINITY_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="INFINITY_COMM_TIMEOUT='soon'"):
        _comm._env_timeout()
