"""What a model will become, computed from its modules before anything is allocated: the
stage's policy, the fetch units (Note [fetch unit grouping]) as ``UnitSpec``s,
and the placement of every state (``_placement.Placement``). ``initialize`` builds the engine
from it, and ``Init`` checks a model built on the meta device against it before the real one
allocates (Note [Init preflight] in _init_context.py).

Note [fetch unit grouping]: a fetch unit is what one all-gather brings and one reduce-scatter
takes. By default (``zero.fetch_units.group: block``) each repeated block (every child of an
``nn.ModuleList``, as FSDP2 is applied per transformer block, and every module of a class
named in ``zero.fetch_units.classes``) is one unit holding all its parameters, nested blocks
apart (experts in a list inside a block are units of their own); modules outside blocks
(embeddings, the final norm, the head) keep a unit each. The block's own pre-forward hook
acquires its units, so the gather happens at the block boundary; its submodules acquire the
same units again, which only counts a reference. In backward every submodule holds the
block's units until all the block's gradients are in, then the unit is reduced at once.
GPT-2 124M: 15 all-gathers per forward instead of about 75. Working memory is bounded by the
largest unit (a block, or a tile where tiling applies). ``group: module`` gives one unit per
module. Stages 1-2 group the same way: their units set the reduce-scatter granularity and the
flat layout of the optimizer's space, so every stage sums the global gradient norm in the same
order and clips with the same bits.

Note [persistent parameters]: ``zero.prefetch.persistence_threshold`` is per parameter, as
DeepSpeed's ``stage3_param_persistence_threshold`` (which maps onto it) is: at stage 3 a
parameter with fewer elements stays gathered between uses, and the rest of its module's
parameters are partitioned as usual. The unit machinery stays per unit: a unit's parameters
are split into those at or above the threshold (a unit partitioned as any) and those below it
(a persistent unit of their own, ``UnitSpec.persistent``), so the small parameters of a block
(its norms, its biases) form one persistent unit beside the block's unit, and a unit of small
parameters only is persistent whole, however many elements they sum to. The module, and for a
block each of its submodules, uses both units, so the hooks acquire and release both (Note
[hook protocol] in _engine.py); only the large one is freed at its last release. The split is
made at every stage with the config's threshold, so stages 1-2 keep the units and the flat
layout of stage 3; only a partitioned unit is persistent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .._offload._layout import padded
from .._offload._placement import Machine, Placement
from .._runtime._tiers import StagePolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class UnitSpec:
    """What a fetch unit will hold, known before anything is allocated: the layout, the
    preflight and the stores are computed from these (Note [shard layout] in _unit.py)."""

    index: int  # position in the unit list: the order of collectives
    module_name: str
    params: Tuple[Tuple[str, nn.Parameter], ...]
    shard_numel: int
    trainable: bool
    persistent: bool = False  # its parameters stay gathered at stage 3 (Note [persistent parameters])


def unit_spec(index: int, module_name: str, params: List[Tuple[str, nn.Parameter]], world_size: int,
              persistent: bool = False) -> UnitSpec:
    shard = sum(padded(p.numel(), world_size) // world_size for _, p in params)
    return UnitSpec(index, module_name, tuple(params), shard, any(p.requires_grad for _, p in params), persistent)


def plan_units(model: nn.Module, world_size: int, blocks=(), persistence_threshold: int = 0
               ) -> Tuple[List[UnitSpec], List[Tuple[str, nn.Module, List[int]]]]:
    """The fetch units of a model (Note [fetch unit grouping]): one per block in ``blocks``
    holding every parameter inside it (nested blocks apart), one per other module that owns
    parameters; each split into trainable, then frozen, and each of those into its parameters
    of at least ``persistence_threshold`` elements, then those below it (Note [persistent
    parameters]). And per module, the units it holds in its forward and backward: those
    owning its own parameters (tied ones: the owner's unit) and, for a block, all of the
    block's."""
    blocks = set(blocks)
    names = dict(model.named_modules())
    name_of = {id(m): n for n, m in names.items()}
    key_of: Dict[nn.Module, nn.Module] = {}  # module -> the block it belongs to, or itself
    members: Dict[nn.Module, list] = {}  # key -> its parameters in module order (first owner wins)
    seen = set()
    for name, module in names.items():
        parent = names.get(name.rsplit(".", 1)[0] if "." in name else "") if name else None
        key = module if module in blocks or parent is None else key_of[parent]
        if key is not module and key not in blocks:  # outside every block: a unit of its own
            key = module
        key_of[module] = key
        for pn, p in module._parameters.items():
            if p is not None and p not in seen:
                seen.add(p)
                members.setdefault(key, []).append((f"{name}.{pn}" if name else pn, p))
    specs: List[UnitSpec] = []
    owner: Dict[nn.Parameter, int] = {}
    key_units: Dict[nn.Module, List[int]] = {}
    for key, params in members.items():
        name = name_of[id(key)]
        for group, persistent in _groups(params, persistence_threshold):  # Note [frozen parameters] in _layout.py
            specs.append(unit_spec(len(specs), name, group, world_size, persistent))
            key_units.setdefault(key, []).append(specs[-1].index)
            for _, p in group:
                owner[p] = specs[-1].index
    uses = []
    for name, module in names.items():
        used = list(key_units.get(module, [])) if module in blocks else []
        for p in module._parameters.values():
            if p is not None and owner[p] not in used:
                used.append(owner[p])
        uses.append((name, module, used))
    return specs, uses


def block_modules(model: nn.Module, cfg) -> list:
    """Note [fetch unit grouping]: the modules that each form one fetch unit."""
    if cfg.group == "module":
        return []
    classes = set(cfg.classes)
    out = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            out += [m for m in module.children() if any(True for _ in m.parameters())]
        elif type(module).__name__ in classes:
            out.append(module)
    return out


def _groups(params: list, threshold: int) -> list:
    """A module's own parameters as up to four (group, persistent) pairs: trainable first (a unit
    is either trainable or frozen: Note [frozen parameters] in _layout.py), each as its
    parameters of at least ``threshold`` elements, then those below it (Note [persistent parameters])."""
    out = []
    for trainable in (True, False):
        mine = [x for x in params if x[1].requires_grad is trainable]
        large = [x for x in mine if x[1].numel() >= threshold]
        small = [x for x in mine if x[1].numel() < threshold]
        out += [(g, persistent) for g, persistent in ((large, False), (small, True)) if g]
    return out


def unit_specs_of(model: nn.Module, cfg, world_size: int) -> Tuple[List[UnitSpec], list]:
    """The fetch units of ``model`` under ``cfg`` on ``world_size`` ranks, and each module's uses
    (Note [fetch unit grouping], [persistent parameters]): the same at every stage, so that every
    stage has the same flat layout."""
    blocks = block_modules(model, cfg.zero.fetch_units)
    return plan_units(model, world_size, blocks, cfg.zero.prefetch.persistence_threshold)


def placement_of(model: nn.Module, cfg, world_size: int, machine: Optional[Machine] = None
                 ) -> Tuple[Placement, List[UnitSpec], list]:
    """The placement of ``model``'s states under ``cfg`` on ``world_size`` ranks of ``machine``
    (None: this one), with its units and each module's uses: what ``initialize`` allocates
    (Note [build order] in _initialize.py), and what ``infinity.estimate --plan`` reports for a
    model built on the meta device."""
    policy = StagePolicy.of(cfg.zero.stage)
    specs, uses = unit_specs_of(model, cfg, world_size)
    placement = Placement.of(cfg, policy, DTYPES[cfg.precision.dtype], specs, world_size, machine)
    return placement, specs, uses
