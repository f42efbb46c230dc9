"""Model loading for ``python -m infinity.train``: a preset, a dict of Hugging Face config
fields, or a local model directory, built under ``infinity.Init`` for stage 3 and checked
against the room it needs before a single parameter exists (Note [Init preflight] in _init_context.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._host_memory import available as host_available
from .._runtime._log import logger
from .._runtime._telemetry import fmt_bytes
from .._runtime._tiers import Tier
from .._zero._init_context import Init
from ..config import Config
from ..errors import InfinityError, InsufficientResourcesError, TrainError
from ._train_data import ByteTokenizer, has_tokenizer_files, load_hf_tokenizer

GPT2_POSITIONS = 1024  # GPT-2's position table: the most the gpt2-tiny preset sizes its own to

# Named model presets: fields of transformers.GPT2Config. "gpt2-tiny" matches the byte tokenizer.
PRESETS: Dict[str, dict] = {
    "gpt2-tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=ByteTokenizer.vocab_size,
                      bos_token_id=ByteTokenizer.eos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
                      pad_token_id=ByteTokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt2-small": {},  # GPT2Config defaults: 124M parameters
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),  # 355M parameters
}


@dataclass
class ModelSpec:
    model: torch.nn.Module
    tokenizer: Any
    description: str
    source_dir: Optional[str] = None


def _positions(config) -> Optional[int]:
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def _check_fits(config, tokenizer, seq_len: int, what: str, micro_batch: int = 1) -> None:
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < tokenizer.vocab_size:
        raise TrainError(f"{what}: vocab_size {vocab} is smaller than the tokenizer's {tokenizer.vocab_size} "
                         f"({tokenizer.name}); set vocab_size >= {tokenizer.vocab_size}")
    positions = _positions(config)
    if positions is not None and positions < seq_len:
        raise TrainError(f"{what}: the model takes at most {positions} positions but train.seq_len is "
                         f"{seq_len}; lower train.seq_len or raise n_positions/max_position_embeddings")
    _check_activations(config, seq_len, micro_batch, what)


def activation_bytes(config, seq_len: int, micro_batch: int) -> int:
    """Bytes of activations one fp32 micro-batch keeps for backward: ZeRO-Infinity's eq. 5
    (seed 002) without checkpointing, ``bsz·seq·layers·(16·hidden + 2·heads·seq)`` 2-byte
    elements (doubled for fp32), the ``heads·seq²`` attention scores only where the attention
    stores them (eager; sdpa/flash kernels do not), plus the logits, their fp32 copy and
    gradient (3 x bsz·seq·vocab x 4 bytes)."""
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None) or 1
    hidden = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None) or 0
    heads = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", None) or 1
    vocab = getattr(config, "vocab_size", None) or 0
    scores = 2 * heads * seq_len if getattr(config, "_attn_implementation", None) == "eager" else 0
    return 2 * micro_batch * seq_len * layers * (16 * hidden + scores) + 12 * micro_batch * seq_len * vocab


def _check_activations(config, seq_len: int, micro_batch: int, what: str) -> None:
    """Refuse, before the model is built, a micro-batch whose activations cannot fit the
    memory they live in (host memory on a CPU-only run)."""
    if acc.device().type != "cpu":
        return  # device memory: the engine's device budget and the estimator speak for it
    (have, bound), need = host_available(), activation_bytes(config, seq_len, micro_batch)
    if need > have:
        raise TrainError(f"{what}: train.seq_len {seq_len} x train.micro_batch_size {micro_batch} needs about "
                         f"{fmt_bytes(need)} of activations for one micro-batch (estimate) but only "
                         f"{fmt_bytes(have)} of host memory is available ({bound}); lower train.seq_len or "
                         f"train.micro_batch_size (gradient_accumulation_steps keeps the batch)")


def _causal_lm_from_config(config, what: str):
    from transformers import AutoModelForCausalLM  # optional (the hf extra) and slow to import

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise TrainError(f"{what}: {type(config).__name__} has no causal-LM head in transformers ({err}); "
                         f"use a GPT-style model_type such as gpt2 or llama") from None


def build_model(spec_value, seq_len: int, init=None, micro_batch: int = 1) -> ModelSpec:
    """A preset name, a dict of HF config fields with model_type, or a local directory (built
    under ``init``, the ``infinity.Init`` in effect, if any)."""
    from transformers import AutoConfig, GPT2Config  # optional (the hf extra) and slow to import

    byte_tok = ByteTokenizer()
    if isinstance(spec_value, dict):
        fields = dict(spec_value)
        model_type = fields.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError, TypeError) as err:
            raise TrainError(f"train.model: cannot build a {model_type!r} config from {fields}: {err}") from None
        _check_fits(config, byte_tok, seq_len, "train.model", micro_batch)
        return ModelSpec(_causal_lm_from_config(config, "train.model"), byte_tok, f"{model_type} from config")
    if spec_value in PRESETS:
        fields = dict(PRESETS[spec_value])
        if spec_value == "gpt2-tiny":  # its position table fits the run, up to GPT-2's 1024 (refused above)
            fields["n_positions"] = min(max(256, seq_len), GPT2_POSITIONS)
        config = GPT2Config(**fields)
        _check_fits(config, byte_tok, seq_len, f"preset {spec_value}", micro_batch)
        return ModelSpec(_causal_lm_from_config(config, spec_value), byte_tok, f"{spec_value} (preset)")
    return _model_from_dir(spec_value, seq_len, init, micro_batch)


def _model_from_dir(directory: str, seq_len: int, init=None, micro_batch: int = 1) -> ModelSpec:
    from transformers import AutoConfig, AutoModelForCausalLM  # optional (the hf extra) and slow to import

    if not os.path.isdir(directory):
        raise TrainError(f"train.model {directory!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                         f"existing directory; give a preset name or a directory with config.json")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise TrainError(f"model directory {directory!r} has no config.json; give a directory saved by "
                         f"save_pretrained (config.json + *.safetensors)")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, JSON errors...
        raise TrainError(f"model directory {directory!r}: config.json cannot be read: {err}") from None
    tokenizer = load_hf_tokenizer(directory) if has_tokenizer_files(directory) else ByteTokenizer()
    _check_fits(config, tokenizer, seq_len, f"model directory {directory!r}", micro_batch)
    weights = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    if not weights:
        logger.warning("model directory %s has no *.safetensors weights: starting from random weights", directory)
        return ModelSpec(_causal_lm_from_config(config, directory), tokenizer, f"{directory} (config only)", directory)
    try:
        # Under infinity.Init each rank streams its own chunks into the tiers (Note [streamed load] in _pretrained.py).
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    except InfinityError:
        raise
    except Exception as err:
        raise TrainError(f"model directory {directory!r}: cannot load the weights: {err}") from None
    how = f"{len(weights)} safetensors file(s)"
    if init is not None:
        how += f", streamed from the files into {init.store.tier.value} partitions, each rank reading its own chunks"
        logger.info("model %s: %s", directory, how)
    return ModelSpec(model, tokenizer, f"{directory} ({how})", directory)


def build_partitioned(cfg: Config) -> ModelSpec:
    """Build the model under ``infinity.Init`` for stage 3: partitioned while it is built (a
    model directory is streamed from its files), each chunk checked against the room on its
    tier before it is stored (Note [Init preflight] in _init_context.py)."""
    t = cfg.train
    sizes = _fresh_param_sizes(t.model)  # on the meta device, outside Init (which would take them)
    with Init(config=cfg, enabled=cfg.zero.stage == 3) as init:
        if init.enabled:
            init.store.advice = _FLAG_ADVICE  # a refusal names this job's flags, not Init's arguments
            init.store.halve_hint = None  # the job builds and loads in float32, whatever precision.dtype says
        if sizes is not None:
            _check_build_room(sizes, init if init.enabled else None, t.model)
        return build_model(t.model, t.seq_len, init if init.enabled else None, t.micro_batch_size)


# What a refusal of Init's room tells the train job's user to change, by the tier it refused (Init's own
# advice names its arguments).
_FLAG_ADVICE = {
    Tier.DEVICE: "train with --offload cpu, or --offload nvme --nvme-path DIR, or on more ranks",
    Tier.CPU: "train with --offload nvme --nvme-path DIR (a directory on a fast local disk), or on more ranks",
    Tier.NVME: "give --nvme-path a directory on a larger disk, or free space there",
}


def model_config(spec_value):
    """The Hugging Face config of a model spec (a preset, a dict with model_type, a directory
    with config.json), read without building the model; None where it cannot be read
    (``build_model`` then says why)."""
    from transformers import AutoConfig, GPT2Config  # optional (the hf extra) and slow to import

    try:
        if isinstance(spec_value, dict):
            fields = dict(spec_value)
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        if spec_value in PRESETS:
            return GPT2Config(**PRESETS[spec_value])
        return AutoConfig.from_pretrained(spec_value, local_files_only=True)
    except Exception:  # noqa: BLE001 - whatever it is, build_model names it
        return None


def _fresh_param_sizes(spec_value) -> Optional[List[int]]:
    """The parameter sizes of a model built from scratch (a preset, a dict, a directory without
    weights), counted on the meta device; None when it is loaded from weights (the loader
    checks those before reading: Note [Init preflight] in _init_context.py) or cannot be built (the
    build reports why)."""
    from transformers import AutoModelForCausalLM  # optional (the hf extra) and slow to import

    try:
        if not isinstance(spec_value, dict) and spec_value not in PRESETS and \
                any(f.endswith(".safetensors") for f in os.listdir(spec_value)):
            return None
        config = model_config(spec_value)
        if config is None:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return [p.numel() for p in model.parameters()]
    except Exception:  # noqa: BLE001 - whatever it is, build_model names it
        return None


def _check_build_room(sizes: List[int], init, what) -> None:
    """Refuse a model whose build would not fit before a single parameter exists: under Init
    this rank's fp32 chunks against Init's room on its tier, else the whole fp32 model
    against the available host memory."""
    n = sum(sizes)
    label = f"train.model ({n:,} parameters, counted before building)"
    if init is not None:
        world = comm.world_size()
        init.store.check_room(sum(init.store.slot_bytes(-(-k // world), torch.float32) for k in sizes), label)
        return
    (have, bound), need = host_available(), 4 * n
    if need > have:
        raise InsufficientResourcesError(
            f"{label}: building it in fp32 needs {fmt_bytes(need)} of host memory, {fmt_bytes(have)} available "
            f"({bound}); "
            f"use ZeRO stage 3 (zero.stage: 3), which builds each rank's part only, with "
            f"zero.offload_param.device: nvme, or a smaller model")
