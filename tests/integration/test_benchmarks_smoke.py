"""The benchmarks at their smoke size, as a user runs them (``python -m benchmarks.<name> --smoke``):
they finish, every line they print is a record of the harness's one schema, and the contenders
that train for real here train the same model on the same batch (equal first losses in fp32)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _harness, peers
from benchmarks._flags import parse_size

ROOT = Path(__file__).resolve().parents[2]
RUN_HERE = ("plain", "infinity-cpu", "infinity-nvme")  # every machine runs these for real


def run_smoke(module: str, tmp_path: Path) -> tuple:
    out = tmp_path / "records.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(out), "--nvme-path", str(tmp_path),
                           "--timeout", "120"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{module} --smoke failed:\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return printed, [json.loads(line) for line in out.read_text().splitlines()]


def test_peers_smoke(tmp_path):
    printed, records = run_smoke("benchmarks.peers", tmp_path)
    assert printed == records  # --out holds what stdout printed
    for record in records:
        assert _harness.check_record(record) == [], record
    results = {r["contender"]: r for r in records if r["kind"] == "result"}
    assert sorted(results) == sorted(peers.CONTENDERS) and all(r["size"] == "tiny" for r in results.values())
    for name, r in results.items():
        if name in RUN_HERE or r["status"] != "skipped":
            assert r["status"] == "ok", r
            assert r["steps"] == 2 and r["dtype"] == "fp32"
            assert 0 < r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
            assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
            assert r["host_peak_gib"] > 0
        else:
            assert r["error"], f"{name} is skipped without a reason"
    for name in RUN_HERE[1:]:
        assert abs(results[name]["first_loss"] - results["plain"]["first_loss"]) <= 1e-5, (name, results)
    ratios = {(r["contender"], r["vs"]) for r in records if r["kind"] == "ratio"}
    assert {("infinity-cpu", "plain"), ("infinity-nvme", "plain")} <= ratios


def test_one_size_parser():
    assert [parse_size(s) for s in ("4096", "3e9", "64K", "256MiB", "1.5g", "2GB", " 1 t ")] == \
        [4096, 3 * 10**9, 64 << 10, 256 << 20, 3 << 29, 2 << 30, 1 << 40]
    for bad in ("", "12 parsecs", "1.5x"):
        with pytest.raises(ValueError):
            parse_size(bad)
