"""Two-rank jobs end cleanly: Note [process group at exit] in _comm.py. A rank used to die
by SIGABRT after its training was done, now and then, because the process group outlived
``destroy_process_group()`` and its gloo threads were still releasing tensors while the
interpreter finalized. The cause is checked directly (no gloo thread is left once the job
destroys its group, whoever made the group) rather than by waiting for the rare abort;
scripts/stress_ranks.py runs hundreds of jobs under CPU load for the abort itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infinity.testing import free_port

RANK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_exit_rank.py")
ROOT = os.path.dirname(os.path.dirname(RANK))  # the ranks import this checkout's infinity


def run_job(stage: int, who: str, timeout: float = 120) -> list:
    """Both ranks' (exit code, report) of one job."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, RANK, str(stage), who], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            results.append((p.returncode, json.loads(lines[-1]) if lines else None, err[-3000:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    return results


def test_torch_distributed_nn_keeps_no_group_after_initialize():
    """The default arguments that captured a group (imported after it existed) are released."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn

    from infinity._runtime import _comm

    held = [n for n, f in vars(dist_nn).items()
            if any(isinstance(v, dist.ProcessGroup) for v in (getattr(f, "__defaults__", None) or ()))]
    assert held == []  # no group in this process: nothing to release
    assert _comm.release_captured_groups() == 0


@pytest.mark.parametrize("stage,who", [pytest.param(2, "infinity", marks=pytest.mark.slow), (3, "user")])
def test_no_gloo_thread_outlives_the_group(stage, who):
    for code, report, err in run_job(stage, who):
        assert code == 0, f"a rank exited with {code}:\n{err}"
        assert report is not None, err
        assert report["gloo_threads_after_destroy"] == [], (
            f"rank {report['rank']}: gloo threads alive after destroy_process_group: something still holds the group")
