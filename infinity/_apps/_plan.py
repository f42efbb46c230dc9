"""``python -m infinity.estimate --plan``: the engine's own plan of a model on a node it does not run on.

Note [planned by the engine]: the paper's terms (Note: the formulas, in _estimator.py) say what a
model needs; the plan says what ``infinity.initialize`` would allocate, and every row of the
estimator's table is such a plan (``plan_specs``, for the model of Note [the planned decoder] in
_estimate_model.py), so the table, ``--plan`` and ``--step-time`` share one computation. It
builds the model on the meta device (no parameter memory, whatever its size) and runs the
functions the engine runs before its first byte (Note [build order] in _initialize.py): the
fetch units, ``Placement.of`` (tiers, flat layout, the automatic rules for a ``Machine`` that
describes the target node instead of this one) and the preflight's ``plan`` (the one memory
model: Note [one memory model] in _memory_plan.py), then spreads each rank's swap bytes over the
config's drives as the preflight does (``node_need``: Note [many drives] in
_drives.py). Nothing is allocated, no file is made and no process group is needed: the world
size and the node are parameters. Every
rank of a node gets the same plan (bandwidth-centric partitioning gives each the same shard of
every unit), so one rank's figures are every rank's. A trillion-parameter decoder plans in
seconds within a few hundred MiB.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .._offload._drives import drive_paths, rank_drives
from .._offload._layout import ParamSource
from .._offload._memory_plan import totals
from .._offload._moments import file_bytes
from .._offload._optimizer_files import NAMES, SIGNED, STATES
from .._offload._optimizer_store import chunk_elems, head_elems
from .._offload._placement import Machine, Placement
from .._offload._preflight import node_need
from .._offload._preflight import plan as preflight_plan
from .._offload._split import opt_host_upto, param_host_upto
from .._runtime._log import logger
from .._runtime._tiers import StagePolicy, Tier
from .._zero._tiling import check_working_memory, tile_model, unit_working_memory
from .._zero._unit_plan import DTYPES, unit_specs_of
from ..config import Config, ConfigError
from ..config.validate import split_fractions
from . import _runmodel as rm
from ._estimate_hardware import Hardware
from ._estimate_model import (
    _NVME_PATH_PLACEHOLDER,
    ARCHS,
    EstimateError,
    Shape,
    _format_bytes,
    _format_count,
    llama_ffn,
    vocab_of,
)


@dataclass(frozen=True)
class Node:
    """The node a plan is for: its ranks (one per GPU), host memory, NVMe space, and its drives'
    bandwidth (the config's nvme_path names the drives)."""

    ranks: int  # per node
    nodes: int
    accelerator: bool
    gpu_mem: int  # bytes per GPU (the host's memory without an accelerator)
    host_mem: int  # bytes per node
    nvme: int  # bytes per node
    drive_read: Optional[float] = None  # bytes/s per drive (--drive-bandwidth, else a preset's), for the I/O times
    drive_write: Optional[float] = None
    name: str = ""

    @property
    def world(self) -> int:
        return self.ranks * self.nodes

    @property
    def machine(self) -> Machine:
        return Machine(accelerator=self.accelerator, host_available=self.host_mem, ranks_on_node=self.ranks)


@dataclass
class RankPlan:
    """One rank's plan and the node's totals (Note [planned by the engine])."""

    params: int
    trainable: int
    node: Node
    stage: int
    dtype: str
    units: int
    trainable_units: int
    largest_unit: Tuple[str, int]  # (module, parameters)
    param_total: int  # elements of a rank's parameter store
    opt_total: int  # elements of a rank's optimizer space
    param_source: str
    tiers: Dict[str, str]
    categories: Dict[str, Dict[str, int]]  # per rank: tier -> category -> bytes
    swap_files: Dict[str, int]  # per rank: file -> bytes
    whole_params: int  # per rank: stages 1-2's whole parameters on the device (not in ``categories``)
    working_memory: int  # device bytes while the largest unit runs (stages 1-2: the gradients before their reduce)
    drives: Dict[str, int]  # per node: drive -> swap bytes (Note [many drives] in _drives.py)
    drive_ranks: Dict[str, List[int]]  # drive -> the ranks of the node with swap files there
    nvme_layout: str
    persistent: int = 0  # of the working memory: what stays gathered (Note [persistent parameters] in _unit_plan.py)
    chunk: int = 0  # elements of the optimizer's swap chunk
    head: int = 0  # elements of the optimizer's host cache
    placement: Optional[Placement] = None  # what the plan was made of (not in to_dict)
    # each state's place in the config's words (``offload_word``) and its split's host fraction (None: no split)
    offload: Dict[str, str] = dataclasses.field(default_factory=dict)
    host_fractions: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0  # to build the model and plan it

    @property
    def per_rank(self) -> Dict[str, int]:
        return totals(self.categories)

    @property
    def device_per_rank(self) -> int:
        """Device bytes of a rank before activations: the device tier, the whole parameters of
        stages 1-2 and the working memory of the largest unit."""
        return self.per_rank["device"] + self.whole_params + self.working_memory

    @property
    def host_per_rank(self) -> int:
        """Host memory of a rank: the host tier, and the device tier where the device is the host."""
        t = self.per_rank
        return t["host"] + (0 if self.node.accelerator else t["device"])

    @property
    def host_upto(self) -> Dict[str, int]:
        """Elements of each state's flat space a split keeps in host memory (Note [split tiers] in _split.py)."""
        p = self.placement
        return {"params": p.param_host_upto if p else 0, "optimizer": p.opt_host_upto if p else 0}

    def to_dict(self) -> dict:
        node = self.node
        return {
            "params": self.params, "trainable": self.trainable, "stage": self.stage, "dtype": self.dtype,
            "node": {"name": node.name, "ranks": node.ranks, "nodes": node.nodes, "accelerator": node.accelerator,
                     "gpu_mem": node.gpu_mem, "host_mem": node.host_mem, "nvme": node.nvme,
                     "nvme_layout": self.nvme_layout, "drive_read": node.drive_read, "drive_write": node.drive_write},
            "units": self.units, "trainable_units": self.trainable_units,
            "largest_unit": {"module": self.largest_unit[0], "params": self.largest_unit[1]},
            "param_total": self.param_total, "opt_total": self.opt_total, "param_source": self.param_source,
            "tiers": self.tiers, "offload": self.offload, "host_fractions": self.host_fractions,
            "host_upto": self.host_upto, "per_rank": {"bytes": self.per_rank, "categories": self.categories,
                                              "host": self.host_per_rank, "swap_files": self.swap_files,
                                              "whole_params": self.whole_params,
                                              "working_memory": self.working_memory,
                                              "device": self.device_per_rank},
            "per_node": {"host": self.host_per_rank * node.ranks, "nvme": self.per_rank["nvme"] * node.ranks,
                         "drives": self.drives, "drive_ranks": self.drive_ranks,
                         "fits_host": self.host_per_rank * node.ranks <= node.host_mem,
                         "fits_nvme": self.per_rank["nvme"] * node.ranks <= node.nvme},
            "seconds": self.seconds,
        }


def build_meta(model_config=None, shape: Optional[Shape] = None, arch: str = "gpt2") -> nn.Module:
    """The model on the meta device: from a transformers config (or its fields), else a decoder
    of ``shape``: GPT-2 (its vocabulary where the shape has none), or Llama (its MLP 8/3 as wide
    as the hidden size, a multiple of 256, where the shape gives none: as many parameters as
    GPT-2's 4x MLP; its Linear layers are what zero.tiling tiles)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig  # the hf extra

    if model_config is None:
        if shape is None:
            raise EstimateError("plan: give a model config (--model) or its shape (--layers and --hidden, or --params)")
        if arch not in ARCHS:
            raise EstimateError(f"arch: {arch!r}; use one of {', '.join(ARCHS)}")
        vocab = vocab_of(shape)  # Note [the planned decoder] in _estimate_model.py: the estimator's decoder
        model_config = GPT2Config(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads, vocab_size=vocab,
                                  n_inner=shape.ffn) if arch == "gpt2" else \
            LlamaConfig(num_hidden_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                        num_key_value_heads=shape.kv_heads or shape.heads, vocab_size=vocab,
                        intermediate_size=llama_ffn(shape))
    elif isinstance(model_config, dict):
        fields = dict(model_config)
        if "model_type" not in fields:
            raise EstimateError("plan: the model config has no model_type; name the architecture (e.g. \"gpt2\", "
                                "\"llama\") so that the model can be built")
        model_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def plan_model(model: nn.Module, cfg, node: Node) -> RankPlan:
    """Note [planned by the engine]: ``model`` (on the meta device, or anywhere: nothing of it
    is read but its parameters' shapes and flags) under ``cfg`` on ``node``."""
    return plan_specs(tiled_specs(model, cfg, node.world), cfg, node, sum(p.numel() for p in model.parameters()),
                      sum(p.numel() for p in model.parameters() if p.requires_grad))


def tiled_specs(model: nn.Module, cfg, world: int) -> list:
    """``model`` tiled as ``initialize`` tiles it (zero.tiling), then its fetch units on ``world`` ranks."""
    tiling = cfg.zero.tiling  # as initialize does, before the units are planned
    with quiet():  # a line per tiled module: thousands for a trillion parameters
        tile_model(model, tiling.enabled, tiling.min_params, tiling.max_tile_params)
    return unit_specs_of(model, cfg, world)[0]


def plan_specs(specs, cfg, node: Node, params: int, trainable: int) -> RankPlan:
    """The plan of a model's fetch units (``UnitSpec``s, ``unit_specs_of``) of ``params``
    parameters, ``trainable`` of them trained, under ``cfg`` on ``node``: what ``plan_model``
    reports and each row of the estimator's table (Note [the planned decoder] in _estimate_model.py)."""
    world = node.world
    policy = StagePolicy.of(cfg.zero.stage)
    placement = Placement.of(cfg, policy, DTYPES[cfg.precision.dtype], specs, world, node.machine)
    itemsize = placement.itemsize
    units = [(s.module_name, s.shard_numel * world, s.persistent) for s in specs]
    if policy.partition_params:
        check_working_memory(units, itemsize, cfg)  # refused as initialize refuses it
        name, numel, persistent, working = unit_working_memory(units, itemsize, cfg)
    else:  # the whole parameters stay on the device; their gradients until the step (1) or their unit's reduce (2)
        name, numel = max(((n, c) for n, c, _ in units), key=lambda u: u[1], default=("", 0))
        persistent = 0
        grads = sum(c for (_, c, _), s in zip(units, specs) if s.trainable) if cfg.zero.stage < 2 else numel
        working = grads * itemsize
    need = preflight_plan(placement, cfg)
    n, z = placement.layout.opt_total, cfg.zero.offload_optimizer
    chunk = chunk_elems(z.chunk_size, n)  # as the preflight's plan takes them (Note [host cache] in _nvme_optimizer_store.py)
    head = head_elems(z.host_cache, list(placement.layout.opt_ranges), chunk, n)
    fractions = host_fractions(cfg, placement)
    return RankPlan(
        params=params, trainable=trainable, node=node, stage=cfg.zero.stage,
        dtype=cfg.precision.dtype, units=len(specs), trainable_units=sum(s.trainable for s in specs),
        largest_unit=(name, numel), param_total=placement.layout.param_total, opt_total=placement.layout.opt_total,
        param_source=placement.param_source.value,
        tiers={"params": str(placement.param_tier), "optimizer": str(placement.opt_tier)},
        categories={tier: dict(c) for tier, c in need["categories"].items()}, swap_files=swap_files(placement, cfg),
        # the whole parameters of stages 1-2, as the preflight's device_need counts them
        whole_params=0 if policy.partition_params else placement.layout.param_total * world * itemsize,
        working_memory=working, persistent=persistent, drives=node_need(cfg, need, node.ranks),
        drive_ranks=_drive_ranks(cfg, node.ranks, placement), nvme_layout=cfg.zero.nvme_layout, chunk=chunk,
        head=head, placement=placement, host_fractions=fractions,
        offload={state: offload_word(tier, fractions[state], section.device == "auto") for state, tier, section in (
            ("params", placement.param_tier, cfg.zero.offload_param),
            ("optimizer", placement.opt_tier, cfg.zero.offload_optimizer))})


def _drive_ranks(cfg, ranks: int, placement: Placement) -> Dict[str, List[int]]:
    """Each configured drive's ranks of the node: those with a swap file there (Note [many drives] in _drives.py);
    a ``device: auto`` section's drives where the plan put its state on NVMe."""
    z = cfg.zero
    sections = [(z.offload_optimizer, placement.opt_tier), (z.offload_param, placement.param_tier)]
    on_nvme = [s for s, tier in sections if s.nvme_path and (s.device == "nvme" or
                                                             (s.device == "auto" and tier is Tier.NVME))]
    out: Dict[str, List[int]] = {d: [] for s in on_nvme for d in drive_paths(s.nvme_path)}
    for section in on_nvme:
        for drive in drive_paths(section.nvme_path):
            out[drive] += [r for r in range(ranks) if r not in out[drive] and
                           drive in rank_drives(section.nvme_path, cfg.zero.nvme_layout, r)]
    return out


@contextlib.contextmanager
def quiet(below: int = logging.WARNING):
    """The engine's lines below ``below`` off: a plan of many modules, or made many times (the estimator's rows)."""
    level = logger.level
    logger.setLevel(max(level, below))
    try:
        yield
    finally:
        logger.setLevel(level)


def swap_files(placement: Placement, cfg) -> Dict[str, int]:
    """The swap files of one rank and their bytes, named and sized as the stores make them
    (``ParamStore._swap_files``, ``OptimizerFiles``), block sums aside."""
    layout, out = placement.layout, {}
    if placement.policy.partition_params and placement.param_tier is Tier.NVME:
        source = placement.param_source  # Note [parameters from the master] in _placement.py
        own = layout.frozen_total if source is ParamSource.MASTER_FILE else \
            0 if source is ParamSource.MASTER else layout.param_total
        if own:
            out["params.swp"] = own * placement.itemsize
    if placement.opt_tier is Tier.NVME:
        z = cfg.zero.offload_optimizer
        chunk = chunk_elems(z.chunk_size, layout.opt_total)
        for name in STATES if placement.grads_in_memory else NAMES:
            out[f"{name}.swp"] = file_bytes(z.moments if name in SIGNED else "fp32", layout.opt_total, chunk)
    return out


def figures_of(plan: RankPlan, activations: Optional[int] = None) -> "rm.Figures":
    """What the run model reads of a stage-3 plan (Note [run model] in _runmodel.py): its layout's
    figures, its stores' bytes and the largest unit's working memory, so that --step-time speaks of the
    plan the table shows; and the table's ``activations`` (the plan knows no batch), where given."""
    placement = plan.placement
    if placement is None or not placement.policy.partition_params:
        raise EstimateError("the run model is of stage 3's plans")
    layout = placement.layout
    return rm.Figures(total=layout.opt_total, largest=plan.largest_unit[1], max_shard=layout.max_shard,
                      chunk=plan.chunk, head=plan.head, grads_in_memory=placement.grads_in_memory,
                      param_cache=placement.param_cache_elems, param_source=placement.param_source.value,
                      categories=plan.categories, working=plan.working_memory, activations=activations)


def tiling_keys(max_tile_params: int) -> dict:
    """zero's keys for tiles of at most ``max_tile_params`` parameters: tiling, and a persistence
    threshold no larger (zero.prefetch.persistence_threshold: a tile below it would stay gathered)."""
    keys: dict = {"tiling": {"enabled": True, "max_tile_params": max_tile_params}}
    if max_tile_params < Config().zero.prefetch.persistence_threshold:
        keys["prefetch"] = {"persistence_threshold": max_tile_params}
    return keys


def timed_plan(build, cfg, node: Node) -> RankPlan:
    """Build the model (``build()``) and plan it, timing both."""
    began = time.perf_counter()
    result = plan_model(build(), cfg, node)
    result.seconds = time.perf_counter() - began
    return result


# --------------------------------------------------------------------------- the report

SOURCES = {  # Note [parameters from the master] in _placement.py
    ParamSource.OWN.value: "the parameter shards in a store of their own",
    ParamSource.MASTER.value: "the parameter shards read from the master weights in memory",
    ParamSource.MASTER_FILE.value: "the trainable parameter shards read from master.swp"}

def report(p: RankPlan) -> str:
    node, t = p.node, p.per_rank
    hw = node.name or f"{node.nodes} node(s) x {node.ranks} rank(s)"
    lines = [
        f"plan (the engine's own, on the meta device; nothing allocated): {_format_count(p.params)} parameters "
        f"({_format_count(p.trainable)} trainable), {p.dtype}, stage {p.stage}, "
        f"{placed(p)}",
        f"node: {hw}: {node.world} rank(s) in all, host {_format_bytes(node.host_mem)}/node, "
        f"NVMe {_format_bytes(node.nvme)}/node on {len(p.drive_ranks)} drive(s), layout {p.nvme_layout}",
        f"fetch units: {p.units} ({p.trainable_units} trainable), the largest {p.largest_unit[0] or '<root>'} "
        f"({_format_count(p.largest_unit[1])} parameters); per rank {_format_count(p.param_total)} parameter "
        f"elements, {_format_count(p.opt_total)} optimizer elements; "
        f"{SOURCES[p.param_source] if p.stage == 3 else 'the parameters whole on every rank'}",
        "",
        "per rank (every rank the same):",
    ]
    for tier in ("device", "host", "nvme"):
        cats = p.categories.get(tier, {})
        if cats:
            parts = ", ".join(f"{c} {_format_bytes(n)}" for c, n in sorted(cats.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {tier:<6} {_format_bytes(t[tier]):>11}  {parts}")
    device = p.device_per_rank
    fit = "fits" if device <= node.gpu_mem else "does not fit: tile the largest operators, zero.tiling"
    what = "(it, the units gathered ahead, its gradient, the units that stay gathered)" if p.stage == 3 else \
        "(the gradients of the largest unit before their reduce-scatter)" if p.stage == 2 else \
        "(the whole gradients until the step)"
    if p.whole_params:
        lines.append(f"  device whole parameters: {_format_bytes(p.whole_params)} (stage {p.stage})")
    lines.append(f"  device working memory of the largest unit: {_format_bytes(p.working_memory)} {what}" + (
        f"; with the device tier {_format_bytes(device)} of {_format_bytes(node.gpu_mem)}/GPU before "
        f"activations ({fit})" if node.accelerator else ""))
    files = ", ".join(f"{name} {_format_bytes(n)}" for name, n in p.swap_files.items()) or "none"
    lines.append(f"  swap files: {files}")
    lines.append(f"  host memory of the rank: {_format_bytes(p.host_per_rank)}")
    lines += ["", "per node:"]
    host, nvme = p.host_per_rank * node.ranks, t["nvme"] * node.ranks
    lines.append(f"  host {_format_bytes(host)} of {_format_bytes(node.host_mem)}"
                 f" ({'fits' if host <= node.host_mem else 'does not fit'}), NVMe {_format_bytes(nvme)} of "
                 f"{_format_bytes(node.nvme)} ({'fits' if nvme <= node.nvme else 'does not fit'})")
    rank_text = {d: _ranks(sorted(r)) for d, r in p.drive_ranks.items()}
    dw, rw = max([12, *map(len, rank_text)]), max([8, *map(len, rank_text.values())])  # columns that hold the longest
    lines.append(f"  {'drive':<{dw}} {'ranks':<{rw}} {'swap bytes':>11}" +
                 ("  read once  write once" if node.drive_read else ""))
    for drive in p.drive_ranks:
        nbytes = p.drives.get(drive, 0)
        row = f"  {drive:<{dw}} {rank_text[drive]:<{rw}} {_format_bytes(nbytes):>11}"
        if node.drive_read and node.drive_write:
            row += f"  {nbytes / node.drive_read:8.1f} s  {nbytes / node.drive_write:9.1f} s"
        lines.append(row)
    lines.append(f"planned in {p.seconds:.1f} s")
    return "\n".join(lines)


def placed(p: RankPlan) -> str:
    """Where a plan keeps the parameters and the optimizer states, in the config's words."""
    words = p.offload or {"params": _WORDS[p.tiers["params"]], "optimizer": _WORDS[p.tiers["optimizer"]]}
    params = f"offload_param {words['params']}" if p.stage == 3 else "parameters whole on the device"
    return f"{params}, offload_optimizer {words['optimizer']}"


# --------------------------------------------------------------------------- splits and auto, in the config's words

_WORDS = {"device": "none", "cpu": "cpu", "nvme": "nvme"}  # a tier as offload_*.device says it
DEVICES = ("none", "cpu", "nvme", "auto")  # offload_*.device
SPLIT_STATES = {"params": "offload_param", "param": "offload_param", "optimizer": "offload_optimizer"}  # a split's state
AUTO_STEPS = 8  # the host fractions plan_auto tries, k / AUTO_STEPS (its ``steps``: Note [planned split] in _split.py)


def offload_word(tier: Tier, fraction: Optional[float] = None, auto: bool = False) -> str:
    """A state's place in the config's words: none, cpu, nvme, or a split's ``cpu 0.25 / nvme 0.75``
    (``split: {cpu: 0.25, nvme: 0.75}``), after ``auto -> `` where ``device: auto`` chose it."""
    word = _WORDS[str(tier)] if fraction is None else f"cpu {fraction:g} / nvme {1 - fraction:g}"
    return f"auto -> {word}" if auto else word


def tier_name(tier: Tier) -> str:
    """A tier in the config's words: ``offload_*.device`` says none for the device tier."""
    return _WORDS[str(tier)]


def offload_section(tier: Tier, fraction: Optional[float], nvme_path: Optional[str] = None) -> dict:
    """A state's offload section as the config writes it: its device, the drive where that is nvme and
    ``nvme_path`` is given, and its split where it has one (Note [split tiers] in _offload/_split.py)."""
    out: dict = {"device": tier_name(tier)}
    if tier is Tier.NVME and nvme_path is not None:
        out["nvme_path"] = nvme_path
    if fraction is not None:
        out["split"] = {"cpu": fraction, "nvme": round(1 - fraction, 12)}
    return out


def host_fractions(cfg, placement: Placement) -> Dict[str, Optional[float]]:
    """Each state's split as the config writes it, by its host (cpu) fraction, None without one: the
    section's own, or for ``device: auto`` the one plan_auto chose (the largest fraction it tries that
    cuts the flat space where the plan does, so that the config written with it plans the same)."""
    z, layout = cfg.zero, placement.layout
    chunk = chunk_elems(z.offload_optimizer.chunk_size, layout.opt_total)
    cuts = {"params": (placement.param_tier, placement.param_host_upto, layout.param_total,
                       lambda f: param_host_upto(f, layout.param_ranges, layout.param_total)),
            "optimizer": (placement.opt_tier, placement.opt_host_upto, layout.opt_total,
                          lambda f: opt_host_upto(f, layout.opt_total, chunk))}
    out: Dict[str, Optional[float]] = {}
    for state, section in (("params", z.offload_param), ("optimizer", z.offload_optimizer)):
        tier, upto, total, cut = cuts[state]
        if section.device != "auto":
            fr = split_fractions(section.split)
            out[state] = None if fr is None else fr["cpu"]
        elif tier is not Tier.NVME or not upto:
            out[state] = None
        else:
            out[state] = next((k / AUTO_STEPS for k in range(AUTO_STEPS - 1, 0, -1) if cut(k / AUTO_STEPS) == upto),
                              upto / total)
    return out


def checked_split(state: str, fractions) -> Dict[str, float]:
    """``state``'s split ({tier: fraction}, the config's ``split: {cpu: a, nvme: b}``) as the config checks it
    (the section's device its slowest tier, as the config asks), {"cpu": a, "nvme": b} then; EstimateError with the
    config's words for what to change."""
    key = SPLIT_STATES.get(state)
    if key is None:
        raise EstimateError(f"split of {state!r}: the states are params and optimizer (zero.offload_param, "
                            f"zero.offload_optimizer)")
    if not isinstance(fractions, Mapping):
        raise EstimateError(f"split of the {state}: {fractions!r} must be a mapping of tiers to fractions, "
                            f"e.g. {{'cpu': 0.5, 'nvme': 0.5}}")
    nvme = fractions.get("nvme")
    slowest = "cpu" if isinstance(nvme, (int, float)) and not nvme else "nvme"  # a number's type the config checks
    here = os.path.join(tempfile.gettempdir(), "infinity-plan-drive0")
    section = {"device": slowest, "split": dict(fractions), **({"nvme_path": here} if slowest == "nvme" else {})}
    try:
        cfg = Config.from_dict({"zero": {"stage": 3, key: section}})
    except ConfigError as err:
        raise EstimateError(str(err)) from None
    fr = split_fractions(getattr(cfg.zero, key).split)
    if fr is None:
        raise EstimateError(f"split of the {state}: {dict(fractions)} names no tier; e.g. {{'cpu': 0.5, 'nvme': 0.5}}")
    return {"cpu": fr["cpu"], "nvme": fr["nvme"]}


def slowest_tier(fractions: Dict[str, float]) -> str:
    """The device of a checked split's section: its slowest tier (Note [split tiers] in _split.py)."""
    return "nvme" if fractions["nvme"] else "cpu"


def offload_tiers(offload: str) -> List[str]:
    """PARAMS,OPTIMIZER in the config's words (none, cpu, nvme, auto; ``device``, the table's word
    before, as an alias of none)."""
    tiers = [{"device": "none"}.get(t.strip(), t.strip()) for t in offload.split(",")]
    if len(tiers) != 2 or not set(tiers) <= set(DEVICES):
        raise EstimateError(f"offload: {offload!r} must be two of none, cpu, nvme, auto (zero.offload_param.device, "
                            f"zero.offload_optimizer.device): e.g. nvme,nvme, cpu,cpu or auto,auto")
    return tiers


def _ranks(ranks: List[int]) -> str:
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


# --------------------------------------------------------------------------- what the command line gives

PRESET_DRIVES = {"dgx2": 8, "h100x8": 8}  # data drives of the nodes of _runmodel.NODES (their datasheets)


def drive_names(count: Optional[int], preset: Optional[str] = None, nvme_path: Optional[str] = None
                ) -> Tuple[str, ...]:
    """The drives of a node this machine is not: ``count`` of them (else the preset node's, else
    one), named nvme0, nvme1, ... (one drive: ``nvme_path`` where given)."""
    count = count if count is not None else PRESET_DRIVES.get(preset or "", 1)
    if count < 1:
        raise EstimateError(f"drives: {count} must be at least 1")
    return (nvme_path or _NVME_PATH_PLACEHOLDER,) if count == 1 else tuple(f"nvme{i}" for i in range(count))


def node_of(hw: Hardware, cfg, preset: Optional[str] = None,
            drive_bandwidth: Optional[Tuple[float, float]] = None) -> Node:
    """The node of an estimate's hardware, each drive ``cfg`` names read and written at
    ``drive_bandwidth`` (bytes/s, --drive-bandwidth) where given, else at the preset node's NVMe
    bandwidth shared evenly (Note [run model] in _runmodel.py gives the figures)."""
    read = write = None
    z = cfg.zero  # the drives of the NVMe sections, and of the auto ones, which may put a state there
    drives = len({d: None for s in (z.offload_optimizer, z.offload_param)
                  if s.device in ("nvme", "auto") and s.nvme_path for d in drive_paths(s.nvme_path)})
    if drive_bandwidth is not None and drives:
        read, write = drive_bandwidth
    elif preset and drives:
        rates, gpus = rm.NODES[preset][0], rm.NODES[preset][1]
        read, write = rates.nvme_read * gpus / drives, rates.nvme_write * gpus / drives
    return Node(ranks=hw.gpus_per_node, nodes=hw.nodes, accelerator=not hw.device_is_host, gpu_mem=hw.gpu_mem,
                host_mem=hw.cpu_mem, nvme=hw.nvme, drive_read=read, drive_write=write, name=preset or "")


def plan_config(offload: str, dtype: str, path: Optional[str] = None, max_tile_params: Optional[int] = None,
                drives: Tuple[str, ...] = (_NVME_PATH_PLACEHOLDER,), nvme_layout: str = "per_rank", stage: int = 3,
                moments: str = "fp32", splits: Optional[Dict[str, Dict[str, float]]] = None) -> Config:
    """The config a plan is for: a file's (``--config``: its drives, its layout), else ``stage``
    at the ``offload`` tiers (parameters,optimizer; the parameters' none below stage 3; auto
    planned from the node) with each state's split of ``splits`` (params, optimizer: {tier:
    fraction}, Note [split tiers] in _split.py) in ``dtype`` with the moments on NVMe in
    ``moments`` and the swap files on ``drives`` laid out by ``nvme_layout`` (Note [many drives]
    in _drives.py), tiled to ``max_tile_params`` where given (zero.tiling)."""
    if path is not None:
        try:
            return Config.from_file(path)
        except ConfigError as err:
            raise EstimateError(f"--config: {err}") from None
    tiers = offload_tiers(offload)
    splits = {SPLIT_STATES[k][len("offload_"):]: v for k, v in (splits or {}).items()}  # param / optimizer

    # The planned node's drives are names, not directories of this machine, which a Config checks
    # could be made here (a file or a read-only directory named so would refuse them): the
    # config is checked with directories that can be, then given the names.
    here = [os.path.join(tempfile.gettempdir(), f"infinity-plan-drive{i}") for i in range(len(drives))]

    def section(device: str, state: str) -> dict:
        out: dict = {"device": device, "nvme_path": here} if device in ("nvme", "auto") else {"device": device}
        return dict(out, split=dict(splits[state])) if state in splits else out

    zero = {"stage": stage, "offload_param": section(tiers[0], "param"),
            "offload_optimizer": section(tiers[1], "optimizer"), "nvme_layout": nvme_layout}
    if tiers[1] in ("nvme", "auto"):  # auto: the config refuses compressed moments there, and says so
        zero["offload_optimizer"]["moments"] = moments
    if max_tile_params is not None:
        zero.update(tiling_keys(max_tile_params))
    try:
        cfg = Config.from_dict({"zero": zero, "precision": {"dtype": dtype}})
    except ConfigError as err:
        raise EstimateError(f"offload {','.join(tiers)}" + "".join(f", {s} split {_split_text(f)}"
                                                                    for s, f in splits.items()) + f": {err}") from None
    named = drives[0] if len(drives) == 1 else tuple(drives)
    for key in ("offload_param", "offload_optimizer"):
        section_cfg = getattr(cfg.zero, key)
        if section_cfg.device in ("nvme", "auto"):  # frozen sections of a config made here, nothing else holds them
            object.__setattr__(cfg.zero, key, dataclasses.replace(section_cfg, nvme_path=named))
    return cfg


def _split_text(fractions: dict) -> str:
    return "{" + ", ".join(f"{t}: {v:g}" if isinstance(v, (int, float)) else f"{t}: {v!r}"
                           for t, v in fractions.items()) + "}"
