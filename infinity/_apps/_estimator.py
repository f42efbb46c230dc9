"""How much memory a model needs on each tier, and which ZeRO placements fit.

``infinity.estimate(...)`` and ``python -m infinity.estimate`` apply the memory analysis of the
ZeRO-Infinity paper (seed 002, §3) together with the per-stage partitioning of the ZeRO paper
(seed 000, §5) to every stage × parameter tier × optimizer tier, and recommend the fastest
placement that fits the given (or this machine's) GPU, host and NVMe sizes.

Note: the formulas, and where they come from
    Ψ parameters, nl layers, hd hidden size, bsz micro-batch per GPU, seq sequence length,
    ci layers between activation checkpoints, N = data-parallel ranks (GPUs over all nodes).

    Model states (002 §3): mixed precision with Adam keeps low-precision parameters (2Ψ) and
    gradients (2Ψ) plus fp32 parameters, momentum, variance and gradients (16Ψ): 20Ψ bytes,
    i.e. 240·nl·hd² bytes with Ψ ≈ 12·nl·hd² (eq. 1-2). The ZeRO paper (000) counts K = 12
    without the fp32 gradient; infinity accumulates its gradient shards in fp32, so it pays
    the paper-002 figure. With dtype fp32 there is no master copy: 4Ψ + 4Ψ + 8Ψ (m, v).

    Partitioning (000 §5): stage 1 splits the optimizer states over N (P·Ψ + G·Ψ + O·Ψ/N per
    rank), stage 2 also the gradients (P·Ψ + (G+O)·Ψ/N), stage 3 also the parameters
    ((P+G+O)·Ψ/N). Only stage 3 can move parameters off the device. The gradient shard of
    stage 2/3 lives with the optimizer states (``offload_optimizer`` moves both).

    Activation checkpoints (002 eq. 3): 2·bsz·seq·hd·nl/ci bytes per GPU (2 = bytes of a
    low-precision element; 4 for fp32). They stay on the device.

    Model-state working memory, MSWM (002 eq. 4): the parameters and gradients of the largest
    single operator, 4·hd·4hd bytes for the hd→4hd linear layer. When the model is known the
    largest operator may instead be the embedding (vocab·hd) or a wider MLP. Stage 3 needs it
    for every placement (the operator is gathered whole); stage 2 needs the full gradient of
    that operator before its reduce-scatter; stage 1 keeps everything whole already.

    Activation working memory, AWM (002 eq. 5): bsz·seq·ci·(16·hd + 2·heads·seq) bytes: the
    activations recomputed between two checkpoints during backward.

    Memory-centric tiling (002 §5.1.3): with tiling factor f (zero.tiling) the largest operator
    is gathered and differentiated one tile at a time, so MSWM (and stage 2's full gradient of
    it) is divided by f: (P+G)·⌈largest/f⌉. AWM is unchanged (a tile's output is a slice of the
    operator's). When no placement fits, the estimate tries f = 2, 4, ... 4096 and names the
    smallest that makes one fit, with its zero.tiling.max_tile_params.

    NVMe tiers need host memory of their own, computed by the stores' own formulas with the
    config's defaults (``_staging_bytes``; the preflight of a real run checks the same bytes):
    the parameter tier's staging pool and hand-off buffers (shards of the largest operator),
    the optimizer swapper's buffer sets, its host cache of the first unit (the embedding) and,
    in stages 2-3 when they take at most a quarter of host memory, the fp32 gradient shards.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .._offload._layout import ParamSource
from .._offload._memory_plan import GRADIENTS, OPT_STATES, PARAM_SHARDS
from .._offload._moments import MODES, file_bytes
from .._offload._optimizer_store import chunk_elems, head_elems
from .._offload._preflight import staging_buffers, store_plan
from .._runtime._tiers import Tier
from ..config import Config
from ._estimate_hardware import Hardware, _detect_hardware
from ._estimate_model import (
    _NVME_PATH_PLACEHOLDER,
    EstimateError,
    Shape,
    _closed_form_params,
    _format_bytes,
    _format_count,
    _shape_for_params,
    _shape_from_model,
    parse_count,
    parse_size,
)

__all__ = ["estimate", "Estimate", "PlacementEstimate", "Recommendation", "EstimateError",
           "parse_size", "parse_count"]

# --------------------------------------------------------------------------- the estimate

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

    def nvme_saving(self, n: int) -> int:
        """Bytes the compressed moments save on NVMe for ``n`` elements (Note [compressed moments] in _moments.py)."""
        return 2 * (4 * n - file_bytes(self.moments, n, chunk_elems(None, n))) if n else 0

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


def tier_name(tier: Tier) -> str:
    """A tier in the config's words: ``offload_*.device`` says none for the device tier."""
    return "none" if tier is Tier.DEVICE else str(tier)


@dataclass(frozen=True)
class Terms:
    """The per-GPU residual and working-memory terms of 002 §3, and the model-state total."""

    model_states: int          # all ranks together (Fig. 2a column 5)
    activation_checkpoints: int
    activation_working: int
    model_state_working: int


@dataclass(frozen=True)
class PlacementEstimate:
    """One ZeRO stage with its parameter and optimizer tiers, and what it needs where."""

    stage: int
    param_tier: Tier
    optimizer_tier: Tier
    device_bytes: int          # per GPU
    host_bytes: int            # per node
    nvme_bytes: int            # per node
    fits_device: bool
    fits_host: bool
    fits_nvme: bool
    host_plan: dict = field(default_factory=dict)  # per node: the NVMe tiers' host buffers by category

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme

    @property
    def key(self) -> tuple:
        return (self.stage, self.param_tier, self.optimizer_tier)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(param_tier=str(self.param_tier), optimizer_tier=str(self.optimizer_tier),
                   fits=self.fits)
        return out


@dataclass(frozen=True)
class Recommendation:
    placement: PlacementEstimate
    config: dict


_D, _C, _N = Tier.DEVICE, Tier.CPU, Tier.NVME
# Fastest first. Stage 2 before 1 (same communication volume, less memory; 000 §7), stage 3
# last within a group (1.5× the communication). Placements whose optimizer sits on a faster
# tier than the parameters are legal but never better than their mirror, so they come last.
_PREFERENCE = ((2, _D, _D), (1, _D, _D), (3, _D, _D),
               (2, _D, _C), (1, _D, _C), (3, _D, _C), (3, _C, _C),
               (2, _D, _N), (1, _D, _N), (3, _D, _N), (3, _C, _N),
               (3, _N, _C), (3, _N, _N),
               (3, _C, _D), (3, _N, _D))


@dataclass
class Estimate:
    """Memory per tier for every placement; see the module Note for the formulas."""

    params: int
    shape: Shape
    seq_len: int
    micro_batch: int
    ckpt_interval: int
    precision: Precision
    hardware: Hardware
    terms: Terms
    placements: list = field(default_factory=list)
    nvme_path: Optional[str] = None
    tiling_factor: int = 1                # the factor these placements were computed with
    tiling_needed: Optional["Estimate"] = None  # nothing fits: the estimate at the smallest factor that fits

    def placement(self, stage: int, param_tier: str, optimizer_tier: str) -> PlacementEstimate:
        wanted = (stage, Tier(param_tier), Tier(optimizer_tier))
        for p in self.placements:
            if p.key == wanted:
                return p
        raise EstimateError(f"no placement stage={stage} params={param_tier} "
                            f"optimizer={optimizer_tier}; parameters leave the device only "
                            "at stage 3")

    @property
    def fitting(self) -> list:
        return [p for p in self.placements if p.fits]

    @property
    def recommended(self) -> Optional[Recommendation]:
        """The fastest placement that fits, with its config in infinity's keys; None if none."""
        order = {key: i for i, key in enumerate(_PREFERENCE)}
        fitting = sorted(self.fitting, key=lambda p: order[p.key])
        if not fitting:
            return None
        return Recommendation(fitting[0], self._config_for(fitting[0]))

    def _config_for(self, p: PlacementEstimate) -> dict:
        path = self.nvme_path or _NVME_PATH_PLACEHOLDER

        def offload(tier: Tier) -> dict:
            if tier is Tier.DEVICE:
                return {"device": "none"}
            return {"device": "nvme", "nvme_path": path} if tier is Tier.NVME else {"device": "cpu"}

        zero = {"stage": p.stage, "offload_param": offload(p.param_tier), "offload_optimizer": offload(p.optimizer_tier)}
        if self.tiling_factor > 1:
            zero["tiling"] = {"enabled": True, "max_tile_params": self.max_tile_params}
        return {"zero": zero, "precision": {"dtype": self.precision.name}}

    @property
    def max_tile_params(self) -> int:
        return math.ceil(self.shape.largest_operator_numel / self.tiling_factor)

    def to_dict(self) -> dict:
        rec = self.recommended
        return {
            "params": self.params,
            "shape": asdict(self.shape),
            "seq_len": self.seq_len, "micro_batch": self.micro_batch,
            "ckpt_interval": self.ckpt_interval, "dtype": self.precision.name,
            "bytes_per_param": self.precision.total,
            "hardware": {**asdict(self.hardware), "detected": list(self.hardware.detected)},
            "terms": asdict(self.terms),
            "placements": [p.to_dict() for p in self.placements],
            "tiling_factor": self.tiling_factor,
            "tiling_needed": None if self.tiling_needed is None else {
                "factor": self.tiling_needed.tiling_factor, "max_tile_params": self.tiling_needed.max_tile_params,
                "recommended": self.tiling_needed.recommended.config},
            "recommended": None if rec is None else {"placement": rec.placement.to_dict(),
                                                     "config": rec.config},
        }

    def table(self) -> str:
        return "\n".join(self._header_lines() + [""] + self._placement_lines())

    def _header_lines(self) -> list:
        s, hw, t = self.shape, self.hardware, self.terms
        guessed = (f" ({s.known}'s shape, for the parameter count)" if s.known else
                   " (shape derived from the parameter count)" if s.derived else "")
        mark = lambda name: " (this machine)" if name in hw.detected else ""  # noqa: E731
        device = ("no accelerator: device tier is host memory"
                  if hw.device_is_host else f"{_format_bytes(hw.gpu_mem)}/GPU{mark('gpu_mem')}")
        return [
            f"model: {_format_count(self.params)} parameters, {s.layers} layers, hidden "
            f"{s.hidden}, {s.heads} heads{guessed}",
            f"batch: micro-batch {self.micro_batch} x seq {self.seq_len} per GPU, a checkpoint "
            f"every {self.ckpt_interval} layer(s), {self.precision.name} "
            f"({self.precision.total} bytes/param of model states)",
            f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s){mark('gpus')}, {device}, "
            f"host {_format_bytes(hw.cpu_mem)}/node{mark('cpu_mem')}, "
            f"NVMe {_format_bytes(hw.nvme)}/node{mark('nvme')}",
            f"model states, all ranks:         {_format_bytes(t.model_states)}",
            f"activation checkpoints, per GPU: {_format_bytes(t.activation_checkpoints)}",
            f"activation working memory:       {_format_bytes(t.activation_working)}",
            f"model-state working memory:      {_format_bytes(t.model_state_working)} "
            "(largest operator's params + grads" + (f", tiled {self.tiling_factor} ways: tiles of "
                                                   f"{_format_count(self.max_tile_params)} params)"
                                                   if self.tiling_factor > 1 else ")"),
        ]

    def _placement_lines(self) -> list:
        head = ("stage", "params", "optimizer", "device/GPU", "host/node", "nvme/node", "fits")
        rows = [head]
        for p in self.placements:
            full = [tier for tier, ok in (("device", p.fits_device), ("host", p.fits_host),
                                          ("nvme", p.fits_nvme)) if not ok]
            rows.append((str(p.stage), tier_name(p.param_tier), tier_name(p.optimizer_tier),
                         _format_bytes(p.device_bytes), _format_bytes(p.host_bytes),
                         _format_bytes(p.nvme_bytes),
                         "yes" if p.fits else "no: " + ", ".join(full)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _terms(params: int, trainable: int, shape: Shape, seq: int, bsz: int, ci: int, prec: Precision,
           tiling: int = 1) -> Terms:
    ckpt = 2 * bsz * seq * shape.hidden * math.ceil(shape.layers / ci)          # 002 eq. 3
    awm = bsz * seq * ci * (16 * shape.hidden + 2 * shape.heads * seq)          # 002 eq. 5
    scale = prec.activation / 2          # both equations count 2-byte activations
    mswm = (prec.param + prec.grad) * math.ceil(shape.largest_operator_numel / tiling)  # 002 eq. 4, tiled
    states = prec.param * params + (prec.total - prec.param) * trainable  # frozen: the parameter only
    return Terms(model_states=states, activation_checkpoints=int(ckpt * scale),
                 activation_working=int(awm * scale), model_state_working=mswm)


def _placement(stage, ptier, otier, params, trainable, shape, terms, prec, hw, tiling: int = 1) -> PlacementEstimate:
    ranks, per_node = hw.ranks, hw.gpus_per_node
    shard = math.ceil(params / ranks)
    tshard = math.ceil(trainable / ranks)  # gradients and optimizer states exist for trainable parameters only
    tiers = {Tier.DEVICE: 0, Tier.CPU: 0, Tier.NVME: 0}                    # bytes per GPU
    # Note [parameters from the master] in _placement.py: the engine's rule, for a model whose trainable
    # parameters are all of it; parameters from the master are counted on the master's tier
    source = ParamSource.of(partitioned=stage == 3, fp32=prec.name == "fp32", same_spaces=trainable == params,
                            opt_tier=otier, param_tier=ptier, device_is_host=hw.device_is_host)
    tiers[otier if source.from_master else ptier] += prec.param * (shard if stage == 3 else params)
    if stage == 1:
        tiers[Tier.DEVICE] += prec.grad * trainable
        tiers[otier] += prec.optimizer * tshard
    else:
        tiers[otier] += (prec.grad + prec.optimizer) * tshard
    working = {1: 0, 2: prec.grad * math.ceil(shape.largest_operator_numel / tiling), 3: terms.model_state_working}
    device = (tiers[Tier.DEVICE] + working[stage] + terms.activation_checkpoints
              + terms.activation_working)
    if otier is Tier.NVME:
        tiers[Tier.NVME] -= prec.nvme_saving(tshard)
    staging = _staging_bytes(stage, ptier, otier, tshard, shape, prec, hw, source)
    host = per_node * (tiers[Tier.CPU] + sum(staging.values()))
    nvme = per_node * tiers[Tier.NVME]
    if hw.device_is_host:     # one memory holds both tiers
        fits_device = fits_host = device * per_node + host <= hw.cpu_mem
    else:
        fits_device, fits_host = device <= hw.gpu_mem, host <= hw.cpu_mem
    return PlacementEstimate(stage, ptier, otier, device_bytes=device, host_bytes=host, nvme_bytes=nvme,
                     fits_device=fits_device, fits_host=fits_host, fits_nvme=nvme <= hw.nvme,
                     host_plan={k: per_node * v for k, v in staging.items()})


def _staging_bytes(stage, ptier, otier, tshard, shape, prec, hw, source: ParamSource = ParamSource.OWN) -> dict:
    """Host buffers of the NVMe tiers per GPU by category: the stores' own plan (Note [one
    memory model] in _memory_plan.py) for a layout made from the shape, with the config's defaults
    (the preflight of a real run checks the same bytes)."""
    if Tier.NVME not in (ptier, otier):
        return {}
    z = Config().zero
    largest = math.ceil(shape.largest_operator_numel / hw.ranks)
    chunk = chunk_elems(z.offload_optimizer.chunk_size, tshard)
    first = math.ceil((shape.vocab * shape.hidden if shape.vocab else shape.largest_operator_numel) / hw.ranks)
    head = head_elems(z.offload_optimizer.host_cache, [(0, first)], chunk, tshard)  # the first unit, cached
    grads_in_host = stage > 1 and 4 * tshard * hw.gpus_per_node <= hw.cpu_mem // 4  # the "auto" rule
    plan = store_plan(opt_tier=otier, param_tier=ptier if ptier is Tier.NVME else None, opt_total=tshard,
                      param_total=tshard, itemsize=prec.param, overlapped=False, lazy_grad=False, chunk=chunk, head=head,
                      grads_in_memory=grads_in_host, staging_numel=largest, staging_count=staging_buffers(z),
                      param_source=source,  # Note [parameters from the master] in _placement.py
                      gathered_bytes=0, moments=prec.moments)["host"]
    if otier is not Tier.NVME:  # the memory tier's states are the paper's terms (_placement), not buffers
        plan = {k: v for k, v in plan.items() if k not in (OPT_STATES, GRADIENTS)}
    plan.pop(PARAM_SHARDS, None)
    return plan


def _positive_int(value: Any, what: str, allow_none: bool = True) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{what}: expected a positive integer, got {value!r}")
    return value


def _optional_size(value: Any, what: str) -> Optional[int]:
    return None if value is None else parse_size(value, what)


def estimate(params: Any = None, *, model: Any = None, layers: Optional[int] = None,
             hidden: Optional[int] = None, heads: Optional[int] = None, seq_len: int = 1024,
             micro_batch: int = 1, ckpt_interval: int = 1, gpus: Optional[int] = None,
             nodes: int = 1, gpu_mem: Any = None, cpu_mem: Any = None, nvme: Any = None,
             dtype: str = "bf16", nvme_path: Optional[str] = None, trainable: Any = None,
             tiling_factor: int = 1, moments: str = "fp32") -> Estimate:
    """Memory per tier for each ZeRO stage and offload choice, and which of them fit.

    ``params`` is a count (``1e12``, ``"70B"``); ``model`` a transformers config, a dict of
    config fields, or a path to a config.json (or its directory). ``gpus`` is per node;
    ``gpu_mem`` / ``cpu_mem`` / ``nvme`` are per GPU / per node / per node (``"32GB"``,
    ``"1.5TB"``, bytes). Sizes left out are read from this machine; the NVMe size is the free
    space under ``nvme_path`` (default: the temp directory). ``trainable``: how many of the
    parameters are trained (LoRA, frozen layers; default all): frozen parameters cost their
    low-precision copy only, no gradient and no optimizer state. ``tiling_factor``: the largest
    operator split into this many tiles (zero.tiling); when nothing fits, ``tiling_needed`` is
    the estimate at the smallest factor (a power of two) that makes a placement fit, if any.
    ``moments``: ``zero.offload_optimizer.moments`` (bf16/int8 shrink the moments on NVMe).
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
        _positive_int(value, name)
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch),
                        ("ckpt_interval", ckpt_interval), ("nodes", nodes)):
        _positive_int(value, name, allow_none=False)
    _positive_int(gpus, "gpus")
    _positive_int(tiling_factor, "tiling_factor", allow_none=False)
    prec = Precision.of(dtype, moments)
    shape, params = _resolve_model(params, model, layers, hidden, heads)
    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise EstimateError(f"nvme_path: {nvme_path!r} is not a directory")
    hw = _detect_hardware(gpus, nodes, _optional_size(gpu_mem, "gpu_mem"),
                          _optional_size(cpu_mem, "cpu_mem"), _optional_size(nvme, "nvme"),
                          nvme_path or tempfile.gettempdir())
    trained = params if trainable is None else parse_count(trainable, "trainable")
    if trained > params:
        raise EstimateError(f"trainable: {trained} is more than the model's {params} parameters")
    def at(factor: int) -> Estimate:
        terms = _terms(params, trained, shape, seq_len, micro_batch, ckpt_interval, prec, factor)
        grid = [(s, pt, ot) for s in (1, 2, 3) for pt in Tier for ot in Tier if s == 3 or pt is Tier.DEVICE]
        placements = [_placement(s, pt, ot, params, trained, shape, terms, prec, hw, factor) for s, pt, ot in grid]
        return Estimate(params=params, shape=shape, seq_len=seq_len, micro_batch=micro_batch,
                        ckpt_interval=ckpt_interval, precision=prec, hardware=hw, terms=terms,
                        placements=placements, nvme_path=nvme_path, tiling_factor=factor)

    est = at(tiling_factor)
    if not est.fitting:
        est.tiling_needed = _smallest_tiling(at, tiling_factor)
    return est


_MAX_TILING = 4096


def _smallest_tiling(at, start: int) -> Optional[Estimate]:
    """The estimate at the smallest power-of-two tiling factor above ``start`` with a placement
    that fits; None when tiling alone cannot make one fit."""
    factor = 2
    while factor <= _MAX_TILING:
        est = at(factor) if factor > start else None
        if est is not None and est.fitting:
            return est
        if est is not None and factor >= est.shape.largest_operator_numel:
            return None  # tiles of one parameter: tiling cannot go further
        factor *= 2
    return None


def _resolve_model(params, model, layers, hidden, heads) -> tuple[Shape, int]:
    count = None if params is None else parse_count(params)
    if model is not None:
        shape, counted = _shape_from_model(model)
        overrides = {k: v for k, v in (("layers", layers), ("hidden", hidden), ("heads", heads))
                     if v is not None}
        return Shape(**{**asdict(shape), **overrides}), count or counted
    if layers is not None and hidden is not None:
        shape = Shape(layers=layers, hidden=hidden, heads=heads or max(1, hidden // 128))
        return shape, count or _closed_form_params(shape)
    if count is None:
        raise EstimateError("give a parameter count (params / --params), a model config "
                            "(model / --model), or both layers and hidden")
    return _shape_for_params(count, layers, hidden, heads), count
