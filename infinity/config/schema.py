"""The schema of infinity's configuration: every key, its type, default, help text and rules.

A :class:`Config` is a tree of small frozen dataclasses, one per section. It is built from a dict
(:meth:`Config.from_dict`), a JSON or YAML file (:meth:`Config.from_file`) or a DeepSpeed config
(:meth:`Config.from_deepspeed`), and it is validated as a whole whenever it is built: every problem becomes a
:class:`ConfigError` that names the key path and says what to write instead (Note [config validation] in
``validate.py``).

A key is one field here: its annotation is its type, ``_opt(default, help, **rules)`` its default, help text and
bounds; a ``check=`` / ``parse=`` rule and a section's ``_cross_check`` name their function in ``validate.py``.
The same metadata renders the reference table (:meth:`Config.reference_markdown`, the README's config section),
so the documentation cannot drift from the code.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Tuple, Union

import torch

from .._runtime._accelerator import native_bf16
from .._runtime._log import logger
from .deepspeed import _deepspeed_alias, _looks_like_deepspeed, map_deepspeed
from .validate import (
    _INTERNAL,
    ConfigError,
    _check_betas,
    _check_block_size,
    _check_config,
    _check_data_path,
    _check_dirs,
    _check_model,
    _check_numa,
    _check_offload_section,
    _check_optimizer_offload_section,
    _check_precision_section,
    _check_prefetch_section,
    _check_split_section,
    _check_stripe_size,
    _check_zero_section,
    _describe,
    _fields,
    _is_section,
    _leaf_fields,
    _parse_bytes,
    _parse_dirs,
    _read_file,
    _rule_text,
    _type_name,
    _validate_node,
    tierless_offload_paths,
)


def _opt(default: Any = None, help: str = "", **rules: Any) -> Any:
    """A dataclass field with its help text and validation rules in ``metadata``."""
    meta = dict(rules, help=help)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


Device = Literal["none", "cpu", "nvme", "auto"]


@dataclass(frozen=True)
class SplitConfig:
    """Note [split tiers] in `infinity/_offload/_split.py`: one state over several tiers, by fraction of this rank's
    flat space, the fastest tier holding the part the step needs first; every fraction null = no split."""

    device: Optional[float] = _opt(None, "fraction in device memory (0 on every tier for now: the device share is "
                                   "not built yet)", ge=0, le=1)
    cpu: Optional[float] = _opt(None, "fraction in host memory", ge=0, le=1)
    nvme: Optional[float] = _opt(None, "fraction in the swap files", ge=0, le=1)

    _cross_check = _check_split_section


@dataclass(frozen=True)
class OffloadConfig:
    """Where parameter shards live when they are not in use (stage 3 only)."""

    device: Device = _opt("none", "tier of the parameter shards: none (device memory), cpu or nvme; with a split, "
                          "its slowest tier; auto = planned from the machine "
                          "(Note [planned split] in `infinity/_offload/_split.py`)")
    split: SplitConfig = _opt(SplitConfig, "the parameter shards over host memory and NVMe by fraction, the first "
                              "fetch units in host memory (nvme only)")
    nvme_path: Optional[Union[str, Tuple[str, ...]]] = _opt(
        None, "directory for the swap files, or a list of them, one per drive (zero.nvme_layout says how a rank "
        "uses them: Note [many drives] in `infinity/_offload/_drives.py`); required when device is nvme",
        parse=_parse_dirs, check=_check_dirs)
    buffer_size: Optional[int] = _opt(None, "elements per staging buffer; null = sized from the model",
                                      gt=0)
    buffer_count: Optional[int] = _opt(None, "number of staging buffers; null = from the prefetch depth",
                                       gt=0)
    max_in_cpu: Optional[int] = _opt(None, "nvme: elements of this rank's parameter shards kept in host memory once "
                                     "fetched, serving backward's re-reads (DeepSpeed's offload_param.max_in_cpu); "
                                     "null = automatic (up to an eighth of the available host memory), 0 = none",
                                     ge=0)

    _cross_check = _check_offload_section


@dataclass(frozen=True)
class OptimizerOffloadConfig:
    """Where optimizer states (fp32 master, Adam moments) and gradient shards live."""

    device: Device = _opt("none", "tier of optimizer states and gradient shards: none, cpu or nvme; with a split, "
                          "its slowest tier; auto = planned from the machine "
                          "(Note [planned split] in `infinity/_offload/_split.py`)")
    split: SplitConfig = _opt(SplitConfig, "the optimizer states (fp32 master weights and both moments; their gradient "
                              "shards follow) over host memory and NVMe by fraction, in whole chunks, the start of the "
                              "flat space in host memory (DeepSpeed's offload_optimizer.ratio)")
    nvme_path: Optional[Union[str, Tuple[str, ...]]] = _opt(
        None, "directory for the swap files, or a list of them, one per drive (zero.nvme_layout says how a rank "
        "uses them: Note [many drives] in `infinity/_offload/_drives.py`); required when device is nvme",
        parse=_parse_dirs, check=_check_dirs)
    chunk_size: Optional[int] = _opt(None, "elements per optimizer swap chunk (and per chunk of a "
                                     "background step over states in host memory); null = automatic", gt=0)
    host_cache: Optional[int] = _opt(None, "nvme: elements at the start of the optimizer states (the first the "
                                     "next forward needs) also cached in host memory; null = the first fetch "
                                     "unit's (at most 64M), 0 = none", ge=0)
    gradients: Literal["auto", "cpu", "nvme"] = _opt(
        "auto", "nvme: where the fp32 gradient shards accumulate: cpu = host memory (4 bytes per parameter, no "
        "gradient I/O), nvme = a swap file (when they do not fit host memory), auto = cpu when they take at "
        "most a quarter of the available host memory")
    # Note [compressed moments] in _moments.py: opt-in, off by default.
    moments: Literal["fp32", "bf16", "int8"] = _opt(
        "fp32", "nvme: how Adam's two moments are stored in their swap files: fp32 (exact), bf16 (half the bytes) or "
        "int8 (block-quantised, about a quarter); the master weights stay fp32 and Adam computes in fp32")
    # Note [phased swap I/O] in _nvme_optimizer_store.py
    swap_io: Literal["overlap", "phased"] = _opt(
        "overlap", "nvme: overlap: a chunk's reads run while the previous chunk's writes drain (NVMe devices serve "
        "both at once); phased: reads and writes take turns, the update's arithmetic overlapping the reads only "
        "(for disks that serve mixed I/O slowly; measure with python -m benchmarks.disk_mix)")
    # Note [overlapped step] in _zero_optimizer.py
    overlap_step: Literal["auto", "on", "off"] = _opt(
        "auto", "stage 3 with the states off the device: run the update on a background thread, unit by unit in the "
        "order the next forward needs them, while that forward runs; auto: on with an accelerator (whose compute then "
        "overlaps the host's update) or an NVMe tier (the update is bound by its I/O), off on a CPU-only run with the "
        "states in host memory (the forward needs the cores); off: the update finishes inside step()")
    # Note [speculative update] in _zero/_speculative_update.py
    speculate: Literal["off", "on", "always"] = _opt(
        "off", "cpu, with overlap_step: update each unit while backward goes on, as soon as its gradients have "
        "landed, speculating that the step will not clip (nor meet inf/NaN); the values it overwrites are kept "
        "(14-16 bytes per parameter of host memory, in the preflight's plan) and put back exactly when it does; "
        "on: each step unless the last one clipped or met inf/NaN; always: every step; off until a GPU run shows "
        "it faster (its undo copies add to an update bound by host memory bandwidth)")

    _cross_check = _check_optimizer_offload_section


@dataclass(frozen=True)
class PrefetchConfig:
    """The trace-based prefetcher of stage 3."""

    enabled: bool = _opt(True, "prefetch upcoming fetch units along the recorded trace")
    depth: int = _opt(3, "modules ahead (those with a unit to fetch) that NVMe->host reads run", ge=1, le=64)
    device_depth: int = _opt(2, "modules ahead that host->device copies run (<= depth)", ge=0, le=64)
    gather_depth: int = _opt(1, "modules ahead that all-gathers are launched (<= device_depth)",
                             ge=0, le=64)
    bucket_size: int = _opt(50_000_000, "elements in flight in prefetches at a time", gt=0)
    max_live_parameters: int = _opt(1_000_000_000, "cap on gathered (full) parameter elements", gt=0)
    persistence_threshold: int = _opt(100_000, "stage 3: each parameter with fewer elements stays gathered between uses, "
                                       "the rest of its module is partitioned (per parameter, as DeepSpeed's "
                                       "stage3_param_persistence_threshold)", ge=0)

    _cross_check = _check_prefetch_section


@dataclass(frozen=True)
class FetchUnitsConfig:
    """How parameters are grouped into fetch units: one all-gather (stage 3) and one reduce-scatter each."""

    group: Literal["block", "module"] = _opt(
        "block", "block: one unit per repeated block (each child of an nn.ModuleList, and each module of a class in "
        "`classes`) holding every parameter inside it, plus one per module outside blocks; module: one unit per module "
        "that owns parameters")
    classes: Tuple[str, ...] = _opt((), "block: names of module classes that also form one unit each (e.g. GPT2Block)")
    # Note [hooks per unit] in _zero/_module_state.py
    hooks: Literal["unit", "module"] = _opt(
        "unit", "stage 3: unit = forward hooks only on the modules whose units their ancestors do not already hold (a "
        "block, an embedding, the root), the modules inside running in that hold, as FSDP2 hooks a group once; "
        "module = on every module (the trace per module)")


@dataclass(frozen=True)
class TilingConfig:
    """Memory-centric tiling (paper 002 §5.1.3): large operators as grids of small fetch units."""

    enabled: bool = _opt(False, "replace large nn.Linear / nn.Embedding modules by tiled ones at initialize")
    min_params: int = _opt(1_000_000, "modules with at most this many parameters are left whole", ge=0)
    max_tile_params: int = _opt(4_000_000, "the most parameters one tile holds", gt=0)


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO partitioning and offload."""

    stage: Literal[1, 2, 3] = _opt(3, "1: optimizer states, 2: + gradients, 3: + parameters partitioned")
    offload_param: OffloadConfig = _opt(OffloadConfig, "parameter offload (stage 3 only)")
    offload_optimizer: OptimizerOffloadConfig = _opt(OptimizerOffloadConfig, "optimizer offload")
    reduce_bucket_size: int = _opt(50_000_000, "elements per gradient reduce-scatter bucket", gt=0)
    prefetch: PrefetchConfig = _opt(PrefetchConfig, "prefetcher")
    fetch_units: FetchUnitsConfig = _opt(FetchUnitsConfig, "grouping of parameters into fetch units")
    tiling: TilingConfig = _opt(TilingConfig, "memory-centric tiling of large linear and embedding layers")
    # Note [block cache] in native/host_alloc/host_alloc.cpp; Note [allocator retained pages] in _memory_plan.py
    host_allocator: Literal["release", "cache", "keep"] = _opt(
        "release", "where torch's CPU blocks of 1 MiB or more come from while an engine runs (process-wide; Note "
        "[block cache] in `native/host_alloc/host_alloc.cpp`): release: the block cache, each block a mapping of its "
        "own, reused whole by size, at most 256 MiB of freed blocks kept, and the optimizer's host cache gives its "
        "pages back through each forward and is read again in backward (the lowest peak); cache: the block cache "
        "keeping every freed block (no page faults after the first step, a higher peak); keep: glibc's heap, whose "
        "freed blocks up to 32 MiB stay in the process, fragmented")
    # Note [rank placement] in _runtime/_topology.py
    cpu_threads: Optional[int] = _opt(
        None, "threads of this rank's CPU work (the native Adam, torch's intra-op pool); null = its share of the "
        "node's cores: the cores it may use (sched_getaffinity) divided among the node's local ranks "
        "(LOCAL_WORLD_SIZE), at least 1", ge=1)
    numa: Union[Literal["auto", "off"], int] = _opt(
        "auto", "where this rank's threads and host memory are placed: auto: its share of the cores of its GPU's "
        "NUMA node (without a GPU, the local ranks spread over the nodes), its threads pinned there and its host "
        "memory preferred there; a node number: that node; off: nothing pinned, memory where the kernel puts it",
        check=_check_numa)
    # Note [many drives] in _drives.py
    nvme_layout: Literal["per_rank", "stripe"] = _opt(
        "per_rank", "how a rank uses the drives of a list of nvme_path: per_rank: all its swap files on one drive, "
        "paths[LOCAL_RANK % len(paths)] (no two ranks share a drive while there are as many drives as ranks per "
        "node); stripe: each swap file spread over every drive in extents of nvme_stripe_size (fewer drives than "
        "ranks, or one rank reading from all of them)")
    nvme_stripe_size: int = _opt(
        8 << 20, "stripe: bytes of one extent, a multiple of 4096 and of aio.block_size (bytes or a size like '8MiB')",
        gt=0, parse=_parse_bytes, check=_check_stripe_size, type_doc="int or size string")

    host_memory_limit: Optional[int] = _opt(
        None, "host memory this rank's states may take when a section's device is auto, bytes or a size like '64GB'; "
        "null = its share of the node's available host memory less a margin "
        "(Note [planned split] in `infinity/_offload/_split.py`)",
        gt=0, parse=_parse_bytes, type_doc="int, size string or null")

    _cross_check = _check_zero_section


@dataclass(frozen=True)
class PrecisionConfig:
    """Training precision; fp16 adds dynamic loss scaling."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = _opt(
        "fp32", "dtype of parameters and activations; auto = bf16 where this machine multiplies bf16 natively "
        "(avx512_bf16 / AMX, or a CUDA device with bf16), else fp32")
    loss_scale: float = _opt(0.0, "fp16: static loss scale; 0 = dynamic", ge=0)
    initial_scale_power: int = _opt(16, "fp16: dynamic scaling starts at 2**this", ge=0, le=64)
    loss_scale_window: int = _opt(1000, "fp16: overflow-free steps before the scale doubles", ge=1)
    hysteresis: int = _opt(2, "fp16: overflows tolerated before the scale halves", ge=1)
    min_loss_scale: float = _opt(1.0, "fp16: the dynamic scale never goes below this", gt=0)
    on_nonfinite: Literal["error", "skip"] = _opt(
        "error", "a step whose loss or gradient norm is inf/NaN (bf16, fp32; fp16 overflows are the loss "
        "scaler's): error stops naming the step, skip leaves parameters and optimizer states untouched, counts it "
        "and warns")

    def __post_init__(self):
        if self.dtype == "auto":  # resolved once, here: everything downstream sees a concrete dtype
            fast, why = native_bf16()
            object.__setattr__(self, "dtype", "bf16" if fast else "fp32")
            logger.info("precision.dtype auto: %s, because %s", self.dtype, why)

    _cross_check = _check_precision_section

    @property
    def torch_dtype(self):
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam or AdamW (decoupled weight decay)."""

    type: Literal["adam", "adamw"] = _opt("adamw", "adam (L2 in the gradient) or adamw (decoupled)")
    lr: float = _opt(1.0e-4, "learning rate", gt=0)
    betas: Tuple[float, float] = _opt((0.9, 0.999), "Adam's (beta1, beta2), each in [0, 1)",
                                      check=_check_betas)
    eps: float = _opt(1.0e-8, "added to the denominator", gt=0)
    weight_decay: float = _opt(0.01, "weight decay", ge=0)


@dataclass(frozen=True)
class AioConfig:
    """The native async I/O used for NVMe."""

    block_size: int = _opt(1048576, "bytes per I/O request (a multiple of 4096)", gt=0,
                           check=_check_block_size)
    queue_depth: int = _opt(32, "requests in flight per thread", ge=1, le=32768)
    threads: int = _opt(1, "I/O threads", ge=1, le=256)
    backend: Optional[Literal["io_uring", "threads"]] = _opt(
        None, "io_uring or threads (portable pread/pwrite); null = io_uring when available")
    direct: bool = _opt(True, "open swap files with O_DIRECT (bypass the page cache)")
    checksums: bool = _opt(True, "CRC32C of every 4 KiB block written to a swap file, checked on every read "
                                 "(a mismatch raises CorruptionError); 8 bytes of host memory per block")
    timeout: Optional[float] = _opt(None, "seconds a wait for swap-file I/O may last before WaitTimeout names the "
                                          "requests still in flight (a hung disk); null = INFINITY_COMM_TIMEOUT", gt=0)
    endurance_tbw: Optional[float] = _opt(None, "terabytes the SSD under the nvme_path is rated to write (its TBW); "
                                                "the train job warns when a run is projected past "
                                                "endurance_warn_fraction of it; null = no budget", gt=0)
    endurance_warn_fraction: float = _opt(0.1, "fraction of endurance_tbw one run may write before the train job warns "
                                               "at its start", gt=0, le=1)


@dataclass(frozen=True)
class CommConfig:
    """Collectives between data-parallel ranks."""

    timeout: Optional[float] = _opt(
        None, "seconds any collective (and a wait on the overlapped step or on I/O) may take before it fails naming "
        "what it moved; null = the INFINITY_COMM_TIMEOUT variable, else 600; the key wins over the variable", gt=0)


@dataclass(frozen=True)
class TelemetryConfig:
    """Per-step measurements written as JSON lines."""

    path: Optional[str] = _opt(None, "JSON-lines file to append to; null = off")
    every: int = _opt(1, "write a record every this many steps", ge=1)


@dataclass(frozen=True)
class TrainConfig:
    """The main job, ``python -m infinity.train``."""

    model: Union[str, dict] = _opt("gpt2-tiny", "a model name, a dict of Hugging Face config fields "
                                   "(with model_type), or a local model directory", check=_check_model)
    data: Optional[str] = _opt(None, "a .txt or .jsonl file; null = the built-in corpus",
                               check=_check_data_path)
    steps: int = _opt(20, "optimizer steps to run", ge=1)
    micro_batch_size: int = _opt(4, "sequences per rank per forward/backward", ge=1)
    seq_len: int = _opt(128, "tokens per sequence", ge=1)
    output_dir: Optional[str] = _opt(None, "where checkpoints and logs go; null = none")
    save: bool = _opt(True, "save a checkpoint at the end (needs output_dir)")
    log_every: int = _opt(1, "log the loss every this many steps", ge=1)
    lr_warmup_steps: int = _opt(0, "linear learning-rate warm-up steps", ge=0)


@dataclass(frozen=True)
class SchedulerConfig:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR, with their parameter names,
    defaults and formulas (infinity/_runtime/_schedule.py); stepped after every optimizer step."""

    type: Literal["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = _opt(
        "none", "none = constant lr (with train.lr_warmup_steps), or one of DeepSpeed's schedules")
    warmup_min_lr: float = _opt(0.0, "WarmupLR/WarmupDecayLR: lr at the start of the warm-up", ge=0)
    warmup_max_lr: Optional[float] = _opt(0.001, "WarmupLR/WarmupDecayLR: lr at the end of the warm-up; "
                                          "null = optimizer.lr", ge=0)
    warmup_num_steps: Optional[int] = _opt(1000, "warm-up steps (at least 2 count); null = the run's "
                                           "(train.lr_warmup_steps, or the Trainer's warmup_steps)", ge=0)
    warmup_type: Literal["log", "linear"] = _opt("log", "shape of the warm-up")
    total_num_steps: Optional[int] = _opt(None, "WarmupDecayLR/WarmupCosineLR: steps of the whole schedule; "
                                          "null = the run's (train.steps, or the Trainer's max_steps)", ge=1)
    warmup_min_ratio: float = _opt(0.0, "WarmupCosineLR: lr ratio at the start of the warm-up", ge=0)
    cos_min_ratio: float = _opt(0.0001, "WarmupCosineLR: lr ratio at the end of the cosine", ge=0)


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """What happens to the tensors saved at activation-checkpoint boundaries."""

    offload: Literal["none", "cpu"] = _opt("none", "cpu: move them to host memory after each checkpointed block's "
                                           "forward and bring them back before its recomputation")


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``Config()`` is valid (stage 3, no offload, fp32)."""

    zero: ZeroConfig = _opt(ZeroConfig, "ZeRO partitioning and offload")
    precision: PrecisionConfig = _opt(PrecisionConfig, "precision")
    optimizer: OptimizerConfig = _opt(OptimizerConfig, "optimizer")
    gradient_clipping: float = _opt(1.0, "max global gradient norm; 0 disables clipping", ge=0)
    gradient_accumulation_steps: int = _opt(1, "micro-batches (backward calls) per optimizer step",
                                            ge=1)
    aio: AioConfig = _opt(AioConfig, "async I/O")
    comm: CommConfig = _opt(CommConfig, "collectives")
    device_memory_limit: Optional[int] = _opt(
        None, "budget for the engine's device allocations, bytes or a size like '8GB'; null = none",
        gt=0, parse=_parse_bytes, type_doc="int, size string or null")
    seed: int = _opt(1234, "random seed", ge=0)
    telemetry: TelemetryConfig = _opt(TelemetryConfig, "telemetry")
    train: TrainConfig = _opt(TrainConfig, "the train job")
    scheduler: SchedulerConfig = _opt(SchedulerConfig, "learning-rate schedule (DeepSpeed's, by its names)")
    activation_checkpointing: ActivationCheckpointingConfig = _opt(ActivationCheckpointingConfig,
                                                                  "activation checkpoint offload")

    _cross_check = _check_config
    # DeepSpeed keys that were ignored (from_deepspeed with strict=False); not a config key.
    unsupported: list = field(default_factory=list, compare=False, repr=False,
                              metadata={_INTERNAL: True})
    # DeepSpeed "auto" values and what they resolved to: [(key, value, source)]; not a config key.
    resolved_auto: list = field(default_factory=list, compare=False, repr=False,
                                metadata={_INTERNAL: True})

    def __post_init__(self):
        problems: list = []
        _validate_node(self, "", problems)
        if problems:
            raise ConfigError(problems)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping) -> "Config":
        """Build from a dict in infinity's key names (see :meth:`reference_markdown`)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config must be a mapping of keys to values, got {_describe(data)}")
        problems: list = []
        kwargs = _collect(cls, data, "", problems)
        problems.extend(tierless_offload_paths(data))  # a device left out beside a path: nothing offloaded
        if problems and _looks_like_deepspeed(data):  # said first: the problems below are DeepSpeed's names
            problems.insert(0, ("", "this looks like a DeepSpeed config: load it with infinity.Config.from_deepspeed("
                                    "data_or_path), which maps its keys onto infinity's (Config.from_file, "
                                    "infinity.initialize and python -m infinity.train --config detect one themselves); "
                                    "read as infinity's keys, it has these problems"))
        try:
            config = cls(**kwargs)
        except ConfigError as err:
            problems.extend(err.problems)
        if problems:
            raise ConfigError(problems)
        return config

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], strict: bool = False, **deepspeed_context: Any) -> "Config":
        """Load a .json, .yaml or .yml file; a DeepSpeed JSON is routed to :meth:`from_deepspeed`
        (with ``strict`` and ``model=`` / ``training_args=``)."""
        data = _read_file(path)
        if _looks_like_deepspeed(data):
            return cls.from_deepspeed(data, strict=strict, **deepspeed_context)
        return cls.from_dict(data)

    @classmethod
    def from_deepspeed(cls, source: Union[Mapping, str, os.PathLike], strict: bool = False, *,
                       model: Any = None, training_args: Any = None, quiet: bool = False) -> "Config":
        """Map a DeepSpeed config (dict or file) onto infinity's keys (Note [DeepSpeed keys] in
        config/deepspeed.py).

        Keys that only tune DeepSpeed's own machinery are accepted with one warning and kept in
        ``config.unsupported``; ``strict=True`` makes them errors. Keys that would change the
        training result if ignored are always errors naming the key. ``"auto"`` values are
        resolved from ``model`` (its hidden size) and ``training_args`` (a
        ``transformers.TrainingArguments``) as transformers resolves them (Note [auto
        values] in deepspeed.py), and the resolved values are logged once and kept in ``config.resolved_auto``
        (``quiet``: kept, not logged).
        """
        data = source if isinstance(source, Mapping) else _read_file(source)
        return map_deepspeed(cls, data, strict, model=model, training_args=training_args, quiet=quiet)

    @classmethod
    def coerce(cls, config: Any, strict: bool = False, **deepspeed_context: Any) -> "Config":
        """None, a Config, a dict (infinity or DeepSpeed keys) or a file path -> a Config.
        ``strict``, ``model=`` and ``training_args=`` go to :meth:`from_deepspeed`."""
        if config is None:
            return cls()
        if isinstance(config, Config):
            return config
        if isinstance(config, Mapping):
            if _looks_like_deepspeed(config):
                return cls.from_deepspeed(config, strict=strict, **deepspeed_context)
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            return cls.from_file(config, strict=strict, **deepspeed_context)
        raise ConfigError(f"config must be None, an infinity.Config, a dict or a path to a "
                          f".json/.yaml file, got {_describe(config)}")

    def with_overrides(self, updates: Mapping[str, Any]) -> "Config":
        """A new, validated Config with dotted keys replaced, e.g. ``{"zero.stage": 2}``."""
        data = self.to_dict()
        for dotted, value in updates.items():
            node = data
            *parents, leaf = dotted.split(".")
            for name in parents:
                if not isinstance(node.get(name), dict):
                    node[name] = {}
                node = node[name]
            node[leaf] = value
        for section in ("offload_param", "offload_optimizer"):  # a tier moved to none by an override keeps no path
            if updates.get(f"zero.{section}.device") == "none" and f"zero.{section}.nvme_path" not in updates:
                data["zero"][section]["nvme_path"] = None
        return type(self).from_dict(data)

    # -- output ---------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain dicts, lists and scalars; ``Config.from_dict(c.to_dict()) == c``."""
        return _to_plain(self)

    @classmethod
    def reference_markdown(cls) -> str:
        """A markdown table of every key: path, type, default and help."""
        rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for path, hint, f in _leaf_fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            type_doc = f.metadata.get("type_doc") or _type_name(hint)
            shown = json.dumps(_plain_value(default))
            rows.append(f"| `{path}` | {type_doc} | `{shown}` | {_rule_text(f)} |")
        return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------
# Reading a dict into the schema, and back


def all_key_paths() -> list[str]:
    """Every leaf key path of the schema, in declaration order."""
    return [path for path, _, _ in _leaf_fields(Config)]


def _collect(cls, data: Mapping, prefix: str, problems: list) -> dict:
    """Constructor kwargs for ``cls`` from ``data``; unknown keys and non-mapping sections
    are recorded as problems. Leaf values are checked later by ``_validate_node``."""
    known = {f.name: hint for f, hint in _fields(cls)}
    kwargs: dict = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            problems.append((path, _unknown_key_message(str(key), prefix, list(known))))
            continue
        hint = known[key]
        if _is_section(hint) and not isinstance(value, hint):
            if value is None:
                continue  # an empty YAML section (``zero:``) means "all defaults"
            if not isinstance(value, Mapping):
                problems.append((path, f"must be a section (a mapping of keys to values), "
                                       f"got {_describe(value)}"))
                continue
            value = hint(**_collect(hint, value, path + ".", problems))
        kwargs[key] = value
    return kwargs


def _unknown_key_message(key: str, prefix: str, siblings: list[str]) -> str:
    elsewhere = [p for p in all_key_paths() + _section_paths() if p.rsplit(".", 1)[-1] == key]
    alias = _deepspeed_alias(prefix + key)
    if alias:
        hint = f"did you mean '{alias}'? (that is DeepSpeed's name for it)"
    elif elsewhere:
        hint = f"did you mean '{elsewhere[0]}'?"
    else:
        nearest = difflib.get_close_matches(key, siblings, n=1, cutoff=0.0)
        hint = f"did you mean '{prefix}{nearest[0]}'?" if nearest else ""
    where = f"'{prefix[:-1]}'" if prefix else "the top level"
    return f"unknown key; {hint} (valid keys in {where}: {', '.join(siblings)})"


def _section_paths(cls=None, prefix: str = "") -> list[str]:
    out = []
    for f, hint in _fields(cls or Config):
        if _is_section(hint):
            out.append(prefix + f.name)
            out.extend(_section_paths(hint, f"{prefix}{f.name}."))
    return out


def _plain_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_value(v) for k, v in value.items()}
    return value


def _to_plain(node: Any) -> dict:
    out = {}
    for f, hint in _fields(type(node)):
        value = getattr(node, f.name)
        out[f.name] = _to_plain(value) if _is_section(hint) else _plain_value(value)
    return out

