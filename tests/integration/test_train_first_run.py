"""``python -m infinity.train`` as a newcomer first runs it, under torchrun with one rank and
bf16 asked for on a CPU read as one without native bf16 (the level pinned: Note [CPU feature
level] in _runtime/_cpu_isa.py): no ``precision.dtype auto`` line, a warning that bf16 is slow
here, one line at the start saying where the run writes, the backend and losses readable by
scripts/gpu_check/train_one_rank.py, and a summary whose long labels keep a gap."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from infinity._runtime import _cpu_isa

ROOT = Path(__file__).resolve().parents[2]


def _reported(output: str) -> dict:
    spec = importlib.util.spec_from_file_location("train_one_rank", ROOT / "scripts" / "gpu_check" / "train_one_rank.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reported(output, failed=False)


def test_a_first_run_says_what_it_does(tmp_path):
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    level = "avx2" if "avx2" in _cpu_isa.levels_here() else "scalar"
    env = dict(os.environ, OMP_NUM_THREADS="1", INFINITY_CPU_ISA=level,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           "-m", "infinity.train", "--dtype", "bf16", "--steps", "2", "--nvme-path", str(nvme),
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "precision.dtype auto:" not in err  # auto is not in effect: --dtype bf16
    assert "precision.dtype bf16 is slow here" in err
    starts = [line for line in err.splitlines() if line.startswith("infinity.train writes")]
    assert len(starts) == 1, err[-3000:]
    assert f"swap files in {nvme}{os.sep}infinity-" in starts[0] and "(removed at exit)" in starts[0]
    assert f"telemetry to {out / 'telemetry.jsonl'}" in starts[0] and f"weights to {out / 'model'}" in starts[0]
    assert not (tmp_path / "telemetry.jsonl").exists()  # nothing lands in the working directory
    reported = _reported(proc.stdout + err)
    assert reported["backend"] == "gloo" and [r["step"] for r in reported["losses"]] == [2]
    assert f"SSD writes to {nvme}  " in proc.stdout
