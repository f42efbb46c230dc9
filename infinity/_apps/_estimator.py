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
    ((P+G+O)·Ψ/N). Only stage 3 can move parameters off the device. The table's rows are not
    these terms but the engine's own plan of each placement (Note [planned by the engine] in
    _plan.py, the one computation ``--plan`` makes, for the model of Note [the planned decoder]
    in _estimate_model.py): the stores' bytes per tier (fp32 master weights, moments and
    gradient shards: 16Ψ/N; the compute-dtype gradient is never stored, it is reduce-scattered
    from the device), the whole parameters of stages 1-2, the working memory of the largest
    unit, the NVMe tiers' buffers and caches, and the automatic rules (gradients in host
    memory, the parameter cache, parameters from the master) for the node's host memory.

    Activation checkpoints (002 eq. 3): 2·bsz·seq·hd·nl/ci bytes per GPU (2 = bytes of a
    low-precision element; 4 for fp32). They stay on the device.

    Model-state working memory, MSWM (002 eq. 4): the parameters and gradients of the largest
    single operator, 4·hd·4hd bytes for the hd→4hd linear layer. When the model is known the
    largest operator may instead be the embedding (vocab·hd) or a wider MLP. The header gives
    it; the rows take the engine's working memory of the largest fetch unit instead (stage 3:
    it, the units gathered ahead, its gradient and the parameters that stay gathered; stage 2:
    its gradient before the reduce-scatter; stage 1: the whole gradients until the step).

    Activation working memory, AWM (002 eq. 5): bsz·seq·ci·(16·hd + 2·heads·seq) bytes: the
    activations recomputed between two checkpoints during backward.

    Memory-centric tiling (002 §5.1.3): with tiling factor f (zero.tiling) the largest operator
    is gathered and differentiated one tile at a time, so MSWM is divided by f:
    (P+G)·⌈largest/f⌉; the rows plan the model tiled as ``initialize`` tiles it, tiles of at most
    ⌈largest/f⌉ parameters. AWM is unchanged (a tile's output is a slice of the operator's).
    When no placement fits, the estimate tries powers of two up to 4096, from the smallest whose
    tiles could leave a row room (three at most: each is a plan of the model tiled), and names
    the smallest that makes one fit, with its zero.tiling.max_tile_params.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from .._offload._moments import MODES
from .._runtime._log import logger
from .._runtime._tiers import Tier
from . import _plan as pl
from ._estimate_hardware import Hardware, _detect_hardware
from ._estimate_model import (
    _NVME_PATH_PLACEHOLDER,
    GPT2_POSITIONS,
    GPT2_VOCAB,
    EstimateError,
    Shape,
    _format_bytes,
    _format_count,
    _shape_for_params,
    _shape_from_model,
    decoder,
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
    host_plan: dict = field(default_factory=dict)  # per node: host memory by category (the stores' plan)
    plan: Optional[pl.RankPlan] = field(default=None, repr=False, compare=False)  # the engine's plan of the row

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme

    @property
    def key(self) -> tuple:
        return (self.stage, self.param_tier, self.optimizer_tier)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        out.update(param_tier=str(self.param_tier), optimizer_tier=str(self.optimizer_tier),
                   host_plan=dict(self.host_plan), fits=self.fits)
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
    arch: str = "llama"  # the decoder a shape was built as ("config": the config's own model)
    trainable: Optional[int] = None  # parameters trained in the planned model (None: all)

    def placement(self, stage: int, param_tier: str, optimizer_tier: str) -> PlacementEstimate:
        """The row of ``stage`` with the tiers in the config's words (``none``, ``cpu``, ``nvme``; ``device`` too)."""
        wanted = (stage, Tier.of(param_tier), Tier.of(optimizer_tier))
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
            zero.update(pl.tiling_keys(self.max_tile_params))  # the keys the rows were planned with
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
        about = [f"{s.known}'s shape, for the parameter count" if s.known else
                 "shape derived from the parameter count" if s.derived else ""]
        about.append({"llama": "planned as a Llama", "gpt2": "planned as a GPT-2"}.get(self.arch, ""))
        guessed = f" ({'; '.join(a for a in about if a)})" if any(about) else ""
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
        ] + self._units_line()

    def _units_line(self) -> list:
        """What the rows were planned of: the fetch units and the engine's working memory at stage 3."""
        row = next((p for p in self.placements if p.key == (3, Tier.DEVICE, Tier.DEVICE)), None)
        if row is None or row.plan is None:
            return []
        plan = row.plan
        return [f"fetch units (the rows: the engine's plan, as --plan): {plan.units}, the largest "
                f"{plan.largest_unit[0] or '<root>'} ({_format_count(plan.largest_unit[1])} params); stage 3's "
                f"device working memory {_format_bytes(plan.working_memory)}"]

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


_GRID = [(s, pt, ot) for s in (1, 2, 3) for pt in Tier for ot in Tier if s == 3 or pt is Tier.DEVICE]


def _placements(model, params: int, trainable: int, terms: Terms, prec: Precision, hw: Hardware,
                max_tile: Optional[int]) -> list:
    """Every row of the grid, each the engine's own plan (Note [planned by the engine] in _plan.py)
    of ``model`` (on the meta device; tiled here to ``max_tile`` where given) for the node of
    ``hw``: the plan ``--plan`` makes of the same placement."""
    cfgs = {key: pl.plan_config(f"{tier_name(key[1])},{tier_name(key[2])}", prec.name, max_tile_params=max_tile,
                                stage=key[0], moments=prec.moments) for key in _GRID}
    node = pl.node_of(hw, cfgs[(3, _D, _D)])
    with pl.quiet(logging.ERROR):  # the automatic rules' lines, once per row otherwise; tiling's, per module
        specs = pl.tiled_specs(model, cfgs[(3, _D, _D)], node.world)  # the same units at every stage
        return [_row(key, pl.plan_specs(specs, cfgs[key], node, params, trainable), terms, hw) for key in _GRID]


def _row(key: tuple, plan: pl.RankPlan, terms: Terms, hw: Hardware) -> PlacementEstimate:
    """A row of the table from the engine's plan of it: the device's bytes per GPU (the plan's,
    with the activation terms), host memory and NVMe per node."""
    per_node, rank = hw.gpus_per_node, plan.per_rank
    device = plan.device_per_rank + terms.activation_checkpoints + terms.activation_working
    host, nvme = per_node * rank["host"], per_node * rank["nvme"]
    if hw.device_is_host:     # one memory holds both tiers
        fits_device = fits_host = device * per_node + host <= hw.cpu_mem
    else:
        fits_device, fits_host = device <= hw.gpu_mem, host <= hw.cpu_mem
    return PlacementEstimate(*key, device_bytes=device, host_bytes=host, nvme_bytes=nvme, fits_device=fits_device,
                             fits_host=fits_host, fits_nvme=nvme <= hw.nvme,
                             host_plan={k: per_node * v for k, v in plan.categories.get("host", {}).items()}, plan=plan)


def _freeze(model, trainable: Optional[int]) -> int:
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
             tiling_factor: int = 1, moments: str = "fp32", arch: Optional[str] = None) -> Estimate:
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
    Each row is the engine's own plan of the model (Note [the planned decoder] in
    _estimate_model.py: a config's model as transformers builds it, else the decoder of the shape,
    ``arch`` gpt2 or llama), whose count the result's ``params`` is; ``trainable`` trains that many of its
    parameters: its last ones that fit (as when the lower layers are frozen) and an adapter in its
    last block for the rest (as LoRA's), everything else frozen.
    """
    given = resolve(params, model=model, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                    micro_batch=micro_batch, ckpt_interval=ckpt_interval, gpus=gpus, nodes=nodes, gpu_mem=gpu_mem,
                    cpu_mem=cpu_mem, nvme=nvme, dtype=dtype, nvme_path=nvme_path, trainable=trainable,
                    tiling_factor=tiling_factor, moments=moments, arch=arch)
    first = [given.model]  # the model resolve built (and counted), planned first; the tiling search builds others

    def at(factor: int) -> Estimate:
        planned = first.pop() if first else given.build()
        count = _freeze(planned, given.trainable)  # the model with the adapter, if any
        trained = count if given.trainable is None else given.trainable
        terms = _terms(count, trained, given.shape, seq_len, micro_batch, ckpt_interval, given.precision, factor)
        tile = math.ceil(given.shape.largest_operator_numel / factor) if factor > 1 else None
        rows = _placements(planned, count, trained, terms, given.precision, given.hardware, tile)
        return Estimate(params=count, shape=given.shape, seq_len=seq_len, micro_batch=micro_batch,
                        ckpt_interval=ckpt_interval, precision=given.precision, hardware=given.hardware, terms=terms,
                        placements=rows, nvme_path=nvme_path, tiling_factor=factor, arch=given.arch,
                        trainable=None if given.trainable is None else trained)

    est = at(tiling_factor)
    if not est.fitting:
        est.tiling_needed = _smallest_tiling(at, est)
    return est


@dataclass
class Given:
    """What an estimate is of, checked: the model (its shape, a builder of it on the meta device,
    the decoder it was built as, one built and its count), the precision and the hardware."""

    shape: Shape
    build: Callable[[], Any]
    arch: str
    model: Any
    params: int
    trainable: Optional[int]  # asked for (None: all)
    precision: Precision
    hardware: Hardware
    tiling_factor: int

    @property
    def max_tile_params(self) -> int:
        return math.ceil(self.shape.largest_operator_numel / self.tiling_factor)


def resolve(params: Any = None, *, model: Any = None, layers: Optional[int] = None, hidden: Optional[int] = None,
            heads: Optional[int] = None, seq_len: int = 1024, micro_batch: int = 1, ckpt_interval: int = 1,
            gpus: Optional[int] = None, nodes: int = 1, gpu_mem: Any = None, cpu_mem: Any = None, nvme: Any = None,
            dtype: str = "bf16", nvme_path: Optional[str] = None, trainable: Any = None, tiling_factor: int = 1,
            moments: str = "fp32", arch: Optional[str] = None) -> Given:
    """``estimate``'s arguments checked and resolved, nothing planned yet (``--plan`` plans one
    placement of its own from them)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
        _positive_int(value, name)
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch),
                        ("ckpt_interval", ckpt_interval), ("nodes", nodes)):
        _positive_int(value, name, allow_none=False)
    _positive_int(gpus, "gpus")
    _positive_int(tiling_factor, "tiling_factor", allow_none=False)
    prec = Precision.of(dtype, moments)
    shape, build, arch = _resolve_model(params, model, layers, hidden, heads, arch)
    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise EstimateError(f"nvme_path: {nvme_path!r} is not a directory")
    hw = _detect_hardware(gpus, nodes, _optional_size(gpu_mem, "gpu_mem"),
                          _optional_size(cpu_mem, "cpu_mem"), _optional_size(nvme, "nvme"),
                          nvme_path or tempfile.gettempdir())
    built = build()
    count = sum(p.numel() for p in built.parameters())  # Note [the planned decoder] in _estimate_model.py
    asked = None if trainable is None else parse_count(trainable, "trainable")
    if asked is not None and asked > count:
        raise EstimateError(f"trainable: {asked} is more than the model's {count} parameters")
    return Given(shape, build, arch, built, count, asked, prec, hw, tiling_factor)


_MAX_TILING = 4096


def _smallest_tiling(at, est: Estimate) -> Optional[Estimate]:
    """The estimate at the smallest power-of-two tiling factor above ``est``'s with a placement
    that fits; None when tiling alone cannot make one fit. Each factor tried is a plan of the
    model tiled (thousands of tiles for a large model), so only those that can fit are: from
    the smallest whose tiles leave a stage-3 row room (``_tiling_floor``), three at most."""
    factor = _tiling_floor(est)
    for _ in range(3):
        if factor is None or factor > _MAX_TILING or factor >= est.shape.largest_operator_numel:
            return None  # tiles of one parameter at most: tiling cannot go further
        tiled = at(factor)
        if tiled.fitting:
            return tiled
        factor *= 2
    return None


def _tiling_floor(est: Estimate) -> Optional[int]:
    """The smallest power-of-two factor above ``est``'s whose tiles could let a stage-3 row fit:
    tiling lowers only the working memory of the largest unit ((2 + gather_depth) of its
    parameters, Note [operator working memory] in _tiling.py); None when no row can fit so."""
    hw, best = est.hardware, None
    depth = 1 + 2  # zero.prefetch.gather_depth's default, the unit itself and its gradient
    for p in est.placements:
        plan = p.plan
        if p.stage != 3 or plan is None or not p.fits_nvme:
            continue
        swapped = plan.working_memory - plan.persistent  # the part tiles shrink
        room = (hw.cpu_mem - p.host_bytes) // hw.gpus_per_node - (p.device_bytes - swapped) if hw.device_is_host \
            else (hw.gpu_mem - (p.device_bytes - swapped) if p.fits_host else -1)
        tile = room // (depth * est.precision.param)
        if tile >= 1:
            need = 2 ** max(1, math.ceil(math.log2(est.shape.largest_operator_numel / tile)))
            best = need if best is None else min(best, need)
    return None if best is None else max(best, 2 * est.tiling_factor)


def _resolve_model(params, model, layers, hidden, heads, arch: Optional[str]) -> Tuple[Shape, Callable, str]:
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
