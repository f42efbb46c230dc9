"""TRL's trainers on infinity: what ``with_infinity(SFTTrainer)`` and ``with_infinity(DPOTrainer)``
add to ``InfinityTrainer``. Tested with TRL 1.16.0 (transformers 5.x); other versions are run
only when every seam below is found as expected, and are refused otherwise.

Note [TRL on infinity]: where TRL asks whether DeepSpeed ZeRO-3 is on, infinity answers "no"
(``is_deepspeed_zero3_enabled()`` is False and ``args.deepspeed_plugin`` is None), and each
non-DeepSpeed path is the right one here:
- the fused LM head (``add_fused_lm_head``: SFT's and DPO's losses) reads ``lm_head.weight``
  directly and hands it to ``ChunkedLogProbFunction``; ``maybe_gather_lm_head_ctx`` gathers it
  only under DeepSpeed and is a null context here, because infinity's ``Function.apply``
  fetches the released parameters itself, inside the model's forward where TRL applies it,
  and the model's backward gathers them again (Note [parameters read by autograd Functions]
  in _function_params.py);
- PEFT under ZeRO-3 (``autocast_adapter_dtype=False``, reentrant checkpointing forced): not
  needed, infinity casts every parameter to one compute dtype and handles non-reentrant
  checkpointing (Note [aborted forward] in _engine.py);
- DPO's reference model (``prepare_deepspeed`` under DeepSpeed): accelerate's plain
  evaluation-mode preparation, then, when the policy is handed to ``infinity.initialize``, the
  reference is frozen and handed to it too with the same config, so it is partitioned on the
  same tiers, never trained and has no optimizer state (``ReferenceModel``);
- generation (``unwrap_model_for_generation`` of the online trainers, which under ZeRO-3
  gathers the whole model or not): the plain path, the model as it is, so ``generate`` runs
  with stage 3's per-module gathers, and ``synced_gpus`` (transformers' ZeRO-3 question) is
  answered by ``synced_generate`` as for ``InfinityTrainer``; only the GRPO-style trainers'
  construction is covered by a test (the vLLM refusal), not their training;
- ``SyncRefModelCallback`` (gathers both models under ZeRO-3): refused, see below.
TRL's configs default to ``bf16=True``; what it means beside the infinity config's dtype: Note
[precision flags] in _precision.py.

The seams used, each checked at construction (``check_seams``): TRL's
``trl.kernels.ChunkedLogProbFunction`` (a ``torch.autograd.Function`` that keeps torch's
``apply``), ``trl.trainer.utils.maybe_gather_lm_head_ctx`` keyed on
``is_deepspeed_zero3_enabled`` (which must be False: with a DeepSpeed config alive TRL would
gather infinity's parameters with DeepSpeed), a DPO-style trainer's ``ref_model`` attribute
after construction, and the Trainer's private methods ``InfinityTrainer`` overrides
(``_prepare_for_training``, ``_prepare_input``, ``_load_from_checkpoint``,
``_save_optimizer_and_scheduler``, ``_clip_grad_norm``, ``_get_grad_norm``,
``_maybe_log_save_evaluate``). Features that cannot work are refused at construction: a vLLM
generation backend (``use_vllm``: vLLM loads its own copy of the whole model on the GPU), and
``sync_ref_model`` (its callback mixes the policy's and the reference's full weights outside
any forward).
"""
from __future__ import annotations

import inspect

import torch
import transformers
import trl
from torch import nn
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

import infinity

from .._runtime._log import logger
from .._zero._engine import engine_of
from ..errors import UsageError

__all__ = ["InfinityTRLMixin", "check_seams", "TESTED_TRL"]

TESTED_TRL = "1.16.0"
TRAINER_SEAMS = ("_prepare_for_training", "_prepare_input", "_load_from_checkpoint", "_save_optimizer_and_scheduler",
                 "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate")


def check_seams(trainer_cls: type) -> None:
    """Note [TRL on infinity]: every seam this integration relies on is where it expects, or a
    ``UsageError`` naming the one that moved."""
    where = f"TRL {trl.__version__} (tested: {TESTED_TRL}), transformers {transformers.__version__}"
    missing = [name for name in TRAINER_SEAMS if not hasattr(transformers.Trainer, name)]
    if missing:
        raise UsageError(f"infinity's TRL integration: transformers.Trainer has no {', '.join(missing)} in {where}; "
                         f"use the tested versions")
    try:  # late: where these live moved between TRL versions, and a missing one is a usage error
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError as e:
        raise UsageError(f"infinity's TRL integration: {e} in {where}; use the tested versions") from None
    if not issubclass(ChunkedLogProbFunction, torch.autograd.Function) or "apply" in vars(ChunkedLogProbFunction):
        raise UsageError(f"infinity's TRL integration: trl.kernels.ChunkedLogProbFunction is no longer a "
                         f"torch.autograd.Function applied through torch's apply in {where}")
    if "is_deepspeed_zero3_enabled" not in inspect.getsource(maybe_gather_lm_head_ctx):
        raise UsageError(f"infinity's TRL integration: trl.trainer.utils.maybe_gather_lm_head_ctx no longer decides "
                         f"by is_deepspeed_zero3_enabled() in {where}; use the tested versions")
    if is_deepspeed_zero3_enabled():
        raise UsageError("a DeepSpeed ZeRO-3 config is alive in this process (transformers' HfDeepSpeedConfig or "
                         "TrainingArguments(deepspeed=...)): TRL would gather infinity's parameters with DeepSpeed. Give "
                         "the DeepSpeed JSON as infinity_config= instead, not as TrainingArguments.deepspeed")
    if trl.__version__ != TESTED_TRL:
        logger.warning("infinity's TRL integration was tested with TRL %s; running %s (its seams were found)",
                       TESTED_TRL, trl.__version__)


def _refuse_features(args) -> None:
    if args is None:
        return
    if getattr(args, "use_vllm", False):
        raise UsageError("use_vllm=True is not supported on infinity: vLLM loads its own whole copy of the model on the "
                         "GPU, which a partitioned model cannot share; generate with use_vllm=False (transformers' "
                         "generate, synced across ranks)")
    if getattr(args, "sync_ref_model", False):
        raise UsageError("sync_ref_model=True is not supported on infinity: its callback mixes the policy's and the "
                         "reference's full weights outside any forward; train with sync_ref_model=False")
    if getattr(args, "deepspeed", None):
        raise UsageError("TrainingArguments.deepspeed is set: give the DeepSpeed JSON as infinity_config= instead")


class ReferenceModel:
    """Note [TRL on infinity] (reference model): a trainer's frozen reference model, partitioned
    by its own engine with the policy's config: no parameter trains and none has an optimizer
    state."""

    @staticmethod
    def partition(model: nn.Module, config) -> None:
        if engine_of(model) is not None:
            return
        model.requires_grad_(False)
        model.eval()
        infinity.initialize(model, config=config)


class InfinityTRLMixin:
    """The TRL part of ``with_infinity(SomeTRLTrainer)`` (Note [TRL on infinity]); placed before
    ``InfinityTrainer`` in the class's bases. Arguments after ``model`` go by keyword: TRL's
    trainers do not agree on their positional order (DPO's second is ``ref_model``)."""

    def __init__(self, model=None, *args, **kwargs):
        if args:
            raise UsageError(f"{type(self).__name__}: pass the arguments after model by keyword (args=..., "
                             f"train_dataset=..., ref_model=...)")
        check_seams(type(self))
        _refuse_features(kwargs.get("args"))
        super().__init__(model, **kwargs)
        trl_cls = next(c for c in type(self).__mro__ if c.__module__.startswith("trl."))
        wants_ref = "ref_model" in inspect.signature(trl_cls.__init__).parameters
        if wants_ref and not hasattr(self, "ref_model"):
            raise UsageError(f"{type(self).__name__}: TRL's trainer set no ref_model attribute; the reference model "
                             f"cannot be partitioned (use the tested TRL {TESTED_TRL})")

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)  # type: ignore[misc]
        ref = getattr(self, "ref_model", None)
        if isinstance(ref, nn.Module):
            ReferenceModel.partition(ref, self.infinity_config(ref))  # type: ignore[attr-defined]
        return optimizer
