"""The benchmarks at their smoke size, as a user runs them (``python -m benchmarks.<name> --smoke``):
they finish, every line they print is a record of the harness's one schema, the contenders that
train for real here train the same model on the same batch (equal first losses in fp32), and each
benchmark compares ours with its reference in the run (a ratio record) where both run here."""
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


def run_smoke(module: str, tmp_path: Path, *more: str) -> tuple:
    out = tmp_path / "records.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(out), "--nvme-path", str(tmp_path),
                           "--timeout", "120", *more], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{module} --smoke failed:\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return printed, [json.loads(line) for line in out.read_text().splitlines()]


# Note [smokes behind slow]: a smoke is a child process per cell (each ~8 s of imports on 2 cores) and
# most benchmarks have four to six cells, so every smoke together was a third of the suite. The
# default run keeps the smokes of a few seconds; the rest, as long runs, are opt-in (-m slow):
#   pytest -m slow tests/integration/test_benchmarks_smoke.py tests/integration/test_step_profile_smoke.py
# which a change to benchmarks/ runs before it lands (CONTRIBUTING.md).
@pytest.mark.slow
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


# module -> (flags beside --smoke, a ratio it records here: (contender, vs) or None where its reference
# cannot run on a CPU machine without fio, a GPU or another checkout)
SMOKE = {
    "activation_offload": ((), ("offload-cpu", "offload-none")),
    "aio": ((), None),  # fio: the reference, often not installed
    "checkpoint": ((), ("save_checkpoint", "torch.save")),
    "checksums": (("--only", "crc32c,aio"), ("aio-checksums-on", "aio-checksums-off")),
    "compressed_states": ((), ("moments-int8", "moments-fp32")),
    "cpu_adam": ((), ("ours-fp32", "torch-fused-fp32")),
    "device_primitives": ((), None),  # the copies need CUDA; the disk has no reference
    "disk_mix": ((), ("at-once", "read-then-write")),
    "fetch_units": ((), ("module", "block")),
    "host_memory": (("--only", "plain,release"), ("release", "plain")),
    "large_model": ((), ("infinity-nvme", "disk-serial")),
    "load": (("--only", "load"), ("from_pretrained", "aio-read")),
    "param_bytes": ((), None),  # its reference is another checkout (--baseline)
    "prefetch": (("--only", "plain,infinity-nvme"), ("infinity-nvme", "plain")),
    "split_tiers": (("--only", "all-cpu,split-50,all-nvme"), ("split-50", "all-nvme")),
    "tiling": ((), ("factor-4", "factor-1")),
}

SLOW = {"checkpoint", "compressed_states", "fetch_units", "host_memory", "large_model", "load", "param_bytes", "prefetch",
        "split_tiers", "tiling"}  # Note [smokes behind slow]: 15-40 s each on 2 cores


def test_every_benchmark_has_a_smoke_test():
    modules = {p.stem for p in (ROOT / "benchmarks").glob("[!_]*.py")} - {"report", "peers", "step_profile"}
    assert modules == set(SMOKE)  # peers above, step_profile in test_step_profile_smoke.py


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(SMOKE)])
def test_benchmark_smoke(name, tmp_path):
    more, ratio = SMOKE[name]
    printed, records = run_smoke(f"benchmarks.{name}", tmp_path, *more)
    assert printed == records and records
    for record in records:
        assert _harness.check_record(record) == [], record
        assert record["bench"] == name
    results = [r for r in records if r["kind"] == "result"]
    assert any(r["status"] == "ok" for r in results) and not [r for r in results if r["status"] in ("error", "timeout")]
    if ratio is not None:
        assert any((r["contender"], r["vs"]) == ratio for r in records if r["kind"] == "ratio"), records


def test_one_size_parser():
    assert [parse_size(s) for s in ("4096", "3e9", "64K", "256MiB", "1.5g", "2GB", " 1 t ")] == \
        [4096, 3 * 10**9, 64 << 10, 256 << 20, 3 << 29, 2 << 30, 1 << 40]
    for bad in ("", "12 parsecs", "1.5x"):
        with pytest.raises(ValueError):
            parse_size(bad)
