"""DeepSpeed configs as people write them, mapped onto :class:`infinity.Config`.

This module sits between the validation and the schema: ``map_deepspeed`` is given the ``Config`` class and
reads its keys through it, so ``Config.from_deepspeed`` (in ``schema.py``) imports this module directly.

Note [DeepSpeed keys]: every key of a DeepSpeed config ends in exactly one of these places:
- renamed onto an infinity key (``RENAMES``, and the ``scheduler`` section onto ``scheduler``);
- read by the code below (``_SPECIAL``: precision flags, optimizer type, train_batch_size);
- accepted silently because infinity always behaves the way the value asks (``FIXED``, with
  the values that match; None = any value);
- *tuning*: it only tunes DeepSpeed's own machinery (buffer counts, bucket sizes of
  collectives infinity coalesces differently, profilers, monitors). Accepted with one
  warning line that lists each such key and why it does not apply; ``strict=True`` makes
  them errors instead;
- everything else is an error naming the key and what to do: a key infinity cannot honour
  would change the training result if it were ignored (an optimizer or scheduler type it
  does not have, amsgrad, quantized weights, curriculum learning, ...), and a key it does
  not know may be one of those.
A section with ``"enabled": false`` asks for nothing.

Note [auto values]: ``"auto"`` (Hugging Face's Trainer style) is resolved the way
transformers' integration (``HfTrainerDeepSpeedConfig``) resolves it: from the model
(``reduce_bucket_size`` = hidden², ``stage3_prefetch_bucket_size`` = 0.9·hidden²,
``stage3_param_persistence_threshold`` = 10·hidden) and from the training arguments when
they are given (lr, betas, eps, weight_decay, batch sizes, accumulation, clipping, fp16/bf16,
the scheduler's warmup_max_lr; a value that is not "auto" and differs from the training
arguments is an error, as in transformers). Without them a value keeps infinity's default;
``bf16.enabled: auto`` then follows ``precision.dtype: auto`` (bf16 where this machine
multiplies bf16 natively). The scheduler's step counts stay null ("the run's"), filled by the
train job or the Trainer once the number of steps is known. Every resolved value is logged
once at info level, with where it came from.
"""
from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .._runtime._accelerator import native_bf16
from .._runtime._log import logger
from .validate import FP16_KNOBS, ConfigError, _base_type, _describe, _leaf_fields

RENAMES = {
    "zero_optimization.stage": "zero.stage",
    "zero_optimization.offload_param.device": "zero.offload_param.device",
    "zero_optimization.offload_param.nvme_path": "zero.offload_param.nvme_path",
    "zero_optimization.offload_param.buffer_size": "zero.offload_param.buffer_size",
    "zero_optimization.offload_param.buffer_count": "zero.offload_param.buffer_count",
    "zero_optimization.offload_param.max_in_cpu": "zero.offload_param.max_in_cpu",
    "zero_optimization.offload_optimizer.device": "zero.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path": "zero.offload_optimizer.nvme_path",
    "zero_optimization.sub_group_size": "zero.offload_optimizer.chunk_size",
    "zero_optimization.reduce_bucket_size": "zero.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size": "zero.prefetch.bucket_size",
    "zero_optimization.stage3_max_live_parameters": "zero.prefetch.max_live_parameters",
    "zero_optimization.stage3_param_persistence_threshold": "zero.prefetch.persistence_threshold",
    **{f"fp16.{knob}": f"precision.{knob}" for knob in FP16_KNOBS},
    **{f"optimizer.params.{k}": f"optimizer.{k}" for k in ("lr", "betas", "eps", "weight_decay")},
    "aio.block_size": "aio.block_size",
    "aio.queue_depth": "aio.queue_depth",
    "aio.thread_count": "aio.threads",
    "aio.intra_op_parallelism": "aio.threads",
    "gradient_clipping": "gradient_clipping",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "steps_per_print": "train.log_every",
    **{f"scheduler.params.{k}": f"scheduler.{k}" for k in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
        "warmup_min_ratio", "cos_min_ratio")},
}
FIXED = {
    "zero_optimization.offload_param.pin_memory": None,  # host buffers are always pinned
    "zero_optimization.offload_optimizer.pin_memory": None,
    "zero_optimization.overlap_comm": (True,),
    "zero_optimization.contiguous_gradients": (True,),
    "zero_optimization.reduce_scatter": (True,),
    "zero_optimization.allgather_partitions": (True,),
    "zero_optimization.round_robin_gradients": (False,),
    "aio.single_submit": (False,),
    "aio.overlap_events": (True,),
    "aio.use_gds": (False,),
    "optimizer.params.bias_correction": (True,),
    "optimizer.params.amsgrad": (False,),
    "optimizer.params.torch_adam": None,
    "prescale_gradients": (False,),
    "gradient_predivide_factor": (1.0,),
    "zero_allow_untested_optimizer": None,
    "zero_force_ds_cpu_optimizer": None,
    "memory_breakdown": (False,),
    "wall_clock_breakdown": (False,),
    "dump_state": (False,),
    # InfinityTrainer.save_model and infinity.export always write the whole weights
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": None,
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": None,
    "fp16.auto_cast": (False,),
    "sparse_gradients": (False,),
    "data_types.grad_accum_dtype": ("fp32",),  # infinity accumulates gradients in fp32
    "fp16.fp16_master_weights_and_grads": (False,),
    "zero_optimization.zero_quantized_weights": (False,),
    "zero_optimization.zero_quantized_gradients": (False,),
    "zero_optimization.zero_quantized_nontrainable_weights": (False,),
}
_HOST_POOL = "host memory is bounded by infinity's staging pool (zero.offload_param.buffer_count x buffer_size)"
_MONITOR = "a DeepSpeed monitor/profiler; infinity records per-step measurements with telemetry.path"
# Note [DeepSpeed keys]: keys that only tune DeepSpeed's machinery, with why they do not apply.
TUNING = {
    "zero_optimization.stage3_max_reuse_distance": "parameters are released after use and re-fetched "
    "along the recorded trace; there is no reuse-distance cache",
    "zero_optimization.allgather_bucket_size": "all-gathers are coalesced per fetch unit (one submodule), "
    "not by a byte bucket",
    "zero_optimization.offload_optimizer.buffer_count": "the optimizer swapper streams fixed chunks; size them "
    "with zero.offload_optimizer.chunk_size",
    "zero_optimization.offload_optimizer.fast_init": "optimizer swap files are written once, chunk by chunk",
    "zero_optimization.offload_optimizer.pipeline": "the optimizer step already overlaps its swaps",
    "zero_optimization.offload_optimizer.pipeline_read": "the optimizer step already overlaps its swaps",
    "zero_optimization.offload_optimizer.pipeline_write": "the optimizer step already overlaps its swaps",
    "zero_optimization.overlap_comm": "infinity always overlaps the reduce-scatters with backward",
    "zero_optimization.contiguous_gradients": "gradient shards always accumulate in one flat buffer",
    "zero_optimization.reduce_scatter": "gradients are always reduce-scattered",
    "zero_optimization.allgather_partitions": "parameters are always all-gathered",
    "zero_optimization.round_robin_gradients": "one rank owns each shard; there is no round robin",
    "zero_optimization.stage3_module_granularity_threshold": "fetch units are submodules",
    "zero_optimization.memory_efficient_linear": "infinity does not replace linear layers",
    "zero_optimization.ignore_unused_parameters": "parameters without a gradient are always handled",
    "zero_optimization.load_from_fp32_weights": "checkpoints restore the fp32 master weights",
    "zero_optimization.elastic_checkpoint": "checkpoints load at any world size",
    "zero_optimization.zero_hpz_partition_size": "no hierarchical partitioning",
    "zero_optimization.mics_shard_size": "no MiCS sharding",
    "zero_optimization.mics_hierarchical_params_gather": "no MiCS sharding",
    "zero_optimization.use_multi_rank_bucket_allreduce": "no all-reduce buckets",
    "zero_optimization.log_trace_cache_warnings": "the trace is checked every step",
    "aio.single_submit": "io_uring submissions are batched",
    "aio.overlap_events": "io_uring completions always overlap",
    "aio.use_gds": "no GPUDirect Storage",
    "prescale_gradients": "gradients are divided once, in fp32, after the reduce-scatter",
    "gradient_predivide_factor": "gradients are divided once, in fp32, after the reduce-scatter",
    "communication_data_type": "gradients are reduce-scattered in the compute dtype and accumulated in fp32",
    "wall_clock_breakdown": _MONITOR,
    "memory_breakdown": _MONITOR,
    "flops_profiler": _MONITOR,
    "tensorboard": _MONITOR,
    "wandb": _MONITOR,
    "csv_monitor": _MONITOR,
    "comet": _MONITOR,
    "comms_logger": _MONITOR,
    "dump_state": _MONITOR,
    "checkpoint": "infinity's checkpoints are sharded per rank and loadable at any world size",
    "activation_checkpointing": "configures deepspeed.checkpointing only; use the model's gradient "
    "checkpointing (TrainingArguments.gradient_checkpointing) or torch.utils.checkpoint",
    "zero_optimization.cpu_offload_params": _HOST_POOL,
    "zero_optimization.cpu_offload_use_pin_memory": "host buffers are always pinned",
    "bf16.immediate_grad_update": "gradient shards always accumulate in fp32 as backward produces them",
}
# Keys whose value changes what is trained: what to do instead when infinity cannot honour it.
_RESULT_ADVICE = {
    "optimizer.params.amsgrad": "infinity's Adam has no amsgrad; remove the key or set it to false",
    "optimizer.params.bias_correction": "infinity's Adam always corrects the bias; remove the key",
    "fp16.auto_cast": "infinity casts the model, not the inputs; remove the key",
    "fp16.fp16_master_weights_and_grads": "infinity keeps fp32 master weights; remove the key",
    "zero_optimization.zero_quantized_weights": "infinity does not quantize; remove the key",
    "zero_optimization.zero_quantized_gradients": "infinity does not quantize; remove the key",
    "zero_optimization.zero_quantized_nontrainable_weights": "infinity does not quantize; remove the key",
}
_SPECIAL = {"fp16.enabled", "bf16.enabled", "optimizer.type", "optimizer.params.adam_w_mode",
            "train_batch_size", "scheduler.type"}
_SECTIONS = {"zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer",
             "fp16", "bf16", "optimizer", "optimizer.params", "aio", "scheduler", "scheduler.params", "data_types"}
SCHEDULERS = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
_SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"},
    "WarmupCosineLR": {"warmup_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps", "cos_min_ratio"},
}
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")
OURS_TO_DS = {ours: ds for ds, ours in reversed(list(RENAMES.items()))}


@dataclass
class _DsState:
    schema: Any  # the Config class mapped onto: this module reads the schema only through it
    leaf_hints: dict
    out: dict = field(default_factory=dict)  # infinity keys, nested
    origins: dict = field(default_factory=dict)  # infinity key path -> DeepSpeed key path
    special: dict = field(default_factory=dict)
    tuning: list = field(default_factory=list)  # (path, why): accepted with a warning unless strict
    problems: list = field(default_factory=list)

    def set(self, target: str, value: Any, origin: str) -> None:
        hint = _base_type(self.leaf_hints[target])
        if hint is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # DeepSpeed configs write sizes like 1e9
        if target.endswith(".device") and isinstance(value, str):
            value = value.lower()
        node = self.out
        *parents, leaf = target.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
        self.origins[target] = origin


# ---------------------------------------------------------------------------------------------
# DeepSpeed names met elsewhere: routing a dict or file, and hints for an infinity config


_DEEPSPEED_MARKERS = frozenset({
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16",
    "bfloat16", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
})


def _looks_like_deepspeed(data: Mapping) -> bool:
    return isinstance(data, Mapping) and any(key in _DEEPSPEED_MARKERS for key in data)


def _deepspeed_alias(path: str) -> Optional[str]:
    """infinity's key for a DeepSpeed name written into an infinity config, if any."""
    sections = {"zero_optimization": "zero", "fp16": "precision", "bf16": "precision"}
    if path in sections:
        return sections[path]
    for candidate in (path, path.replace("zero.", "zero_optimization.", 1),
                      path.replace("optimizer.", "optimizer.params.", 1)):
        if candidate in RENAMES and RENAMES[candidate] != path:
            return RENAMES[candidate]
    return None


# ---------------------------------------------------------------------------------------------
# "auto": Note [auto values]


def _get(data: Mapping, path: str) -> Any:
    node = data
    for name in path.split("."):
        if not isinstance(node, Mapping) or name not in node:
            return None
        node = node[name]
    return node


def _put(data: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for name in parents:
        node = node[name]
    node[leaf] = value


def hidden_size_of(model) -> Optional[int]:
    """The model's hidden size as transformers' DeepSpeed integration reads it."""
    cfg = getattr(model, "config", None)
    for node in (cfg, getattr(cfg, "text_config", None)):
        if node is None:
            continue
        if isinstance(getattr(node, "hidden_size", None), int):
            return node.hidden_size
        if getattr(node, "hidden_sizes", None):
            return max(node.hidden_sizes)
    return None


def _from_args(args) -> list:
    """(DeepSpeed key, value, where it comes from, must match) as transformers fills them."""
    world = int(getattr(args, "world_size", 1) or 1)
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return [
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", True),
        ("gradient_accumulation_steps", accum, "gradient_accumulation_steps", True),
        ("train_batch_size", world * micro * accum, "train_batch_size (world x micro x accumulation)", True),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm", True),
        ("optimizer.params.lr", args.learning_rate, "learning_rate", True),
        ("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2", True),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", True),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay", True),
        ("scheduler.params.warmup_min_lr", 0, "0, as transformers fills it", False),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate", True),
        ("fp16.enabled", bool(args.fp16 or getattr(args, "fp16_full_eval", False)), "fp16", True),
        ("bf16.enabled", bool(args.bf16 or getattr(args, "bf16_full_eval", False)), "bf16", True),
    ]


def resolve_auto(data: Mapping, model=None, training_args=None) -> tuple:
    """``data`` with its "auto" values replaced where the model or the training arguments
    give them, ``[(key, value, source)]`` of what was resolved, and mismatches with the
    training arguments as ``(key, message)`` problems."""
    out: dict = copy.deepcopy(dict(data))
    resolved, problems = [], []
    if training_args is not None:
        for key, value, name, must_match in _from_args(training_args):
            current = _get(out, key)
            if current == "auto":
                _put(out, key, value)
                resolved.append((key, value, name if not must_match else f"TrainingArguments.{name}"))
            elif must_match and current is not None and _differs(current, value):
                problems.append((key, f"{current!r} differs from TrainingArguments {name}={value!r}; set the "
                                      f"key to 'auto' (or make the two agree)"))
    autos = [k for k in HIDDEN_SIZE_KEYS if _get(out, k) == "auto"]
    hidden = hidden_size_of(model) if model is not None else None
    if autos and hidden is not None:
        stage3 = _get(out, "zero_optimization.stage") in (3, None)
        for key, value in ((HIDDEN_SIZE_KEYS[0], hidden * hidden),
                           (HIDDEN_SIZE_KEYS[1], int(0.9 * hidden * hidden)), (HIDDEN_SIZE_KEYS[2], 10 * hidden)):
            if key in autos and (stage3 or key == HIDDEN_SIZE_KEYS[0]):
                _put(out, key, value)
                resolved.append((key, value, f"model hidden_size {hidden}"))
    return out, resolved, problems


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is not b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) != float(b)
    return a != b


# ---------------------------------------------------------------------------------------------
# The mapping


def map_deepspeed(cls, data: Mapping, strict: bool = False, model=None, training_args=None, quiet: bool = False):
    """A ``cls`` (the :class:`Config` class) from a DeepSpeed config dict. Note [DeepSpeed keys], Note [auto
    values]. ``quiet``: nothing logged (a first build whose auto values a build with the model replaces)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a mapping, got {_describe(data)}")
    data = dict(data)
    if "bfloat16" in data and "bf16" not in data:  # DeepSpeed's older spelling
        data["bf16"] = data.pop("bfloat16")
    if "zero_optimization" not in data:
        logger.info("DeepSpeed config has no zero_optimization section; using zero.stage=3")
    data, resolved, problems = resolve_auto(data, model, training_args)
    st = _DsState(cls, {path: hint for path, hint, _ in _leaf_fields(cls)})
    st.problems.extend(problems)
    _walk(data, "", st, resolved)
    _precision(st, resolved, training_args is not None)
    _optimizer(st)
    _scheduler(st)
    _batch_size(st, training_args)
    problems = list(st.problems)
    config = None
    try:
        config = cls.from_dict(st.out)
    except ConfigError as err:
        for path, msg in err.problems:
            ds_path = st.origins.get(path) or OURS_TO_DS.get(path)
            problems.append((ds_path, f"{msg} (infinity key {path})") if ds_path else (path, msg))
    if strict and st.tuning:
        problems.extend((path, f"DeepSpeed key not used by infinity: {why}") for path, why in st.tuning)
        problems.append(("", "strict: remove these keys, or load without strict to accept them with a warning"))
    if problems:
        raise ConfigError(problems)
    if st.tuning and not quiet:
        logger.warning("DeepSpeed keys that only tune DeepSpeed's own machinery are ignored: %s",
                       "; ".join(f"{path} ({why})" for path, why in st.tuning))
    if resolved and not quiet:
        logger.info("DeepSpeed 'auto' values: %s", ", ".join(f"{k}={v!r} ({src})" for k, v, src in resolved))
    object.__setattr__(config, "unsupported", [path for path, _ in st.tuning])
    object.__setattr__(config, "resolved_auto", [(k, v, src) for k, v, src in resolved])
    return config


def _walk(node: Mapping, prefix: str, st: _DsState, resolved: list) -> None:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value == "auto":
            _keep_default(path, st, resolved)
        elif path in RENAMES:
            st.set(RENAMES[path], value, path)
        elif path in FIXED and ((allowed := FIXED[path]) is None or value in allowed):
            logger.debug("DeepSpeed key %s accepted; infinity always behaves this way", path)
        elif isinstance(value, Mapping) and value.get("enabled") is False:
            logger.debug("DeepSpeed section %s is disabled: nothing to map", path)
        elif path in _RESULT_ADVICE:
            st.problems.append((path, f"{value!r} would change the training result and infinity cannot honour it: "
                                      f"{_RESULT_ADVICE[path]}"))
        elif path == _RATIO:
            _map_ratio(value, st)
        elif path in TUNING:
            st.tuning.append((path, TUNING[path]))
        elif path in _SPECIAL:
            st.special[path] = value
        elif path in _SECTIONS:
            if isinstance(value, Mapping):
                _walk(value, path + ".", st, resolved)
            elif value is not None:
                st.problems.append((path, f"must be a section (a mapping), got {_describe(value)}"))
        else:
            st.problems.append((path, _unknown_key_message(path, prefix)))


_RATIO = "zero_optimization.offload_optimizer.ratio"


def _map_ratio(value, st: "_DsState") -> None:
    """DeepSpeed's ``offload_optimizer.ratio``, the share of the optimizer states the CPU updates
    (the rest stay on the GPU), is a split of infinity's (Note [split tiers] in _offload/_split.py):
    {device: 1 - ratio, cpu: ratio}; 1 is the whole state offloaded, no split."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        st.problems.append((_RATIO, f"expected a number between 0 and 1, got {_describe(value)}"))
    elif value < 1:
        st.set("zero.offload_optimizer.split.device", 1.0 - float(value), _RATIO)
        st.set("zero.offload_optimizer.split.cpu", float(value), _RATIO)


def _known_keys(prefix: str) -> list:
    """The DeepSpeed keys this module knows directly under ``prefix`` (a section path ending in a dot, or "")."""
    known = set(RENAMES) | set(FIXED) | set(TUNING) | set(_SPECIAL) | _SECTIONS | set(_RESULT_ADVICE) | {_RATIO}
    return sorted({p[len(prefix):].split(".", 1)[0] for p in known if p.startswith(prefix) and len(p) > len(prefix)})


def _unknown_key_message(path: str, prefix: str) -> str:
    key = path[len(prefix):]
    nearest = difflib.get_close_matches(key, _known_keys(prefix), n=1, cutoff=0.6)
    if nearest:  # a typo: removing the key would drop what it asked for (e.g. an offload tier) silently
        return (f"unknown DeepSpeed key; did you mean '{prefix}{nearest[0]}'? Rename it (removing it would drop "
                f"what it asks for)")
    return ("DeepSpeed key infinity does not support, and ignoring it could change what is trained; remove it (or, "
            "if it only tunes DeepSpeed, report it to be listed as such)")


def _keep_default(path: str, st: _DsState, resolved: list) -> None:
    """An "auto" nothing resolved: infinity's default (or the run's, for scheduler steps)."""
    if path in ("fp16.enabled", "bf16.enabled", "train_batch_size"):
        st.special[path] = "auto"
        return
    target = RENAMES.get(path)
    if target is None:
        if path not in TUNING and path not in FIXED:
            st.problems.append((path, "'auto' is not supported for this key; give a value"))
        return
    if target.startswith("scheduler."):
        value = 0.0 if target == "scheduler.warmup_min_lr" else None  # transformers fills 0 there
        st.set(target, value, path)
        resolved.append((path, value, "0, as transformers fills it" if value == 0.0 else
                         "the run's: filled once the number of steps (or optimizer.lr) is known"))
        return
    default = st.schema()
    for name in target.split("."):
        default = getattr(default, name)
    resolved.append((path, default, "infinity's default: no model or training arguments give it"))


def _flag(st: _DsState, path: str) -> Any:
    value = st.special.get(path, False)
    if value != "auto" and not isinstance(value, bool):
        st.problems.append((path, f"expected bool or 'auto', got {_describe(value)}"))
        return False
    return value


def _precision(st: _DsState, resolved: list, have_args: bool) -> None:
    fp16, bf16 = _flag(st, "fp16.enabled"), _flag(st, "bf16.enabled")
    if fp16 == "auto":
        fp16 = False
        resolved.append(("fp16.enabled", False, "no training arguments: fp16 only when asked for"))
    if fp16 is True and bf16 is True:
        st.problems.append(("fp16.enabled", "fp16 and bf16 are both enabled (bf16.enabled is true too); enable at "
                                            "most one of them"))
    elif fp16 is True:
        st.set("precision.dtype", "fp16", "fp16.enabled")
    elif bf16 is True:
        st.set("precision.dtype", "bf16", "bf16.enabled")
    elif bf16 == "auto":  # Note [auto values]: follows precision.dtype auto
        fast, why = native_bf16()
        st.set("precision.dtype", "bf16" if fast else "fp32", "bf16.enabled")
        resolved.append(("bf16.enabled", fast, f"precision.dtype auto: {why}"))


def _optimizer(st: _DsState) -> None:
    if "optimizer.type" not in st.special:
        return
    name, w_mode = st.special["optimizer.type"], st.special.get("optimizer.params.adam_w_mode", True)
    if not isinstance(w_mode, bool):
        st.problems.append(("optimizer.params.adam_w_mode", f"expected bool, got {_describe(w_mode)}"))
    elif not isinstance(name, str) or name.lower() not in ("adam", "adamw"):
        st.problems.append(("optimizer.type", f"{_describe(name)} is not supported; allowed values: Adam, AdamW "
                                              "(another optimizer would train differently)"))
    else:
        # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false.
        kind = "adamw" if name.lower() == "adamw" or w_mode else "adam"
        st.set("optimizer.type", kind, "optimizer.type")


def _scheduler(st: _DsState) -> None:
    if "scheduler.type" not in st.special:
        if "scheduler" in st.out:
            st.problems.append(("scheduler.type", "is missing; give one of " + ", ".join(sorted(SCHEDULERS))))
        return
    name = st.special["scheduler.type"]
    if name not in SCHEDULERS:
        st.problems.append(("scheduler.type", f"{name!r} is not supported; allowed values: "
                            f"{', '.join(sorted(SCHEDULERS))} (or drop the section and step your own "
                            f"torch.optim.lr_scheduler)"))
        return
    for key in st.out.get("scheduler", {}):
        if key not in _SCHEDULER_PARAMS[name]:
            st.problems.append((f"scheduler.params.{key}", f"is not a parameter of {name}; its parameters are "
                                f"{', '.join(sorted(_SCHEDULER_PARAMS[name]))}"))
    st.set("scheduler.type", name, "scheduler.type")


def _batch_size(st: _DsState, training_args) -> None:
    """``train_batch_size = micro batch x accumulation steps x world size``: check or derive."""
    total = st.special.get("train_batch_size")
    if total is None or total == "auto":
        return
    if isinstance(total, float) and total.is_integer():
        total = int(total)
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        st.problems.append(("train_batch_size", f"expected a positive int or 'auto', got {_describe(total)}"))
        return
    micro = st.out.get("train", {}).get("micro_batch_size")
    accum = st.out.get("gradient_accumulation_steps", 1)
    env_world = os.environ.get("WORLD_SIZE", "")
    world = int(env_world) if env_world.isdigit() and int(env_world) > 0 else None
    if training_args is not None:
        world = int(getattr(training_args, "world_size", 1) or 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (micro or 1, accum)):
        return  # from_dict reports the bad value by name
    if micro is None:
        per_step = accum * (world or 1)
        if total % per_step:
            st.problems.append(("train_batch_size", f"{total} is not divisible by gradient_accumulation_steps x "
                                                    f"world size = {per_step}"))
            return
        st.set("train.micro_batch_size", total // per_step, "train_batch_size")
        if world is None:
            logger.info("train_micro_batch_size_per_gpu derived from train_batch_size assuming world size 1 "
                        "(WORLD_SIZE is not set)")
    elif world is not None and total != micro * accum * world:
        st.problems.append(("train_batch_size", f"{total} != train_micro_batch_size_per_gpu ({micro}) x "
                            f"gradient_accumulation_steps ({accum}) x world size ({world}); fix one of them or set "
                            f"train_batch_size to 'auto'"))
    elif world is None and total % (micro * accum):
        st.problems.append(("train_batch_size", f"{total} is not a multiple of train_micro_batch_size_per_gpu "
                            f"({micro}) x gradient_accumulation_steps ({accum})"))
