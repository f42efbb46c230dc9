"""``infinity.close(model)`` and ``infinity.telemetry(model, reset=False)``: the engine closed and
its counters read through the model, without reaching the optimizer's engine."""
import os

import pytest
import torch

import infinity


def _trained(nvme: str):
    torch.manual_seed(0)
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           "precision": {"dtype": "fp32"}}
    model, opt = infinity.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), cfg)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_telemetry_reads_without_resetting_unless_asked(tmp_path):
    model, _ = _trained(str(tmp_path))
    first = infinity.telemetry(model)
    assert first["bytes"]["all_gather"] > 0 and "stall_s" in first and "host_memory" in first
    assert infinity.telemetry(model)["bytes"] == first["bytes"]  # reading alone keeps the counts
    assert infinity.telemetry(model, reset=True)["bytes"] == first["bytes"]
    after = infinity.telemetry(model)
    assert after["bytes"] == {} and after["nvme_optimizer_write_bytes"] == 0
    infinity.close(model)


def test_close_removes_the_swap_files_and_may_be_called_again(tmp_path):
    model, _ = _trained(str(tmp_path))
    assert os.listdir(tmp_path)  # this run's swap directory
    infinity.close(model)
    assert os.listdir(tmp_path) == []
    infinity.close(model)
    assert "bytes" in infinity.telemetry(model)  # the counters stay readable


@pytest.mark.parametrize("fn", [infinity.close, infinity.telemetry])
def test_a_model_without_an_engine_is_refused_with_what_to_pass(fn, tmp_path):
    with pytest.raises(infinity.InfinityError, match="pass the model returned by infinity.initialize"):
        fn(torch.nn.Linear(2, 2))
    model, opt = _trained(str(tmp_path))
    with pytest.raises(TypeError, match="expects the model returned by infinity.initialize, got ZeroOptimizer"):
        fn(opt)
    infinity.close(model)
