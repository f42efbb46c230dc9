"""A DeepSpeed config given to ``Config.from_dict`` is said to be one first, with the call that
loads it, before the problems its DeepSpeed names make as infinity's keys."""
import json
from pathlib import Path

import pytest

import infinity

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "deepspeed_zero_infinity.json"


def test_the_deepspeed_hint_comes_first_and_its_advice_loads():
    data = json.loads(EXAMPLE.read_text())
    with pytest.raises(infinity.ConfigError) as info:
        infinity.Config.from_dict(data)
    lines = str(info.value).splitlines()
    assert "looks like a DeepSpeed config" in lines[1] and "infinity.Config.from_deepspeed(" in lines[1]
    assert len(info.value.problems) > 2  # the other problems still follow it
    cfg = infinity.Config.from_deepspeed(data)  # what the hint says to call
    assert cfg.zero.stage == 3 and cfg.zero.offload_optimizer.device == "nvme"


def test_an_infinity_config_gets_no_deepspeed_hint():
    with pytest.raises(infinity.ConfigError) as info:
        infinity.Config.from_dict({"zero": {"stage": 4}})
    assert "DeepSpeed" not in str(info.value)
