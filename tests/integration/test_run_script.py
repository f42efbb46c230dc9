"""``bash scripts/run.sh``, the README's main job, on a user's environment: it installs only what the
job needs and only what is missing (never the test or developer tools, never an editable install
over the user's), and re-enters training within 2 s when nothing is missing.

Python is run through a wrapper that records each call and stands in for the two that would take
minutes (``-m pip`` and the training itself, ``-m infinity.train``); every other call, the check of
what is missing among them, runs the real interpreter."""
from __future__ import annotations

import os
import site
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = """#!/usr/bin/env bash
printf '%s %s\\n' "$(date +%s.%N)" "$*" >> "$RUN_LOG"
case " $* " in *" -m pip "*|*" -m infinity.train "*) exit 0;; esac
exec "$REAL_PYTHON" $PYTHON_FLAGS "$@"
"""


def _run(tmp_path: Path, env_extra: dict) -> tuple:
    wrapper = tmp_path / "python3"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(wrapper), "RUN_LOG": str(log), "REAL_PYTHON": sys.executable,
           "PYTHON_FLAGS": "", **env_extra}
    start = time.time()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run.sh"), "--steps", "1"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = [line.split(" ", 1) for line in log.read_text().splitlines()]
    return start, [(float(t), args) for t, args in calls], proc


def test_set_up_it_trains_at_once_and_installs_nothing(tmp_path):
    start, calls, _ = _run(tmp_path, {})
    pips = [args for _, args in calls if " -m pip " in f" {args} "]
    assert not pips, f"run.sh installed into a set-up environment: {pips}"
    train = [(t, args) for t, args in calls if "-m infinity.train" in args]
    assert train and train[-1][1].endswith("-m infinity.train --steps 1"), calls
    assert train[-1][0] - start < 2.0, f"run.sh took {train[-1][0] - start:.1f} s to start training"


def test_installs_only_what_the_job_lacks(tmp_path):
    """An environment with torch and the build's tools but neither infinity nor transformers: a site
    directory of its own (``python -S``: no other site-packages, no editable install's finder)."""
    own = tmp_path / "site"
    own.mkdir()
    have = ["torch", "cffi", "pybind11", "setuptools", "wheel", "pkg_resources", "_distutils_hack"]
    for base in site.getsitepackages():
        for name in os.listdir(base):
            if name.split("-")[0] in have or name.split(".")[0] in have:
                if not (own / name).exists():
                    (own / name).symlink_to(Path(base) / name)
    found = subprocess.run([sys.executable, "-S", "-P", str(ROOT / "scripts" / "_job_needs.py")],
                           env=dict(os.environ, PYTHONPATH=str(own)), capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["infinity", "transformers"]
    _, calls, _ = _run(tmp_path, {"PYTHONPATH": str(own), "PYTHON_FLAGS": "-S"})
    pips = [f" {args}".split(" -m pip ", 1)[1] for _, args in calls if " -m pip " in f" {args} "]
    assert pips == ["install -q --no-build-isolation .", "install -q transformers>=5"], pips
    for tool in ("pytest", "ruff", "mypy", "peft", "trl", "datasets", "-e ", "constraints"):
        assert not any(tool in args for args in pips), (tool, pips)


@pytest.mark.parametrize("script", ["run.sh"])
def test_run_sh_leaves_the_developer_set_up_to_setup_env(script):
    text = (ROOT / "scripts" / script).read_text()
    assert "setup_env.sh" not in text.split("\nset -euo pipefail", 1)[1]
    assert "setup_env.sh" in (ROOT / "scripts" / "test.sh").read_text()


def test_a_torch_outside_the_supported_range_is_refused_not_replaced(tmp_path):
    """Installing infinity beside a torch outside setup.py's range would make pip replace it:
    run.sh says so and stops, before any pip call (issue 52, point 2)."""
    own = tmp_path / "site"
    (own / "torch").mkdir(parents=True)
    (own / "torch" / "__init__.py").write_text("")
    (own / "torch-2.99.0.dist-info").mkdir()
    (own / "torch-2.99.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.99.0\n")
    found = subprocess.run([sys.executable, "-S", "-P", str(ROOT / "scripts" / "_job_needs.py")],
                           env=dict(os.environ, PYTHONPATH=str(own)), capture_output=True, text=True, check=True)
    assert "unsupported-torch" in found.stdout.split()
    wrapper = tmp_path / "python3"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(wrapper), "RUN_LOG": str(log), "REAL_PYTHON": sys.executable,
           "PYTHON_FLAGS": "-S", "PYTHONPATH": str(own)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "torch 2.99.0" in proc.stderr and "virtual environment" in proc.stderr
    assert " -m pip " not in log.read_text() and "-m infinity.train" not in log.read_text()


def test_the_job_checks_the_torch_range_setup_py_declares():
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("_job_needs", ROOT / "scripts" / "_job_needs.py")
    needs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(needs)
    a, b, c, d = map(int, re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', (ROOT / "setup.py").read_text()).groups())
    assert needs.TORCH_RANGE == ((a, b), (c, d))
    assert f"torch >={a}.{b},<{c}.{d}" in (ROOT / "scripts" / "run.sh").read_text()
