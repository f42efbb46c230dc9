"""Note [CPU feature level] in infinity/_runtime/_cpu_isa.py: the level read from the CPU's
flags, the INFINITY_CPU_ISA override, and what each level the machine has changes: the native
Adam's default path (checked against the scalar reference on the same inputs) and
``precision.dtype: auto``."""
import pytest
import torch

import infinity
from infinity._runtime import _cpu_isa
from infinity.errors import UsageError
from infinity.optim import _native, adam_step, simd_path

AVX2 = {"sse4_2", "avx", "avx2", "fma"}  # an AMD EPYC without AVX512
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags,expected", [
    (set(), "scalar"), (AVX2, "avx2"), (AVX512, "avx512"), (AVX512 | {"avx512_bf16"}, "avx512_bf16"),
    (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}, "amx"),
    (AVX2 | {"avx512_bf16"}, "avx2"),  # a level needs every level below it
])
def test_the_level_follows_the_flags(flags, expected):
    assert _cpu_isa.detected(frozenset(flags)) == expected


def test_an_unknown_or_missing_level_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(_cpu_isa.ENV, "sse9")
    with pytest.raises(UsageError, match="INFINITY_CPU_ISA='sse9' is not a CPU feature level"):
        _cpu_isa.level()
    monkeypatch.setenv(_cpu_isa.ENV, "amx")
    if _cpu_isa.detected() != "amx":
        with pytest.raises(UsageError, match="asks for more than this CPU has"):
            _cpu_isa.level()


_ADAM_PATH = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512_nobf16", "avx512_bf16": "avx512", "amx": "avx512"}


@pytest.mark.parametrize("level", _cpu_isa.levels_here())
def test_each_level_of_this_machine_picks_its_adam_path_and_dtype(monkeypatch, level):
    """Under each level this machine has: the default Adam path is that level's (AVX512 without
    avx512_bf16 rounds bf16 in integer arithmetic) and gives the scalar reference's numbers
    within fp32 rounding; ``dtype: auto`` is bf16 exactly where bf16 multiplies natively."""
    monkeypatch.delenv(_native.ENV_SIMD, raising=False)
    monkeypatch.setenv(_cpu_isa.ENV, level)
    expected = _ADAM_PATH[level]
    if expected.startswith("avx512") and not _native.cpu_features()["avx512bf16"]:
        expected = "avx512"  # the same kernel: this CPU has no avx512_bf16 to leave out
    assert _native.resolve(None)[2] == expected
    assert simd_path() == expected
    g = torch.Generator().manual_seed(0)
    n = 4099  # a tail beyond every vector width
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    out = {}
    for simd in (None, "scalar"):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        low = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            adam_step(p, grad.bfloat16(), m, v, step=step, lr=1e-2, weight_decay=0.01, params_out=low, simd=simd)
        out[simd] = (p, m, v, low)
    for ours, ref in zip(out[None], out["scalar"]):
        torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-6, atol=1e-7)
    bf16 = _cpu_isa.LEVELS.index(level) >= _cpu_isa.LEVELS.index("avx512_bf16")
    assert infinity.Config.from_dict({"precision": {"dtype": "auto"}}).precision.dtype == ("bf16" if bf16 else "fp32")
