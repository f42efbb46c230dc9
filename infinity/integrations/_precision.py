"""What ``TrainingArguments``' ``fp16`` / ``bf16`` mean on infinity.

Note [precision flags]: in plain transformers (and TRL, whose configs default to ``bf16=True``)
the flags mean mixed precision: fp32 parameters, the model's forward under autocast (fp16 with a
GradScaler). Under DeepSpeed they mean its fp16 / bf16 modes: parameters in that dtype, fp32
master weights. On infinity the parameters' dtype is the config's ``precision.dtype``, so what a
flag means follows from what the config says about it:
- the config leaves the dtype open (no config, no ``precision.dtype`` or ``auto``, a DeepSpeed
  JSON): the flag sets it, DeepSpeed's meaning (``PARAMETERS``). The Trainer gets a copy of its
  arguments with both flags off, so accelerate adds no autocast and no GradScaler: infinity
  casts the parameters and scales an fp16 loss itself. A DeepSpeed JSON's non-"auto"
  ``fp16.enabled`` / ``bf16.enabled`` must agree with the flags, as in transformers (Note [auto
  values] in config/deepspeed.py). The config states the flag's own dtype: the same.
- the config states fp32 and ``bf16=True``: fp32 parameters and the model's forward under
  bf16 autocast, wrapped by accelerate's own helpers as its ``prepare_model`` wraps it for a
  plain Trainer (``AUTOCAST``). This is plain transformers' and TRL's run, step for step; TRL's
  default ``bf16=True`` beside a config that says fp32 lands here. Autocast runs on the
  accelerator's device type, so that device must be where infinity computes (else refused: the
  autocast would not reach the model's operators).
- anything else contradicts itself and is refused naming both: ``fp16=True`` over fp32 (autocast
  fp16 needs accelerate's GradScaler, whose scaled loss infinity's optimizer would never
  unscale), bf16 over an fp16 config or fp16 over a bf16 one.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MethodType
from typing import Any, Optional

from torch import nn

from ..config import Config
from ..errors import UsageError

__all__ = ["FlagMeaning", "stated_dtype", "flag_meaning", "check_autocast_device", "autocast_forward"]


class FlagMeaning(enum.Enum):
    """What the run makes of ``fp16`` / ``bf16`` (Note [precision flags])."""

    OFF = "off"  # neither flag: the config's precision.dtype alone
    PARAMETERS = "parameters"  # the flag is precision.dtype: infinity's parameters in it (DeepSpeed's meaning)
    AUTOCAST = "autocast"  # bf16 over the fp32 parameters the config asks for: plain transformers' autocast


def stated_dtype(source: Any, is_deepspeed: bool) -> Optional[str]:
    """The parameters' dtype the user's config states, or None where it leaves it to the flags.
    ``source`` is what ``infinity_config=`` became: a Config (its dtype is stated) or the data of a
    dict / file (``None`` for no config at all)."""
    if source is None or is_deepspeed:
        return None  # a DeepSpeed JSON's fp16/bf16 are matched against the flags by its own mapping
    if isinstance(source, Config):
        return source.precision.dtype
    precision = source.get("precision") if isinstance(source, Mapping) else None
    dtype = precision.get("dtype") if isinstance(precision, Mapping) else None
    return None if dtype in (None, "auto") else dtype


def flag_meaning(fp16: bool, bf16: bool, stated: Optional[str]) -> FlagMeaning:
    """The meaning of the flags beside the config's stated dtype (Note [precision flags])."""
    flag = "fp16" if fp16 else "bf16" if bf16 else None
    if flag is None:
        return FlagMeaning.OFF
    if stated is None or stated == flag:
        return FlagMeaning.PARAMETERS
    if stated == "fp32" and flag == "bf16":
        return FlagMeaning.AUTOCAST
    default = " (TRL's configs default to bf16=True)" if flag == "bf16" else ""
    if stated == "fp32":
        raise UsageError("TrainingArguments(fp16=True) with precision.dtype fp32 in infinity_config: plain "
                         "transformers would run fp16 autocast with accelerate's GradScaler, whose scaled loss "
                         "infinity's optimizer never unscales; set precision.dtype: fp16 (fp16 parameters, infinity's "
                         "loss scaling) or fp16=False")
    raise UsageError(f"TrainingArguments({flag}=True){default} contradicts precision.dtype {stated} in infinity_config; "
                     f"make the two agree, or leave precision.dtype out and let the flag set it")


def check_autocast_device(accelerator, compute_device_type: str) -> None:
    """Note [precision flags] (``AUTOCAST``): accelerate's autocast is for its own device type."""
    if accelerator.native_amp and accelerator.device.type != compute_device_type:
        raise UsageError(f"bf16 autocast over fp32 parameters runs on the Trainer's device type "
                         f"({accelerator.device.type}), but infinity computes on {compute_device_type}: the autocast "
                         f"would not reach the model. Set precision.dtype: bf16 in infinity_config, or bf16=False")


def autocast_forward(model: nn.Module, accelerator) -> None:
    """Note [precision flags] (``AUTOCAST``): ``model.forward`` under accelerate's mixed-precision
    autocast, wrapped as ``Accelerator.prepare_model`` wraps it (its helpers, so the two cannot
    drift), ``_original_forward`` kept for accelerate's ``unwrap_model``. Idempotent."""
    if not accelerator.native_amp or "_original_forward" in vars(model):
        return
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager  # late: only here

    autocast = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    model._original_forward = model.forward
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(model.forward))
