"""TRL's SFT and DPO on infinity give plain TRL's loss at every step, the first one (before any
update) included, to 1e-5: fp32 on stage 1, stage 3 with CPU offload and stage 3 with everything
on NVMe, and with TRL's configs left at their default ``bf16=True`` beside a config that says
fp32, which is plain TRL's bf16 autocast over fp32 parameters (Note [precision flags] in
infinity/integrations/_precision.py). The data, tokenizer and tiny Llama are the examples'
(examples/trl_sft.py, trl_dpo.py: standard-library text, nothing downloaded). Also: what the
flags mean where the config leaves the dtype open, and the contradictions refused."""
import copy
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")  # installed by scripts/setup_env.sh
pytest.importorskip("datasets")

from infinity._zero._engine import engine_of  # noqa: E402
from infinity.errors import UsageError  # noqa: E402
from infinity.integrations._precision import FlagMeaning, flag_meaning, stated_dtype  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from trl_dpo import dpo_dataset  # noqa: E402
from trl_sft import common_args, losses, nvme_config, sft_dataset, stdlib_lines, tiny_llama, train_tokenizer  # noqa: E402

STEPS = 12
LINES = 120  # rows for 12 steps of 4 (DPO: of 2); fewer to tokenize
TOL = 1e-5
FP32 = {"precision": {"dtype": "fp32"}}


def _config(placement: str, tmp_path) -> dict:
    if placement == "stage1":
        return {"zero": {"stage": 1}, **FP32}
    if placement == "stage3_cpu":
        return {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, **FP32}
    return nvme_config(str(tmp_path / "nvme"))


def _train(kind: str, out, infinity_config=None, packing=False, trl_default_precision=False):
    """SFT (completion-only loss, or packing) or DPO for STEPS steps; plain TRL where
    ``infinity_config`` is None. ``trl_default_precision``: bf16 left at TRL's default (True)."""
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from infinity.integrations.transformers import with_infinity

    plain = infinity_config is None
    lines = stdlib_lines(LINES)
    tokenizer = train_tokenizer(stdlib_lines())
    model = tiny_llama(tokenizer)
    kw = common_args(str(out), STEPS, plain, **({"per_device_train_batch_size": 2} if kind == "dpo" else {}))
    if trl_default_precision:
        del kw["bf16"]
    if kind == "sft":
        cls, extra = SFTTrainer, {"train_dataset": sft_dataset(lines, packing)}
        args = SFTConfig(**kw, max_length=64, packing=packing, completion_only_loss=None if packing else True)
    else:
        cls, extra = DPOTrainer, {"train_dataset": dpo_dataset(lines), "ref_model": copy.deepcopy(model)}
        args = DPOConfig(**kw, max_length=64, beta=0.1)
    if plain:
        trainer = cls(model=model, args=args, processing_class=tokenizer, **extra)
    else:
        trainer = with_infinity(cls)(model=model, args=args, processing_class=tokenizer, infinity_config=infinity_config,
                                     **extra)
    trainer.train()
    return trainer


_PLAIN: dict = {}


def _plain_losses(tmp_path_factory, kind, packing=False, trl_default_precision=False) -> list:
    """Plain TRL's per-step losses, trained once per case for the module."""
    key = (kind, packing, trl_default_precision)
    if key not in _PLAIN:
        out = tmp_path_factory.mktemp("plain")
        _PLAIN[key] = losses(_train(kind, out, None, packing, trl_default_precision))
    return _PLAIN[key]


def _same_every_step(expected, got):
    assert len(expected) == len(got) == STEPS
    assert got[0] == pytest.approx(expected[0], rel=0, abs=TOL), "the first step, before any update"
    assert got == pytest.approx(expected, rel=0, abs=TOL)


PLACEMENTS = ["stage1", "stage3_cpu", "stage3_nvme"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("packing", [False, True], ids=["completion_only", "packing"])
def test_sft_fp32_every_step_as_plain_trl(packing, placement, tmp_path, tmp_path_factory):
    ours = _train("sft", tmp_path / "o", _config(placement, tmp_path), packing)
    _same_every_step(_plain_losses(tmp_path_factory, "sft", packing), losses(ours))
    assert ours.optimizer.engine.cfg.precision.dtype == "fp32"


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_dpo_fp32_every_step_as_plain_trl(placement, tmp_path, tmp_path_factory):
    ours = _train("dpo", tmp_path / "o", _config(placement, tmp_path))
    _same_every_step(_plain_losses(tmp_path_factory, "dpo"), losses(ours))
    assert engine_of(ours.ref_model).cfg.precision.dtype == "fp32"


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_default_bf16_over_an_fp32_config_is_plain_trls_autocast(kind, tmp_path, tmp_path_factory):
    """The issue's case: a config that says fp32, TRL's configs left at bf16=True. Plain TRL runs
    the forward under bf16 autocast over fp32 parameters; so does infinity. The first step is
    the same to the last bit; from about the fourth, the last-bit differences of infinity's Adam
    from torch's AdamW (1e-7 in the fp32 runs above) flip bf16 roundings of the weights, so the
    later steps agree to bf16's precision, not fp32's."""
    ours = _train(kind, tmp_path / "o", _config("stage3_cpu", tmp_path), trl_default_precision=True)
    expected, got = _plain_losses(tmp_path_factory, kind, trl_default_precision=True), losses(ours)
    assert len(got) == STEPS and got[0] == pytest.approx(expected[0], rel=0, abs=1e-6)
    assert got == pytest.approx(expected, rel=0, abs=1e-3)
    assert ours.args.bf16 and ours.optimizer.engine.cfg.precision.dtype == "fp32"
    assert "_original_forward" in vars(ours.model)  # accelerate's autocast wrapper
    fp32 = _plain_losses(tmp_path_factory, kind)  # the autocast is real: bf16's losses are not fp32's
    assert max(abs(a - b) for a, b in zip(expected, fp32)) > 10 * TOL


def test_bf16_parameters_are_not_plain_trls_autocast(tmp_path, tmp_path_factory):
    """What the issue saw: with the dtype left open, bf16=True means bf16 parameters (DeepSpeed's
    meaning), and the first step's loss already differs from plain TRL's autocast."""
    ours = _train("sft", tmp_path / "o", {"zero": {"stage": 1}}, trl_default_precision=True)
    assert ours.optimizer.engine.cfg.precision.dtype == "bf16"
    expected = _plain_losses(tmp_path_factory, "sft", trl_default_precision=True)
    assert abs(losses(ours)[0] - expected[0]) > 1e-6


def _construct(tmp_path, infinity_config, **args_over):
    from trl import SFTConfig, SFTTrainer

    from infinity.integrations.transformers import with_infinity

    tokenizer = train_tokenizer(stdlib_lines(400))
    kw = common_args(str(tmp_path / "o"), 1, False, **args_over)
    if "bf16" not in args_over:
        del kw["bf16"]  # TRL's default: True
    return with_infinity(SFTTrainer)(model=tiny_llama(tokenizer, layers=1), args=SFTConfig(**kw, max_length=64),
                                     train_dataset=sft_dataset(stdlib_lines(20), False), processing_class=tokenizer,
                                     infinity_config=infinity_config)


def test_bf16_where_the_config_leaves_the_dtype_open_sets_it(tmp_path):
    """DeepSpeed's meaning: bf16 parameters with fp32 master weights, the Trainer without autocast."""
    for config in (None, {"zero": {"stage": 3}}, {"zero": {"stage": 3}, "precision": {"dtype": "auto"}}):
        trainer = _construct(tmp_path, config)
        assert trainer.infinity_config(trainer.model).precision.dtype == "bf16"
        assert not trainer.args.bf16 and not trainer.args.fp16


def test_contradicting_flags_and_config_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r"bf16=True\) \(TRL's configs default to bf16=True\) contradicts "
                                         r"precision.dtype fp16"):
        _construct(tmp_path, {"precision": {"dtype": "fp16"}})
    with pytest.raises(UsageError, match="fp16 autocast with accelerate's GradScaler"):
        flag_meaning(True, False, "fp32")
    with pytest.raises(UsageError, match=r"fp16=True\) contradicts precision.dtype bf16"):
        flag_meaning(True, False, "bf16")


def test_what_the_flags_mean_beside_the_config():
    from infinity import Config

    assert flag_meaning(False, False, "bf16") is FlagMeaning.OFF
    assert flag_meaning(False, True, None) is FlagMeaning.PARAMETERS
    assert flag_meaning(True, False, "fp16") is FlagMeaning.PARAMETERS
    assert flag_meaning(False, True, "bf16") is FlagMeaning.PARAMETERS
    assert flag_meaning(False, True, "fp32") is FlagMeaning.AUTOCAST
    assert stated_dtype({}, False) is None and stated_dtype({"precision": {"dtype": "auto"}}, False) is None
    assert stated_dtype({"precision": {"dtype": "fp32"}}, False) == "fp32"
    assert stated_dtype({"bf16": {"enabled": False}}, True) is None  # a DeepSpeed JSON: matched by its own mapping
    assert stated_dtype(Config(), False) == "fp32"  # a Config object states every value
