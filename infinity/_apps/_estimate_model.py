"""What ``infinity.estimate`` is given: sizes and counts as text (``parse_size``,
``parse_count``), the precision's bytes per parameter, and the model's shape, from a parameter
count (interpolated between the paper's shapes), from explicit layers / hidden / heads, or from
a Hugging Face config or directory (Note: the formulas, in _estimator.py); and the model itself
on the meta device (Note [the planned decoder]).

Note [the planned decoder]: the estimator's table, ``--plan`` and ``--step-time`` speak of one
model: the estimator plans each placement with the engine's own functions (Note [planned by
the engine] in _plan.py), which need the model's fetch units, so a shape is built as a model on
the meta device. A config that transformers can build is that model (``--plan`` builds the
same); a shape alone (a bare count, or layers and hidden) is ``decoder``: a Llama (every matrix
an ``nn.Linear``, which zero.tiling tiles; ``--arch gpt2``: a GPT-2, whose ``Conv1D`` it does
not) with the modules, names, tied weights and parameter shapes of transformers' own
(``build_meta`` in _plan.py, with the vocabulary ``vocab_of`` gives), built here without
transformers and without initializing anything, so its units, their tiles and its parameter
count are those of ``--plan`` (tests/unit/test_estimate_plan.py compares them). Its count is
the estimate's: a bare count takes the shape whose decoder has about that many parameters, its
embedding and head included (a bare 7B: 48 layers x 3392, 7.05B). ``trainable`` trains the
model's last parameters that fit and an adapter in its last block for the rest (``freeze``)."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from .._offload._moments import MODES
from .._runtime._log import logger
from ..errors import EstimateError

_NVME_PATH_PLACEHOLDER = "/local_nvme"
GPT2_VOCAB = 50257  # the vocabulary of a decoder given by its shape only (GPT-2's)
GPT2_POSITIONS = 1024  # GPT2Config's n_positions
ARCHS = ("gpt2", "llama")  # the decoders a shape is built as


# --------------------------------------------------------------------------- parsing sizes

_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_p + "b"] = 1000 ** _i
    _SIZE_UNITS[_p + "ib"] = 1024 ** _i
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_RE = re.compile(r"^\s*" + _NUMBER + r"\s*([A-Za-z]*)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from ``32GB`` (10⁹), ``512MiB`` (2²⁰), ``1.5TB``, ``1e9`` or an int."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if match is None:
            raise EstimateError(f"{what}: cannot read {value!r} as a size; write e.g. 32GB, "
                                "1.5TB, 512MiB or a number of bytes")
        number, unit = float(match.group(1)), match.group(2)
    scale = _SIZE_UNITS.get(unit.lower())
    if scale is None:
        units = "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"
        raise EstimateError(f"{what}: unknown unit {unit!r} in {value!r}; use one of {units}")
    if not math.isfinite(number) or number < 0:
        raise EstimateError(f"{what}: {value!r} must be a non-negative size")
    return int(number * scale)


def parse_count(value: Any, what: str = "params") -> int:
    """A parameter count from ``1e12``, ``70B``, ``1.5T``, ``350M`` or an int."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.match(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]?)\s*$",
                         str(value))
        if match is None or match.group(2).lower() not in _COUNT_UNITS:
            raise EstimateError(f"{what}: cannot read {value!r} as a count; write e.g. 1e12, "
                                "70B, 1.5T or 350M")
        number, unit = float(match.group(1)), match.group(2).lower()
    count = number * _COUNT_UNITS[unit]
    if not math.isfinite(count) or count < 1:
        raise EstimateError(f"{what}: {value!r} must be a positive number")
    return int(round(count))


def _format_bytes(n: float) -> str:
    for unit, scale in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.2f} KiB" if n >= 1024 else f"{int(n)} B"


def _format_count(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _positive_int(value: Any, what: str, allow_none: bool = True) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{what}: expected a positive integer, got {value!r}")
    return value


def _optional_size(value: Any, what: str) -> Optional[int]:
    return None if value is None else parse_size(value, what)


# --------------------------------------------------------------------------- precision

@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: low-precision param, its gradient, optimizer-side states."""

    name: str
    param: int
    grad: int
    optimizer: int
    activation: int
    moments: str = "fp32"  # zero.offload_optimizer.moments: how the moments are stored on NVMe

    @classmethod
    def of(cls, dtype: str, moments: str = "fp32") -> "Precision":
        if moments not in MODES:
            raise EstimateError(f"moments: {moments!r} is not supported; use {', '.join(MODES)}")
        if dtype in ("bf16", "fp16"):
            return cls(dtype, param=2, grad=2, optimizer=16, activation=2, moments=moments)   # 002 §3: 20 B/param
        if dtype == "fp32":
            return cls(dtype, param=4, grad=4, optimizer=8, activation=4, moments=moments)    # m, v only
        raise EstimateError(f"dtype: {dtype!r} is not supported; use bf16, fp16 or fp32")

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


# --------------------------------------------------------------------------- model shape

@dataclass(frozen=True)
class Shape:
    """The transformer dimensions that the activation and working-memory terms need."""

    layers: int
    hidden: int
    heads: int
    vocab: Optional[int] = None        # unknown when only a parameter count was given
    ffn: Optional[int] = None          # MLP width; 4·hidden when unknown
    derived: bool = False              # True when guessed from the parameter count
    kv_heads: Optional[int] = None     # grouped-query attention's key/value heads; heads when unknown
    known: Optional[str] = None        # the published model whose shape a bare count took

    @property
    def largest_operator_numel(self) -> int:
        """Elements of the biggest single weight: the hd→4hd linear of 002 eq. 4, or wider."""
        candidates = [self.hidden * (self.ffn or 4 * self.hidden), 3 * self.hidden**2]
        if self.vocab:
            candidates.append(self.vocab * self.hidden)
        return max(candidates)


# (layers, hidden, heads) of the paper's models: GPT-2 small, Fig. 6a's 1.4B and 10B, and the
# five rows of Fig. 2a (0.1T, 0.5T, 1T, 10T, 100T). Between them the number of layers and heads
# is interpolated in log space against Ψ = 12·nl·hd², and hd follows from that same rule.
_PAPER_SHAPES = ((12, 768, 12), (40, 1536, 16), (50, 4096, 16), (80, 10240, 128),
                 (100, 20480, 160), (128, 25600, 256), (195, 65536, 512), (315, 163840, 1024))


# Published shapes a bare parameter count within 2% of theirs takes instead of an interpolated one.
_KNOWN_SHAPES = {
    "Llama-2/3 70B": (70 * 10**9, Shape(layers=80, hidden=8192, heads=64, vocab=32000, ffn=28672, derived=True,
                                        kv_heads=8, known="Llama-2/3 70B")),
}


def _interpolate_log(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    lx = math.log(x)
    lxs = [math.log(v) for v in xs]
    i = 1
    while i < len(lxs) - 1 and lx > lxs[i]:
        i += 1
    t = (lx - lxs[i - 1]) / (lxs[i] - lxs[i - 1])   # extrapolates with the end segments
    return math.exp(math.log(ys[i - 1]) + t * (math.log(ys[i]) - math.log(ys[i - 1])))


def _shape_for_params(params: int, layers: Optional[int] = None,
                      hidden: Optional[int] = None, heads: Optional[int] = None, embeddings: int = 0) -> Shape:
    """A GPT-3-like shape for Ψ parameters following the paper's model sizes (Fig. 2a).

    Layers and heads are interpolated between the paper's models, heads rounded to a power of
    two, and hd solves 12·nl·hd² + E·hd = Ψ (E: ``embeddings``, the rows of the decoder's
    vocabulary matrices, so that the decoder planned has about Ψ parameters: Note [the planned
    decoder]), rounded to a multiple of the heads (at least of 64).
    """
    if layers is None and hidden is None and heads is None:
        for name, (count, shape) in _KNOWN_SHAPES.items():
            if abs(params / count - 1) <= 0.02:
                return shape
    sizes = [12 * nl * hd * hd for nl, hd, _ in _PAPER_SHAPES]
    if layers is None and hidden is not None:
        layers = max(1, round((params - embeddings * hidden) / (12 * hidden * hidden)))
    if layers is None:
        layers = max(1, round(_interpolate_log(params, sizes, [s[0] for s in _PAPER_SHAPES])))
    if heads is None:
        guess = _interpolate_log(params, sizes, [s[2] for s in _PAPER_SHAPES])
        heads = 2 ** max(0, round(math.log2(guess)))
        if hidden is not None:    # the divisor of the given width nearest the guess
            divisors = [h for h in range(1, hidden + 1) if hidden % h == 0]
            heads = min(divisors, key=lambda h: abs(math.log(h / guess)))
    if hidden is None:
        step = max(64, heads)
        root = (math.sqrt(embeddings**2 + 48 * layers * params) - embeddings) / (24 * layers)
        hidden = max(step, step * round(root / step))
    return Shape(layers=layers, hidden=hidden, heads=heads, derived=True)


_CONFIG_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "vocab": ("vocab_size",),
}


def _config_dict(model: Any) -> tuple[dict, Any]:
    """(fields, transformers config object or None) from any accepted ``model`` form."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise EstimateError(f"model: {model!r} is neither a config.json nor a directory "
                                "holding one")
        try:
            with open(path, encoding="utf-8") as f:
                fields = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise EstimateError(f"model: cannot read {path}: {exc}") from exc
        if not isinstance(fields, dict):
            raise EstimateError(f"model: {path} must hold a JSON object of config fields")
        return fields, None
    if isinstance(model, dict):
        return dict(model), None
    if hasattr(model, "to_dict"):     # a transformers PretrainedConfig
        return model.to_dict(), model
    raise EstimateError(f"model: expected a transformers config, a dict, or a path to a "
                        f"config.json, got {type(model).__name__}")


def _field(fields: dict, name: str) -> Optional[int]:
    for key in _CONFIG_KEYS[name]:
        if isinstance(fields.get(key), int) and fields[key] > 0:
            return fields[key]
    return None


def _built_with_transformers(fields: dict, config: Any) -> Optional[nn.Module]:
    """The model of a config built by transformers on the meta device (no memory used), or None
    where transformers is missing or cannot build it."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM  # optional (the hf extra): planned without it
    except ImportError:
        return None
    try:
        if config is None:
            if "model_type" not in fields:
                return None
            rest = {k: v for k, v in fields.items() if k != "model_type"}
            config = AutoConfig.for_model(fields["model_type"], **rest)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # unknown architecture, bad fields: the decoder of its shape stands in
        logger.info("estimate: transformers could not build the model (%s); planning the decoder of its shape", exc)
        return None


def _shape_from_model(model: Any) -> Tuple[Shape, Callable[[], nn.Module]]:
    """The shape of a model config and a builder of the model on the meta device (Note [the
    planned decoder]): transformers' model where it can build it, else the decoder of the shape
    (a Llama for a Llama config, else a GPT-2)."""
    fields, config = _config_dict(model)
    dims = {name: _field(fields, name) for name in _CONFIG_KEYS}
    if dims["layers"] is None or dims["hidden"] is None:
        raise EstimateError("model: the config must give the number of layers "
                            "(num_hidden_layers / n_layer) and the hidden size "
                            "(hidden_size / n_embd)")
    heads = dims["heads"] or max(1, dims["hidden"] // 128)
    kv = fields.get("num_key_value_heads")
    shape = Shape(layers=dims["layers"], hidden=dims["hidden"], heads=heads,
                  vocab=dims["vocab"], ffn=dims["ffn"], kv_heads=kv if isinstance(kv, int) and kv > 0 else None)
    built = [_built_with_transformers(fields, config)]
    if built[0] is not None:  # built once here; again for each later call (zero.tiling changes what it is given)
        return shape, lambda: built.pop() if built else _built_with_transformers(fields, config)
    arch = "llama" if fields.get("model_type") == "llama" else "gpt2"
    return shape, lambda: decoder(shape, arch)


# --------------------------------------------------------------------------- the planned decoder

def vocab_of(shape: Shape) -> int:
    """The vocabulary of the decoder a shape is built as (Note [the planned decoder])."""
    return shape.vocab or GPT2_VOCAB


def llama_ffn(shape: Shape) -> int:
    """A Llama's MLP width: the shape's, else 8/3 of the hidden size rounded up to a multiple of
    256 (as many parameters as GPT-2's 4x MLP)."""
    return shape.ffn or -(-8 * shape.hidden // 3 // 256) * 256


class _Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: a weight (in, out) and a bias; a type zero.tiling does not tile."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(n_in, n_out)), nn.Parameter(torch.empty(n_out))


class _Norm(nn.Module):
    """A LayerNorm (weight and bias) or an RMSNorm (weight only)."""

    def __init__(self, hidden: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))
        self.register_parameter("bias", nn.Parameter(torch.empty(hidden)) if bias else None)


def _linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    """An ``nn.Linear`` (the type zero.tiling tiles) of uninitialized meta tensors: a trillion
    parameters' worth is built in milliseconds."""
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = n_in, n_out
    m.weight = nn.Parameter(torch.empty(n_out, n_in))
    m.register_parameter("bias", nn.Parameter(torch.empty(n_out)) if bias else None)
    return m


def _embedding(rows: int, dim: int) -> nn.Embedding:
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))  # given a weight: not initialized


def _module(**children) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        setattr(m, name, child)
    return m


def _gpt2_block(hd: int, inner: int) -> nn.Module:
    return _module(ln_1=_Norm(hd), attn=_module(c_attn=_Conv1D(hd, 3 * hd), c_proj=_Conv1D(hd, hd)),
                   ln_2=_Norm(hd), mlp=_module(c_fc=_Conv1D(hd, inner), c_proj=_Conv1D(inner, hd)))


def _llama_layer(hd: int, heads: int, kv_heads: int, ffn: int) -> nn.Module:
    head_dim = hd // heads
    attn = _module(q_proj=_linear(hd, heads * head_dim), k_proj=_linear(hd, kv_heads * head_dim),
                   v_proj=_linear(hd, kv_heads * head_dim), o_proj=_linear(heads * head_dim, hd))
    return _module(self_attn=attn, mlp=_module(gate_proj=_linear(hd, ffn), up_proj=_linear(hd, ffn),
                                               down_proj=_linear(ffn, hd)),
                   input_layernorm=_Norm(hd, bias=False), post_attention_layernorm=_Norm(hd, bias=False))


def decoder(shape: Shape, arch: str = "llama") -> nn.Module:
    """Note [the planned decoder]: transformers' LlamaForCausalLM (untied head) or GPT2LMHeadModel
    (tied head) of ``shape``, on the meta device, as ``build_meta`` in _plan.py builds it."""
    if arch not in ARCHS:
        raise EstimateError(f"arch: {arch!r}; use one of {', '.join(ARCHS)}")
    hd, vocab = shape.hidden, vocab_of(shape)
    with torch.device("meta"):
        if arch == "gpt2":
            body = _module(wte=_embedding(vocab, hd), wpe=_embedding(GPT2_POSITIONS, hd),
                           h=nn.ModuleList(_gpt2_block(hd, shape.ffn or 4 * hd) for _ in range(shape.layers)),
                           ln_f=_Norm(hd))
            model = _module(transformer=body, lm_head=_linear(hd, vocab))
            model.lm_head.weight = body.wte.weight  # tied, as GPT-2's
            return model
        layers = nn.ModuleList(_llama_layer(hd, shape.heads, shape.kv_heads or shape.heads, llama_ffn(shape))
                               for _ in range(shape.layers))
        body = _module(embed_tokens=_embedding(vocab, hd), layers=layers, norm=_Norm(hd, bias=False))
        return _module(model=body, lm_head=_linear(hd, vocab))


def freeze(model, trainable: Optional[int]) -> int:
    """Train ``trainable`` elements of ``model`` (None: all): its last parameters that fit (the top
    layers, as when the lower ones are frozen), and the rest as an adapter in its last block (as
    LoRA's sit beside frozen weights); the model's parameter count then."""
    params = list(model.parameters())
    if trainable is None:
        return sum(p.numel() for p in params)
    left = trainable
    for p in reversed(params):
        p.requires_grad_(p.numel() <= left)
        left -= p.numel() if p.requires_grad else 0
    if left:
        blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        owner = blocks[-1][-1] if blocks else model
        owner.register_parameter("adapter", nn.Parameter(torch.empty(left, device="meta")))
    return sum(p.numel() for p in model.parameters())


def resolve_model(params, model, layers, hidden, heads, arch: Optional[str]) -> Tuple[Shape, Callable, str]:
    """The model's shape, a builder of the model on the meta device (Note [the planned decoder]
    in _estimate_model.py) and the decoder a shape is built as (``arch``, else Llama)."""
    count = None if params is None else parse_count(params)
    if model is not None:
        shape, build = _shape_from_model(model)
        overrides = {k: v for k, v in (("layers", layers), ("hidden", hidden), ("heads", heads))
                     if v is not None}
        if not overrides and arch is None:
            return shape, build, "config"
        shape = Shape(**{**asdict(shape), **overrides})  # another shape than the config's: its decoder
    elif layers is not None and hidden is not None:
        shape = Shape(layers=layers, hidden=hidden, heads=heads or max(1, hidden // 128))
    elif count is None:
        raise EstimateError("give a parameter count (params / --params), a model config "
                            "(model / --model), or both layers and hidden")
    else:  # the decoder's vocabulary matrices: Llama's embedding and head, GPT-2's tied one and its positions
        rows = 2 * GPT2_VOCAB if (arch or "llama") == "llama" else GPT2_VOCAB + GPT2_POSITIONS
        shape = _shape_for_params(count, layers, hidden, heads, embeddings=rows)
    arch = arch or "llama"  # every matrix an nn.Linear: zero.tiling tiles them all
    built = decoder(shape, arch)
    counted = sum(p.numel() for p in built.parameters())
    if count is not None and abs(counted / count - 1) > 0.02:
        logger.info("estimate: %s parameters given; the %s decoder of %d layers x %d planned has %s",
                    _format_count(count), arch, shape.layers, shape.hidden, _format_count(counted))
    return shape, lambda: decoder(shape, arch), arch
