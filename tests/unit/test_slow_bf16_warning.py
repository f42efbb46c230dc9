"""bf16 asked for by name on a machine that does not multiply bf16 natively is warned about once,
at ``infinity.initialize``; ``auto`` and fp32 are not, nor is bf16 where it is native. The CPU
feature level is pinned (Note [CPU feature level] in _runtime/_cpu_isa.py), so these read the
same on an AVX2-only CPU and on one with avx512_bf16."""
import logging

import pytest
import torch

import infinity
from infinity._runtime import _accelerator, _cpu_isa


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This machine read as one without native bf16: its level capped below avx512_bf16."""
    monkeypatch.setenv(_cpu_isa.ENV, "avx2" if "avx2" in _cpu_isa.levels_here() else "scalar")
    assert not _accelerator.native_bf16()[0]


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def slow_warnings():
    handler = _Warnings()
    infinity.logger.addHandler(handler)
    yield lambda: [m for m in handler.messages if "precision.dtype bf16 is slow here" in m]
    infinity.logger.removeHandler(handler)


def test_bf16_by_name_without_native_bf16_warns_once(no_native_bf16, slow_warnings):
    model, _ = infinity.initialize(torch.nn.Linear(8, 8), {"precision": {"dtype": "bf16"}})
    warned = slow_warnings()
    assert len(warned) == 1 and "auto (or fp32) trains faster" in warned[0]
    infinity.close(model)


def test_auto_and_fp32_do_not_warn(no_native_bf16, slow_warnings):
    for dtype in ("auto", "fp32"):
        model, _ = infinity.initialize(torch.nn.Linear(8, 8), {"precision": {"dtype": dtype}})
        infinity.close(model)
    assert slow_warnings() == []


def test_bf16_with_native_bf16_does_not_warn(monkeypatch, slow_warnings):
    monkeypatch.setattr(_accelerator, "_cpu_flags", lambda: {"avx512_bf16"})  # a CPU that has it, on any machine
    monkeypatch.delenv(_cpu_isa.ENV, raising=False)
    model, _ = infinity.initialize(torch.nn.Linear(8, 8), {"precision": {"dtype": "bf16"}})
    infinity.close(model)
    assert slow_warnings() == []
