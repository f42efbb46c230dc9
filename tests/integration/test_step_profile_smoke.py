"""benchmarks/step_profile.py at its smoke size: every cell's record carries the step's parts,
the telemetry it reads and the run model's prediction (the GPU figures come from
scripts/gpu_check.sh's profile phase)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_step_profile_smoke_run_records_every_part(tmp_path):
    out = tmp_path / "profile.jsonl"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--smoke", "--out", str(out),
                           "--nvme-path", str(tmp_path), "--only", "1.5b/cpu/overlap,124m/nvme/no-prefetch"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["size"], r["offload"], r["variant"]) for r in records] == [("tiny", "cpu", "overlap"),
                                                                         ("tiny", "nvme", "no-prefetch")]
    for r in records:
        assert r["step_s"] > 0 and r["forward_s"] > 0 and r["backward_s"] > 0
        assert {"norm", "gradients_landing"} <= set(r["step_call_parts_s"])
        assert r["update_s"] > 0 and r["update_threads"] >= 1
        assert r["predicted_step_s"] > 0 and "adam" in r["run_model_terms_s"]
        assert r["loss_first"] == records[0]["loss_first"]  # the same model and first batch
    assert records[1]["gb_per_step"]["grad_offload"] > 0
