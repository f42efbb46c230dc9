"""``python -m infinity.estimate`` as a shell runs it: bad input exits 2 with the message on
stderr and no traceback (its answers are tested through ``main`` in tests/integration/test_estimate_tables.py)."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args,message", [
    (["--params", "-5"], "params: '-5' must be a positive number"),
    (["--params", "1e9", "--gpu-mem", "12XB"], "gpu_mem: unknown unit 'XB'"),
])
def test_the_command_exits_2_on_bad_input(args, message):
    run = subprocess.run([sys.executable, "-m", "infinity.estimate", *args, "--gpus", "1", "--cpu-mem", "1GB",
                          "--nvme", "1GB"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert message in run.stderr
    assert "Traceback" not in run.stderr
