"""The train job's ``--dtype``: ``precision.dtype auto`` is resolved and logged only where auto is
in effect, not when the flag names a dtype. The CPU feature level is pinned (Note [CPU feature
level] in _runtime/_cpu_isa.py), so these read the same on an AVX2-only CPU and on one with
avx512_bf16."""
import logging

import pytest

import infinity
from infinity._apps._train_cli import parse_args, resolve_config
from infinity._runtime import _accelerator, _cpu_isa


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This machine read as one without native bf16: its level capped below avx512_bf16."""
    monkeypatch.setenv(_cpu_isa.ENV, "avx2" if "avx2" in _cpu_isa.levels_here() else "scalar")
    assert not _accelerator.native_bf16()[0]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture
def logged():
    handler = _Records()
    infinity.logger.addHandler(handler)
    yield handler.messages
    infinity.logger.removeHandler(handler)


def _auto_lines(messages):
    return [m for _, m in messages if m.startswith("precision.dtype auto")]


def test_dtype_flag_logs_no_auto_line(no_native_bf16, logged):
    cfg = resolve_config(parse_args(["--dtype", "bf16"]))
    assert cfg.precision.dtype == "bf16"
    assert _auto_lines(logged) == []


def test_auto_is_logged_where_it_is_in_effect(no_native_bf16, logged):
    cfg = resolve_config(parse_args([]))  # the embedded default says auto
    assert cfg.precision.dtype == "fp32"
    assert len(_auto_lines(logged)) == 1 and "fp32, because" in _auto_lines(logged)[0]


def test_dtype_flag_applies_over_a_config_file(no_native_bf16, logged, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("precision: {dtype: auto}\nzero: {stage: 2}\n")
    cfg = resolve_config(parse_args(["--config", str(path), "--dtype", "bf16"]))
    assert (cfg.precision.dtype, cfg.zero.stage) == ("bf16", 2)
    assert _auto_lines(logged) == []
