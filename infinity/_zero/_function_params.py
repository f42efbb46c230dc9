"""Partitioned parameters handed to a custom ``torch.autograd.Function``.

Note [parameters read by autograd Functions]: fused losses (TRL's chunked log-probabilities,
Liger's fused linear cross-entropy, hand-written kernels) read a head's weight directly and
pass it to ``Function.apply``, outside the head's own forward. A released parameter touched by
an operator is gathered on demand (Note [partitioned parameter] in _param.py), but
``Function.apply`` is no operator: torch records each input's shape when the Function is
applied, before its ``forward`` touches anything, so it would record the empty placeholder and
reject the full-shape gradient the backward returns ("expected shape compatible with [0]"). So
``Function.apply`` itself fetches its released parameters first, through the same on-demand
path as an operator: inside a module call the unit is gathered, held until that call's
post-forward and recorded as an external parameter of the module, so the module's pre-backward
gathers it again before the Function's backward runs (the saved parameter is the parameter
object itself, whose data is then full), and the gradient, accumulated into ``.grad`` once,
reaches the reducer through the parameter's post-accumulate-grad hook as any other. The price
of going through the module's external parameters: from the second iteration on, the module
(for TRL's fused head, the model itself) gathers the unit in its pre-forward and holds it to
its post-forward, so a big head stays gathered through the whole forward rather than only
around the Function (counted in the gathered budget as every hold is). Outside every module
call it raises, saying to apply the Function inside the model's forward (TRL's fused losses
already run there); so does a parameter of another model than the one whose forward is running
(each engine gathers only inside its own model's calls). The wrapper is installed once per
process, by the first stage-3 engine, and costs one scan of the arguments per ``apply``.
"""
from __future__ import annotations

import itertools

import torch

from ._param import ParameterNotAvailableError, ParamState, _iter_params, info_of

_installed = False


def install() -> None:
    """Make ``torch.autograd.Function.apply`` fetch released partitioned parameters (idempotent)."""
    global _installed
    if _installed:
        return
    original = torch.autograd.Function.__dict__["apply"].__func__

    def apply(cls, *args, **kwargs):
        infos = [info for p in itertools.chain(_iter_params(args), _iter_params(kwargs))
                 if (info := info_of(p)) is not None and info.state is not ParamState.AVAILABLE]
        if infos:
            _fetch(cls, infos)
        return original(cls, *args, **kwargs)

    apply.__doc__ = original.__doc__
    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    _installed = True


def _fetch(cls: type, infos: list) -> None:
    """Gather the units of ``infos`` as an operator's use would (Note [parameters read by autograd Functions])."""
    op = f"{cls.__name__}.apply"

    def fetched():
        return None

    fetched.__name__ = op
    by_owner: dict = {}  # each model's parameters through its own engine: another model's have no call running
    for info in infos:
        by_owner.setdefault(id(getattr(info.unit, "ctx", info.unit)), []).append(info)
    try:
        for group in by_owner.values():
            group[0].unit.on_unavailable(fetched, (), {}, group)
    except ParameterNotAvailableError as e:
        raise ParameterNotAvailableError(
            f"{e} A custom autograd Function ({op}) given partitioned parameters must be applied inside the forward of "
            f"a module of the model (e.g. the loss computed in the model's forward, as TRL's fused losses are): "
            f"there the parameters are gathered for it, and again for its backward.") from None
