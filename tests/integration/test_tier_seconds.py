"""Seconds per tier per state in the engine's telemetry (``tier_seconds``: Note [engine telemetry
keys] in infinity/_runtime/_telemetry.py): a state split over host memory and NVMe (Note [split
tiers] in infinity/_offload/_split.py) reports the seconds its step spent on each part; a state
on one tier reports that tier alone, so an all-cpu run has no NVMe seconds at all."""
import pytest
from _models import build, train_losses
from test_split_tiers import HALF, _config  # the same tiny model, chunking and splits

import infinity

STATES = ("optimizer", "params")


def _tier_seconds(nvme, tier="nvme", opt_split=None, param_split=None, steps=2):
    """Train ``steps`` steps at stage 3; the telemetry's seconds per state and tier, and the
    same after a reset with nothing run since."""
    model, opt = infinity.initialize(build("gpt2"), _config(nvme, 3, opt_split, param_split, tier=tier))
    train_losses(model, opt, "gpt2", steps)
    opt.wait_step()  # the overlapped step's tail (Note [overlapped step] in _zero/_zero_optimizer.py) is counted
    got = infinity.telemetry(model, reset=True)
    after = infinity.telemetry(model)
    infinity.close(model)
    return got["tier_seconds"], after["tier_seconds"]


@pytest.mark.parametrize("split", ["optimizer", "params"])
def test_a_split_state_reports_seconds_on_both_tiers(tmp_path, split):
    seconds, after = _tier_seconds(str(tmp_path), opt_split=HALF if split == "optimizer" else None,
                                   param_split=HALF if split == "params" else None)
    assert set(seconds) == set(STATES)
    assert set(seconds[split]) == {"cpu", "nvme"}
    assert seconds[split]["cpu"] > 0 and seconds[split]["nvme"] > 0
    whole = "params" if split == "optimizer" else "optimizer"
    assert set(seconds[whole]) == {"nvme"} and seconds[whole]["nvme"] > 0  # unsplit: its one tier
    # deltas, like every count of the telemetry: nothing ran since the reset
    assert after == {state: dict.fromkeys(tiers, 0.0) for state, tiers in seconds.items()}


def test_an_all_cpu_run_has_no_nvme_seconds(tmp_path):
    seconds, _ = _tier_seconds(None, tier="cpu")
    assert set(seconds) == set(STATES)
    for state in STATES:
        assert set(seconds[state]) == {"cpu"} and seconds[state]["cpu"] > 0, seconds


def test_an_all_nvme_run_has_no_cpu_seconds(tmp_path):
    seconds, _ = _tier_seconds(str(tmp_path))
    for state in STATES:
        assert set(seconds[state]) == {"nvme"} and seconds[state]["nvme"] > 0, seconds
