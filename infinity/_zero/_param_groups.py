"""Parameter groups and per-parameter step counts over the optimizer's flat fp32 space.

Note [update plan]: ``torch.optim.AdamW`` updates a parameter only when its ``.grad`` is
not None, and keeps a step count of its own for the bias correction; each group has its own
lr / betas / eps / weight_decay, which an LR scheduler may change between steps. The flat
space holds the shards of every parameter (Note [shard layout] in _unit.py); a ``Slot``
says where one trainable parameter's shard lies and which group it belongs to. At each step
the parameters that got a gradient on any rank (a global fact: their flags are all-reduced
with the gradient norm) advance their own step count, and the update runs over the *plan*:
maximal flat ranges of such parameters with the same group and step count, one Adam call
each with that group's hyperparameters as they were when ``step()`` was called. Everything
outside the plan (frozen parameters, parameters without a gradient this step, padding) is
left as it is: master weights, moments and step count.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from ..errors import ParamGroupError, UsageError, UsageTypeError
from ..optim._functional import Hyper

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


@dataclass(frozen=True)
class Slot:
    """Where one trainable parameter's shard lies in the flat space."""

    lo: int
    hi: int
    index: int  # position among the engine's parameters (unit order): its gradient flag
    group: int


@dataclass(frozen=True)
class Run:
    """One Adam call of a step: a flat range and its hyperparameters (``step`` included)."""

    lo: int
    hi: int
    hyper: dict


@dataclass(frozen=True)
class UpdatePlan:
    """The runs of one step, in flat order, and where each starts (for ``runs_in``)."""

    runs: List[Run]
    starts: List[int] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "starts", [r.lo for r in self.runs])

    def with_hyper(self, **extra) -> "UpdatePlan":
        return UpdatePlan([Run(r.lo, r.hi, dict(r.hyper, **extra)) for r in self.runs])


def resolve_groups(named: Sequence[tuple], param_groups: Optional[Iterable[dict]]) -> List[dict]:
    """torch-style groups over the model's parameters: every trainable parameter in exactly
    one group (frozen ones may be left out). ``None``: one group of every trainable parameter."""
    trainable = [p for _, p in named if p.requires_grad]
    if param_groups is None:
        return [{"params": trainable}]
    if isinstance(param_groups, dict) or isinstance(param_groups, torch.Tensor):
        raise ParamGroupError("param_groups must be a list of dicts, each with a 'params' list "
                              "(as for torch.optim.AdamW)")
    names = {id(p): n for n, p in named}
    groups: list = []
    where: dict = {}
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ParamGroupError(f"param_groups[{i}] must be a dict with a 'params' list, got {type(group).__name__}")
        for key, allowed in _UNSUPPORTED.items():
            if group.get(key, allowed) != allowed:
                raise ParamGroupError(f"param_groups[{i}] sets {key}={group[key]!r}, which infinity's Adam does not "
                                      f"support; remove the key")
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in params:
            if id(p) not in names:
                raise ParamGroupError(f"param_groups[{i}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                      f"parameter of this model; list the model's own parameters")
            if id(p) in where:
                raise ParamGroupError(f"parameter {names[id(p)]!r} is in param_groups[{where[id(p)]}] and "
                                      f"param_groups[{i}]; put each parameter in one group")
            where[id(p)] = i
        groups.append(dict(group, params=params))
    missing = [names[id(p)] for p in trainable if id(p) not in where]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ParamGroupError(f"trainable parameters in no parameter group: {', '.join(missing[:5])}{more}; add them "
                              f"to a group or set requires_grad=False on them")
    return groups


def slots_of(units, groups: List[dict]) -> List[Slot]:
    """The flat range of every trainable parameter listed in ``groups``, in flat order."""
    group_of: Dict[int, int] = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    slots, index = [], 0
    for unit in units:
        for p, info in zip(unit.params, unit.infos):
            g = group_of.get(id(p))
            if g is not None and p.requires_grad:
                lo = unit.opt_offset + info.shard_offset
                slots.append(Slot(lo, lo + info.shard_numel, index, g))
            index += 1
    return slots


class StepCounts:
    """Each trainable parameter's step count, and the plan of one step (Note [update plan])."""

    def __init__(self, slots: List[Slot], num_params: int):
        self.slots = slots
        self.num_params = num_params
        self.counts = torch.zeros(len(slots), dtype=torch.int64)  # steps taken, per slot
        self._slot_of = {slot.index: k for k, slot in enumerate(slots)}

    def advance(self, got_grad: torch.Tensor, groups: List[dict], adamw: bool) -> UpdatePlan:
        """Count a step for the slots whose parameter got a gradient (``got_grad``: a flag
        per parameter, > 0 where any rank had one) and return the update plan."""
        plan = self.peek(got_grad, groups, adamw)
        for k, slot in enumerate(self.slots):
            if got_grad[slot.index] > 0 and slot.hi > slot.lo:
                self.counts[k] += 1
        return plan

    def peek(self, got_grad: torch.Tensor, groups: List[dict], adamw: bool) -> UpdatePlan:
        """The plan ``advance`` would return, counting nothing (Note [speculative update] in
        _speculative_update.py)."""
        runs: List[Run] = []
        for k, slot in enumerate(self.slots):
            if got_grad[slot.index] <= 0 or slot.hi == slot.lo:
                continue
            hyper = hyper_of(groups[slot.group], int(self.counts[k]) + 1, adamw)
            if runs and runs[-1].hi == slot.lo and runs[-1].hyper == hyper:
                runs[-1] = Run(runs[-1].lo, slot.hi, hyper)
            else:
                runs.append(Run(slot.lo, slot.hi, hyper))
        return UpdatePlan(runs)

    def step_of(self, index: int) -> int:
        """Steps taken by the parameter at ``index`` (0 if it never had a gradient)."""
        k = self._slot_of.get(index)
        return 0 if k is None else int(self.counts[k])


def hyper_of(group: dict, step: int, adamw: bool) -> dict:
    return dict(step=step, lr=float(group["lr"]), betas=tuple(float(b) for b in group["betas"]),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), adamw=adamw)


def runs_in(plan: UpdatePlan, lo: int, hi: int):
    """(start, end, hyper) of the parts of the plan inside [lo, hi)."""
    runs = plan.runs
    i = max(0, bisect.bisect_right(plan.starts, lo) - 1)
    while i < len(runs) and runs[i].lo < hi:
        a, b = max(lo, runs[i].lo), min(hi, runs[i].hi)
        if a < b:
            yield a, b, runs[i].hyper
        i += 1


def gaps(lo: int, hi: int, covered) -> List[tuple]:
    """The parts of [lo, hi) outside the sorted, disjoint ``covered`` (start, end) ranges."""
    out, pos = [], lo
    for a, b in covered:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < hi:
        out.append((pos, hi))
    return out


def pieces(lo: int, hi: int, targets: list):
    """(start, end, view) of the parts of [lo, hi) that the ``(start, view)`` targets cover."""
    for start, view in targets:
        a, b = max(lo, start), min(hi, start + view.numel())
        if a < b:
            yield a, b, view[a - start : b - start]


def first_nonfinite(flat: Optional[torch.Tensor], units) -> Optional[str]:
    """The first parameter whose gradient shard in ``flat`` (this rank's, in memory) holds
    inf/NaN; None when there is none or the gradients are not in memory (streamed from NVMe:
    the error names the step, not the parameter). Only on the error path: one more pass."""
    if flat is None:
        return None
    for unit in units:
        if not unit.trainable:
            continue
        shard = flat[unit.opt_offset : unit.opt_offset + unit.shard_numel]
        if bool(torch.isfinite(shard).all()):
            continue
        for info in unit.infos:
            if not bool(torch.isfinite(shard[info.shard_offset : info.shard_offset + info.shard_numel]).all()):
                return info.name
    return None


def unit_labels(units) -> tuple:
    """(offsets, labels) of the units with an optimizer range, in flat order (``label_at``)."""
    pairs = sorted((u.opt_offset, u.label) for u in units if u.trainable and u.shard_numel)
    return [o for o, _ in pairs], [name for _, name in pairs]


def label_at(labels: tuple, offset: int) -> str:
    """The unit whose optimizer range holds ``offset``: a chunk's first, named in its profiler
    range (Note [profiler ranges] in _telemetry_counters.py)."""
    offsets, names = labels
    i = bisect.bisect_right(offsets, offset) - 1
    return names[i] if i >= 0 else ""


def named_parameters(units) -> List[tuple]:
    """(qualified name, parameter) of every managed parameter, in unit order."""
    return [(info.name, p) for unit in units for p, info in zip(unit.params, unit.infos)]


def check_group_hyper(groups: List[dict], adamw: bool) -> None:
    """Values a group sets must be valid for Adam (``Hyper.checked``, the native Adam's own
    check): say which group and what to change."""
    for i, g in enumerate(groups):
        try:
            Hyper.checked(**{k: g[k] for k in HYPER_KEYS}, adamw=adamw)
        except (UsageError, UsageTypeError) as e:
            raise ParamGroupError(f"param_groups[{i}]: {e}") from None
