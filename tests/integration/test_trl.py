"""TRL's trainers on infinity (``with_infinity``, Note [TRL on infinity] in
infinity/integrations/trl.py), run through the examples (examples/trl_sft.py, trl_dpo.py:
real text, a tokenizer trained there, a tiny Llama): stage 3 with everything on NVMe, fp32,
20 steps, the same losses as plain TRL on the same data and seeds; SFT with the
completion-only loss and with packing, DPO with its reference model partitioned and never
trained; features that cannot work and moved seams refused at construction."""
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")  # installed by scripts/setup_env.sh
pytest.importorskip("datasets")

from _jobs import Jobs  # noqa: E402

import infinity  # noqa: E402
from infinity._zero._engine import engine_of  # noqa: E402
from infinity.errors import UsageError  # noqa: E402
from infinity.testing import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from trl_dpo import run_dpo  # noqa: E402
from trl_sft import losses, run_sft  # noqa: E402

STEPS = 20
LINES = 200  # enough rows for 20 steps; fewer to tokenize


def _same(expected, got, tol=1e-4):
    assert len(expected) == len(got) == STEPS
    assert got == pytest.approx(expected, rel=0, abs=tol)


@pytest.mark.parametrize("packing", [False, True], ids=["completion_only", "packing"])
def test_sft_same_losses_as_plain_trl(packing, tmp_path):
    plain = run_sft(str(tmp_path / "plain"), "", STEPS, packing, plain=True, lines=LINES)
    ours = run_sft(str(tmp_path / "ours"), str(tmp_path / "nvme"), STEPS, packing, lines=LINES)
    _same(losses(plain), losses(ours))
    engine = ours.optimizer.engine
    assert engine.cfg.zero.stage == 3 and engine.cfg.zero.offload_param.device == "nvme"
    assert engine.cfg.zero.offload_optimizer.device == "nvme" and engine.cfg.precision.dtype == "fp32"
    assert type(ours).__name__ == "InfinitySFTTrainer"


def test_dpo_same_losses_as_plain_trl_reference_partitioned_never_trained(tmp_path):
    plain = run_dpo(str(tmp_path / "plain"), "", STEPS, plain=True, lines=LINES)
    ours = run_dpo(str(tmp_path / "ours"), str(tmp_path / "nvme"), STEPS, lines=LINES)
    _same(losses(plain), losses(ours))
    ref = ours.ref_model
    engine = engine_of(ref)
    assert engine is not None and engine is not ours.optimizer.engine  # partitioned by an engine of its own
    assert engine.cfg.zero.offload_param.device == "nvme"
    assert not any(p.requires_grad for p in ref.parameters())
    assert engine.model_state_bytes()["optimizer"] == 0 and engine.model_state_bytes()["grads"] == 0
    initial = plain.ref_model  # plain TRL never trains its reference either: both still hold the initial weights
    with infinity.GatheredParameters(list(ref.parameters())):
        for p, q in zip(ref.parameters(), initial.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


def _two_ranks(kind: str, out: str):
    import torch.distributed as dist

    run = run_sft if kind == "sft" else run_dpo
    nvme = f"{out}/nvme{dist.get_rank()}"
    plain = run(f"{out}/plain", "", STEPS, plain=True, lines=LINES)
    ours = run(f"{out}/ours", nvme, STEPS, lines=LINES)
    return losses(plain), losses(ours), ours.optimizer.engine.world_size


@pytest.mark.slow  # about a minute each on two shared cores
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_two_ranks_same_losses_as_plain_trl_with_ddp(kind, tmp_path):
    for expected, got, world in run_ranks(_two_ranks, 2, kind, str(tmp_path), timeout=590):
        assert world == 2
        _same(expected, got)


def _tiny(tmp_path):
    from trl_sft import stdlib_lines, tiny_llama, train_tokenizer

    tok = train_tokenizer(stdlib_lines(400))
    return tiny_llama(tok, layers=1), tok


def test_refused_at_construction(tmp_path):
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from infinity.integrations.transformers import with_infinity

    model, tok = _tiny(tmp_path)
    common = dict(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(UsageError, match="use_vllm=True is not supported"):
        with_infinity(GRPOTrainer)(model=model, reward_funcs=lambda **kw: [0.0], args=GRPOConfig(use_vllm=True, **common))
    with pytest.raises(UsageError, match="sync_ref_model=True is not supported"):
        with_infinity(DPOTrainer)(model=model, args=DPOConfig(sync_ref_model=True, **common), processing_class=tok)
    with pytest.raises(UsageError, match="by keyword"):
        with_infinity(SFTTrainer)(model, SFTConfig(**common))
    assert with_infinity(SFTTrainer) is with_infinity(SFTTrainer)
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        with_infinity(dict)


def test_a_moved_seam_is_refused_with_its_name(tmp_path, monkeypatch):
    import trl.trainer.utils as trl_utils
    from trl import SFTConfig, SFTTrainer

    from infinity.integrations.transformers import with_infinity

    model, tok = _tiny(tmp_path)
    monkeypatch.delattr(trl_utils, "maybe_gather_lm_head_ctx")
    with pytest.raises(UsageError, match="maybe_gather_lm_head_ctx"):
        with_infinity(SFTTrainer)(model=model, args=SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True,
                                                              report_to=[], bf16=False), processing_class=tok)


EXAMPLES = ["trl_sft.py", "trl_dpo.py"]


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Each example script run from the command line, all started at once (tests/_jobs.py)."""
    root = tmp_path_factory.mktemp("examples")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with Jobs(root) as jobs:
        for example in EXAMPLES:
            jobs.start(example, [sys.executable, str(ROOT / "examples" / example), "--out",
                                 str(root / example / "o"), "--nvme", str(root / example / "nvme"), "--steps", "2"],
                       env=env)
        yield jobs


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs_from_the_command_line(example, example_runs):
    out = example_runs.result(example, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"losses": [' in out.stdout
