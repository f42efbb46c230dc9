"""What ``python -m infinity.estimate`` tells a user to do: step times for a GPU come from that
GPU's rates, never this machine's CPU; the recommended config loads as printed and says how."""
import pytest
from _estimate_run import run_estimate

import infinity
from infinity._apps import _estimate_cli

A_24GB_GPU = ["--params", "1.5B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "1TB"]


def test_step_time_for_a_gpu_this_machine_lacks_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(_estimate_cli, "device_count", lambda: 0)  # no GPU here, on every machine
    code, out, err = run_estimate(capsys, *A_24GB_GPU, "--step-time")
    assert code == 2 and out == ""
    assert "describe a GPU, but this machine has none" in err and "--rates h100" in err


def test_step_time_for_a_gpu_takes_a_named_gpus_rates(capsys, monkeypatch):
    monkeypatch.setattr(_estimate_cli, "device_count", lambda: 0)
    code, out, err = run_estimate(capsys, *A_24GB_GPU, "--step-time", "--rates", "h100")
    assert code == 0, err
    assert "rates (8xH100 + NVMe RAID)" in out and "predicted step:" in out


@pytest.mark.parametrize("args", [A_24GB_GPU, ["--params", "1e12", "--gpus", "16", "--gpu-mem", "32GB",
                                               "--cpu-mem", "1.5TB", "--nvme", "28TB"]],
                         ids=["cpu-offload", "nvme"])
def test_the_recommended_config_loads_as_printed(capsys, tmp_path, args):
    code, out, err = run_estimate(capsys, *args)
    assert code == 0, err
    printed = out.split("recommended config:\n", 1)[1]
    assert "load it with infinity.Config.from_file(path)" in printed
    assert "assumes activation checkpointing every 1 layer(s)" in printed
    assert "model.activation_checkpointing_enable()" in printed
    path = tmp_path / "recommended.yaml"
    path.write_text(printed)
    cfg = infinity.Config.from_file(path)
    assert cfg.precision.dtype == "bf16" and cfg.zero.offload_optimizer.device in ("cpu", "nvme")
