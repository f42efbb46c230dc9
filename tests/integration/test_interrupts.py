"""SIGINT during a step ends the process cleanly (Note [interrupted step] in
infinity/_zero/_step_gate.py).

A real training script (tests/_interrupted_job.py: a tiny GPT-2 at stage 3, every state on
NVMe streamed chunk by chunk, the update overlapped with the next forward) gets a real SIGINT
in step 3: in a block's forward, in a block's backward, while the update runs on its own
thread and the main thread's next forward waits for it, or in ``optimizer.step()`` on the main
thread (the overlap off: the signal lands wherever the step is, in its reads or before them).
The swap file being read has every read stalled, so requests are in flight when the signal
lands. The script either lets the KeyboardInterrupt end it (``plain``) or closes the engine in a
``finally``, twice (``close``). The process must end by SIGINT, as Python ends on an uncaught
KeyboardInterrupt, within the hang guard, with only the main thread's traceback (no thread's,
no abort at exit); an update that was running stops at its next chunk (fewer reads of its swap
file than a whole step's, counted by the fault rule); the swap directory is gone; and the next
run on the same nvme_path loads the checkpoint saved after step 2 and trains steps 3 and 4 with
the losses of a run that was never interrupted, bit for bit (fp32, one rank).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_interrupted_job.py")
ROOT = os.path.dirname(os.path.dirname(JOB))
HANG_GUARD = 120  # seconds for a run, or for a process to end once signalled


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    return env


def _left(nvme) -> list:
    """What a run left under its nvme_path: nothing, the path itself gone where the run made it
    (Note [swap directories] in _swap.py)."""
    return os.listdir(nvme) if os.path.exists(nvme) else []


def _report(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out[-2000:]
    return json.loads(lines[-1])


def _run(mode: str, phase: str, tmp_path, ending: str = "plain", *, signal_at: bool = False):
    cmd = [sys.executable, JOB, mode, phase, str(tmp_path / "nvme"), str(tmp_path / "checkpoints"), ending]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        head = []
        if signal_at:
            for line in proc.stdout:  # the job says where it waits; the signal lands there
                head.append(line)
                if line.startswith("READY"):
                    proc.send_signal(signal.SIGINT)
                    break
        out, err = proc.communicate(timeout=HANG_GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return proc.returncode, "".join(head) + out, err


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    code, out, err = _run("whole", "none", tmp_path_factory.mktemp("whole"))
    assert code == 0, err[-3000:]
    return _report(out)


@pytest.mark.parametrize("phase,ending,resume", [  # by default both endings and a resume (backward: test_peer_failure)
    ("forward", "plain", True), pytest.param("backward", "close", False, marks=pytest.mark.slow),
    pytest.param("step", "plain", True, marks=pytest.mark.slow), ("step", "close", False), ("update", "close", False)])
def test_sigint_ends_the_process_cleanly_and_the_next_run_resumes(phase, ending, resume, whole, tmp_path):
    code, out, err = _run("interrupted", phase, tmp_path, ending, signal_at=True)
    assert f"READY {phase}" in out, err[-3000:]
    assert code == -signal.SIGINT, f"exit {code}:\n{err[-3000:]}"
    assert err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err[-3000:]
    for sign in ("Exception in thread", "terminate called", "Fatal Python error", "core dumped", "Aborted"):
        assert sign not in err, err[-3000:]
    report = _report(out)
    assert not report["waited_out"]
    assert sorted(report["losses"]) == (["1", "2"] if phase == "forward" else ["1", "2", "3"])
    if phase in ("step", "update"):  # stopped at its next chunk, not run to its end
        assert report["update_reads"] < whole["update_reads"], (report, whole)
    if phase == "step":  # its thread had begun: the signal came in the middle of the update
        assert report["update_reads"] >= 1, report
    assert _left(tmp_path / "nvme") == []  # this run's swap directory went with it
    if not resume:  # (two of the five, to keep the suite short)
        return
    code, out, err = _run("resume", "none", tmp_path)
    assert code == 0, err[-3000:]
    resumed = _report(out)["losses"]
    assert resumed == {s: whole["losses"][s] for s in ("3", "4")}
    assert _left(tmp_path / "nvme") == []
