"""benchmarks/step_profile.py at its smoke size: every cell's record, in the harness's one schema,
carries the step's parts, the telemetry it reads and the run model's prediction (the GPU figures
come from scripts/gpu_check.sh's profile phase)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import _harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # Note [smokes behind slow] in test_benchmarks_smoke.py
def test_the_step_profile_smoke_run_records_every_part(tmp_path):
    out = tmp_path / "profile.jsonl"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--smoke", "--out", str(out),
                           "--nvme-path", str(tmp_path), "--only", "1.5b/cpu/overlap,124m/nvme/no-prefetch",
                           "--trace", str(tmp_path / "traces")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(_harness.check_record(r) == [] for r in records), records
    assert [(r["contender"], r["size"]) for r in records] == [("infinity-cpu-overlap", "tiny"),
                                                              ("infinity-nvme-no-prefetch", "tiny")]
    for r in records:
        x = r["extra"]
        assert r["status"] == "ok" and r["step_s"] > 0 and x["forward_s"] > 0 and x["backward_s"] > 0
        assert {"norm", "gradients_landing"} <= set(x["step_call_parts_s"])
        assert x["update_s"] > 0 and x["update_threads"] >= 1
        assert x["predicted_step_s"] > 0 and "adam" in x["run_model_terms_s"]
        assert r["first_loss"] == records[0]["first_loss"]  # the same model and first batch
        # the profiled step's engine ranges, summed by kind (Note [profiler ranges] in _telemetry_counters.py), and
        # its trace written
        assert x["trace_ranges_s"]["all_gather"] > 0 and x["trace_ranges_s"]["update_chunk"] > 0, x
        assert set(x["trace_wait_s"]) <= set(x["stall_s"])
        trace = json.loads((tmp_path / "traces" / f"tiny-{x['offload']}-{x['variant']}.json").read_text())
        assert any(e.get("name", "").startswith("infinity::all_gather:") for e in trace["traceEvents"])
    assert records[1]["extra"]["gb_per_step"]["grad_offload"] > 0
