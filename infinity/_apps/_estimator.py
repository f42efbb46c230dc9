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
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .._offload._split import HOST_MARGIN, budget
from .._runtime._tiers import Tier
from . import _plan as pl
from ._estimate_hardware import Hardware, _detect_hardware
from ._estimate_model import (
    _NVME_PATH_PLACEHOLDER,
    EstimateError,
    Precision,
    Shape,
    _format_bytes,
    _format_count,
    _optional_size,
    _positive_int,
    freeze,
    parse_count,
    parse_size,
    resolve_model,
)

__all__ = ["estimate", "Estimate", "PlacementEstimate", "Recommendation", "EstimateError",
           "parse_size", "parse_count"]

# --------------------------------------------------------------------------- the estimate

@dataclass(frozen=True)
class Terms:
    """The per-GPU residual and working-memory terms of 002 §3, and the model-state total."""

    model_states: int          # all ranks together (Fig. 2a column 5)
    activation_checkpoints: int
    activation_working: int
    model_state_working: int


@dataclass(frozen=True)
class PlacementEstimate:
    """One ZeRO stage with its parameter and optimizer tiers, and what it needs where; a state's
    tier with a split is the split's slowest (Note [split tiers] in _offload/_split.py)."""

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
    splits: Tuple[Optional[float], Optional[float]] = (None, None)  # the params', the optimizer's split: host fraction
    auto: bool = False  # the row of device: auto in both offload sections: its tiers and splits are the plan's choice

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme

    @property
    def fit_text(self) -> str:
        """The table's fits column: yes, or the tiers it does not fit."""
        full = [tier for tier, ok in (("device", self.fits_device), ("host", self.fits_host),
                                      ("nvme", self.fits_nvme)) if not ok]
        return "yes" if self.fits else "no: " + ", ".join(full)

    @property
    def key(self) -> tuple:
        return (self.stage, self.param_tier, self.optimizer_tier)

    @property
    def spec(self) -> tuple:
        """(stage, (params' tier, split), (optimizer's tier, split)): what ``Estimate.placement`` looks up."""
        return (self.stage, (self.param_tier, self.splits[0]), (self.optimizer_tier, self.splits[1]))

    @property
    def words(self) -> Tuple[str, str]:
        """Where the parameters and the optimizer states are, in the config's words (``offload_word`` in _plan.py)."""
        return (pl.offload_word(self.param_tier, self.splits[0], self.auto),
                pl.offload_word(self.optimizer_tier, self.splits[1], self.auto))

    @property
    def label(self) -> str:
        params, optimizer = pl.offload_word(*self.spec[1]), pl.offload_word(*self.spec[2])
        if self.auto:
            return f"stage 3 auto -> params {params}, optimizer {optimizer}"
        return f"stage {self.stage} params={params} optimizer={optimizer}"

    @property
    def zero(self) -> dict:
        """The row's zero keys in the config's words (nvme_path aside): its stage and offload sections,
        ``device: auto`` in both for the auto row."""
        sections = [{"device": "auto"}] * 2 if self.auto else [pl.offload_section(*where) for where in self.spec[1:]]
        return {"stage": self.stage, "offload_param": sections[0], "offload_optimizer": sections[1]}

    def to_dict(self) -> dict:
        """The row as JSON, in the config's words: each state's tier as offload_*.device names it (none,
        cpu, nvme: a split's slowest, the auto row's as planned), ``zero`` its sections as written."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        out.update(param_tier=pl.tier_name(self.param_tier), optimizer_tier=pl.tier_name(self.optimizer_tier),
                   host_plan=dict(self.host_plan), fits=self.fits, splits=list(self.splits),
                   offload=dict(zip(("params", "optimizer"), self.words)), label=self.label, zero=self.zero)
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
    split_placements: list = field(default_factory=list)  # the rows of the splits asked for (splits, --offload-split)
    auto: Optional[PlacementEstimate] = None  # the row of device: auto in both offload sections (stage 3)
    auto_refused: str = ""  # why there is no auto row

    @property
    def rows(self) -> list:
        """Every row of the table: the placements on whole tiers, the splits' and the auto row."""
        return self.placements + self.split_placements + ([self.auto] if self.auto is not None else [])

    def placement(self, stage: int, param_tier: Any, optimizer_tier: Any) -> PlacementEstimate:
        """The row of ``stage`` with each state's place in the config's words: ``none``, ``cpu``, ``nvme``
        (``device`` too), a split as the config writes it (``{"cpu": 0.5, "nvme": 0.5}``: a row of the
        ``splits`` asked for), or ``auto`` for both (the auto row, stage 3)."""
        if "auto" in (param_tier, optimizer_tier):
            if (stage, param_tier, optimizer_tier) == (3, "auto", "auto") and self.auto is not None:
                return self.auto
            raise EstimateError(f"no placement stage={stage} params={param_tier} optimizer={optimizer_tier}: the "
                                f"table's auto row is stage 3 with auto for both states" +
                                (f" ({self.auto_refused})" if self.auto_refused else ""))
        wanted = (stage, _state_spec("params", param_tier), _state_spec("optimizer", optimizer_tier))
        for p in self.placements + self.split_placements:
            if p.spec == wanted:
                return p
        raise EstimateError(f"no placement stage={stage} params={pl.offload_word(*wanted[1])} optimizer="
                            f"{pl.offload_word(*wanted[2])}; parameters leave the device only at stage 3, and the "
                            f"rows with a split are those of the splits asked for (splits=, --offload-split)")

    @property
    def fitting(self) -> list:
        return [p for p in self.placements if p.fits]

    @property
    def recommended(self) -> Optional[Recommendation]:
        """The fastest row that fits (``fastest``), with its config in infinity's keys; None if none."""
        best = self.fastest()
        return None if best is None else Recommendation(best, self._config_for(best))

    def fastest(self, stage: Optional[int] = None) -> Optional[PlacementEstimate]:
        """The fastest placement on whole tiers that fits (of ``stage``, where given); where none does, the
        auto row's split (planned for this node) or else the fastest of the splits asked for that fits, where
        one does (less NVMe than the state's whole space there, less host memory than all of it in host
        memory); None if none."""
        order = {key: i for i, key in enumerate(_PREFERENCE)}

        def ranked(rows) -> list:
            return sorted((p for p in rows if p is not None and p.fits and stage in (None, p.stage)),
                          key=lambda p: order[p.key])

        fitting = ranked(self.placements) or ranked([self.auto]) + ranked(self.split_placements)
        return fitting[0] if fitting else None

    def _config_for(self, p: PlacementEstimate) -> dict:
        path = self.nvme_path or _NVME_PATH_PLACEHOLDER
        zero = {"stage": p.stage, "offload_param": pl.offload_section(*p.spec[1], path),
                "offload_optimizer": pl.offload_section(*p.spec[2], path)}
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
            "split_placements": [p.to_dict() for p in self.split_placements],
            "auto": None if self.auto is None else dict(self.auto.to_dict(), host_budget=self.auto_budget),
            "auto_refused": self.auto_refused,
        }

    @property
    def auto_budget(self) -> int:
        """Host bytes a rank's states may take under device: auto here (Note [planned split] in _offload/_split.py)."""
        return budget(None, self.hardware.cpu_mem, self.hardware.gpus_per_node)

    def table(self, marked: Optional[PlacementEstimate] = None, mark: str = "") -> str:
        """The header and the rows, the ``marked`` row (one of ``rows``) followed by ``<- mark``."""
        return "\n".join(self._header_lines() + [""] + self._placement_lines(marked, mark) + self._auto_lines())

    def _auto_lines(self) -> list:
        """What the auto row is: device: auto planned for this node's host memory."""
        if self.auto is None:
            return [f"auto: {self.auto_refused}"] if self.auto_refused else []
        hw, what = self.hardware, "host memory and device tier" if self.hardware.device_is_host else "host memory"
        params, optimizer = (pl.offload_word(*where) for where in self.auto.spec[1:])
        return [f"auto: device: auto (zero.offload_param, zero.offload_optimizer) plans params {params}, optimizer "
                f"{optimizer} on this node: the most in host memory, the parameters first, within a rank's {what} "
                f"budget of {_format_bytes(self.auto_budget)} (its share of {_format_bytes(hw.cpu_mem)}/node less "
                f"{HOST_MARGIN:.0%}; zero.host_memory_limit sets it: "
                "Note [planned split] in infinity/_offload/_split.py)"]

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

    def _placement_lines(self, marked: Optional[PlacementEstimate] = None, mark: str = "") -> list:
        head = ("stage", "params", "optimizer", "device/GPU", "host/node", "nvme/node", "fits", "")
        rows = [head]
        for p in self.rows:
            rows.append((str(p.stage), *p.words,
                         _format_bytes(p.device_bytes), _format_bytes(p.host_bytes),
                         _format_bytes(p.nvme_bytes), p.fit_text, f"<- {mark}" if p is marked else ""))
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
                max_tile: Optional[int], splits: Optional[dict] = None) -> tuple:
    """Every row of the grid, of the ``splits`` asked for (``_split_keys``) and of device: auto, each
    the engine's own plan (Note [planned by the engine] in _plan.py) of ``model`` (on the meta device;
    tiled here to ``max_tile`` where given) for the node of ``hw``: the plan ``--plan`` makes of the
    same placement. (the grid's rows, the splits', the auto row or None, why none)."""
    def cfg(offload: str, stage: int = 3, split: Optional[dict] = None):
        return pl.plan_config(offload, prec.name, max_tile_params=max_tile, stage=stage, moments=prec.moments,
                              splits=split)

    grid = {key: cfg(f"{pl.tier_name(key[1])},{pl.tier_name(key[2])}", key[0]) for key in _GRID}
    split_cfgs = [(stage, cfg(f"{p},{o}", stage, split)) for stage, p, o, split in _split_keys(splits or {})]
    refused = "" if prec.moments == "fp32" else (
        f"not planned: device: auto keeps the moments fp32 (zero.offload_optimizer.moments {prec.moments} needs "
        f"device nvme), so --moments {prec.moments} has no auto row")
    auto = None if refused else cfg("auto,auto")
    node = pl.node_of(hw, grid[(3, _D, _D)])
    with pl.quiet(logging.ERROR):  # the automatic rules' lines, once per row otherwise; tiling's, per module
        specs = pl.tiled_specs(model, grid[(3, _D, _D)], node.world)  # the same units at every stage

        def row(stage: int, config, is_auto: bool = False) -> PlacementEstimate:
            return _row(stage, pl.plan_specs(specs, config, node, params, trainable), terms, hw, is_auto)

        return ([row(key[0], grid[key]) for key in _GRID], [row(stage, c) for stage, c in split_cfgs],
                None if auto is None else row(3, auto, True), refused)


def _split_keys(splits: dict) -> list:
    """(stage, params' device, optimizer's device, their splits) of each row the ``splits`` asked for
    add (params, optimizer: {cpu: a, nvme: b}): the split state beside every tier of the other (the
    optimizer's at stages 1-2 too), and both split where both are."""
    p, o = splits.get("params"), splits.get("optimizer")
    rows: list = []
    if o is not None:
        rows += [(s, t, pl.slowest_tier(o), {"optimizer": o}) for s, t in ((1, "none"), (2, "none"), (3, "none"),
                                                                            (3, "cpu"), (3, "nvme"))]
    if p is not None:
        rows += [(3, pl.slowest_tier(p), t, {"params": p}) for t in ("none", "cpu", "nvme")]
    if p is not None and o is not None:
        rows.append((3, pl.slowest_tier(p), pl.slowest_tier(o), dict(splits)))
    return rows


def _checked_splits(splits: Optional[Mapping]) -> Dict[str, Dict[str, float]]:
    """``estimate``'s ``splits`` (params, optimizer: {tier: fraction}) as the config checks them."""
    out: Dict[str, Dict[str, float]] = {}
    for state, fractions in (splits or {}).items():
        name = "params" if state in ("param", "params") else state
        if name in out:
            raise EstimateError(f"splits: the {name}' split is given twice")
        out[name] = pl.checked_split(state, fractions)
    return out


def _state_spec(state: str, where: Any) -> Tuple[Tier, Optional[float]]:
    """A state's place as ``Estimate.placement`` looks it up: a tier's word, or a split as the config writes it."""
    if isinstance(where, Mapping):
        fractions = pl.checked_split(state, where)
        return Tier.of(pl.slowest_tier(fractions)), fractions["cpu"]
    return Tier.of(where), None


def _row(stage: int, plan: pl.RankPlan, terms: Terms, hw: Hardware, auto: bool = False) -> PlacementEstimate:
    """A row of the table from the engine's plan of it: its tiers and splits (auto's choice for the
    auto row), the device's bytes per GPU (the plan's, with the activation terms), host memory and
    NVMe per node."""
    per_node, rank = hw.gpus_per_node, plan.per_rank
    device = plan.device_per_rank + terms.activation_checkpoints + terms.activation_working
    host, nvme = per_node * rank["host"], per_node * rank["nvme"]
    if hw.device_is_host:     # one memory holds both tiers
        fits_device = fits_host = device * per_node + host <= hw.cpu_mem
    else:
        fits_device, fits_host = device <= hw.gpu_mem, host <= hw.cpu_mem
    return PlacementEstimate(stage, Tier.of(plan.tiers["params"]), Tier.of(plan.tiers["optimizer"]), device_bytes=device,
                             host_bytes=host,
                             nvme_bytes=nvme, fits_device=fits_device, fits_host=fits_host, fits_nvme=nvme <= hw.nvme,
                             host_plan={k: per_node * v for k, v in plan.categories.get("host", {}).items()}, plan=plan,
                             splits=(plan.host_fractions["params"], plan.host_fractions["optimizer"]), auto=auto)


def estimate(params: Any = None, *, model: Any = None, layers: Optional[int] = None,
             hidden: Optional[int] = None, heads: Optional[int] = None, seq_len: int = 1024,
             micro_batch: int = 1, ckpt_interval: int = 1, gpus: Optional[int] = None,
             nodes: int = 1, gpu_mem: Any = None, cpu_mem: Any = None, nvme: Any = None,
             dtype: str = "bf16", nvme_path: Optional[str] = None, trainable: Any = None,
             tiling_factor: int = 1, moments: str = "fp32", arch: Optional[str] = None,
             splits: Optional[Mapping[str, Mapping[str, float]]] = None) -> Estimate:
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
    last block for the rest (as LoRA's), everything else frozen. ``splits``: the rows of a split of
    a state over host memory and NVMe (``{"optimizer": {"cpu": 0.5, "nvme": 0.5}}``, each as the
    config's ``zero.offload_*.split``; Note [split tiers] in _offload/_split.py), beside every tier
    of the other state (``split_placements``); ``auto`` is the row of ``device: auto`` in both
    offload sections, planned for the node's host memory (Note [planned split] in _offload/_split.py).
    """
    checked = _checked_splits(splits)
    given = resolve(params, model=model, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                    micro_batch=micro_batch, ckpt_interval=ckpt_interval, gpus=gpus, nodes=nodes, gpu_mem=gpu_mem,
                    cpu_mem=cpu_mem, nvme=nvme, dtype=dtype, nvme_path=nvme_path, trainable=trainable,
                    tiling_factor=tiling_factor, moments=moments, arch=arch)
    first = [given.model]  # the model resolve built (and counted), planned first; the tiling search builds others

    def at(factor: int) -> Estimate:
        planned = first.pop() if first else given.build()
        count = freeze(planned, given.trainable)  # the model with the adapter, if any
        trained = count if given.trainable is None else given.trainable
        terms = _terms(count, trained, given.shape, seq_len, micro_batch, ckpt_interval, given.precision, factor)
        tile = math.ceil(given.shape.largest_operator_numel / factor) if factor > 1 else None
        grid, split_rows, auto, refused = _placements(planned, count, trained, terms, given.precision,
                                                      given.hardware, tile, checked)
        return Estimate(params=count, shape=given.shape, seq_len=seq_len, micro_batch=micro_batch,
                        ckpt_interval=ckpt_interval, precision=given.precision, hardware=given.hardware, terms=terms,
                        placements=grid, nvme_path=nvme_path, tiling_factor=factor, arch=given.arch,
                        trainable=None if given.trainable is None else trained, split_placements=split_rows,
                        auto=auto, auto_refused=refused)

    est = at(tiling_factor)
    if est.recommended is None:  # nothing fits, on whole tiers, split or as device: auto plans it
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
    shape, build, arch = resolve_model(params, model, layers, hidden, heads, arch)
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
        if tiled.recommended is not None:
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
