"""Operators on parameters that ``infinity.Init`` partitioned, before ``initialize``: each runs on
the full tensors, and what it changed is partitioned again.

Note [touched placeholders]: a parameter partitioned by Init is a placeholder (Note
[partitioned parameter] in _param.py) whose values are this rank's shard in the Init store.
Initialization code (Hugging Face's ``_init_weights``, ``post_init``, ``tie_weights``,
``resize_token_embeddings``, ``torch.nn.init``, a user's ``__init__``) touches it as if it were
whole, and each touch must have exactly the effect it has without Init. So every operator that
reaches a placeholder (``run_on_full``):
- materializes it: the shards are all-gathered into a temporary full tensor (``InitUnit.materialize``);
- runs on the full tensors, with each view of a parameter replayed on them;
- partitions again every full tensor the operator changed. "Changed" is read from the tensor's
  version counter, which every in-place write bumps, through any view, ``out=`` and
  ``__setitem__`` included: no list of in-place operator names (a name that merely ends in
  ``_``, as ``__getitem__`` does, once made ``zeros_(weight[pad])`` zero the whole matrix). An
  operator that changes a full tensor's shape, strides or storage in place (``t_``,
  ``resize_``, ``set_``) cannot be partitioned back as it is and is refused, naming the
  parameter and the operator; an assignment of ``.data`` may change shape and dtype
  (``resize_token_embeddings`` does): the parameter's partition is rebuilt for the new tensor;
- then drops the temporaries: at most the parameters of one operator are whole at a time.
A result that aliases a temporary (``weight[idx]``, ``weight[:, :k]``, ``weight.data``,
``narrow``, ``select``, ``split``, ``detach``, ``view``, ``.to`` of the same dtype) cannot be
returned as it is: writes into it would reach a tensor about to be freed, silently. It is
returned as a ``ParamView``: a tensor without storage (a wrapper subclass) that holds only its
recipe, the operator and arguments that made it from its parameters. Each operator on a view
goes through its ``__torch_function__`` and so through the same steps: materialize, replay the
recipe (a real view of the new temporary), run, partition what changed. A view therefore cannot
escape its parameter: it never holds values, its metadata are the real view's, an operator that
would bypass ``__torch_function__`` reaches its ``__torch_dispatch__`` and raises, and a view
used after ``initialize`` reaches the engine's parameter, which is gathered
(``GatheredParameters``) or refused like the parameter itself. Results that alias nothing are
ordinary tensors; results that hand out memory a write could go to unseen (``numpy``,
``__array__``, ``__dlpack__``) are refused. A parameter already gathered is used as itself.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Protocol, Tuple

import torch
from torch import nn

from ..errors import UsageError
from ._param import ParamState, ParamView, ViewStep, _iter_params, info_of


class Touchable(Protocol):
    """What ``run_on_full`` needs of a parameter's owner before ``initialize`` (an ``InitUnit``)."""

    def materialize(self) -> torch.Tensor: ...

    def store_full(self, full: torch.Tensor) -> None: ...


# Results that share memory with the temporary full tensor outside torch's view tracking.
_ESCAPES = {torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__dlpack__}


def op_name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


def _layout(t: torch.Tensor) -> tuple:
    """What an in-place operator may not change about a full tensor."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().data_ptr()


def _aliases(out: torch.Tensor, full: torch.Tensor) -> bool:
    if full.is_meta or out.is_meta or full.untyped_storage().nbytes() == 0:
        return False  # a parameter still without values (from_pretrained): nothing to write to
    return out.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def _unique_params(args, kwargs) -> List[nn.Parameter]:
    seen: Dict[int, nn.Parameter] = {}
    for p in itertools.chain(_iter_params(args), _iter_params(kwargs)):
        seen.setdefault(id(p), p)
    return list(seen.values())


class _Run:
    """One operator on full tensors: the temporaries, what was substituted, and what changed."""

    def __init__(self, func, args, kwargs, touch: Callable[[nn.Parameter, str], Touchable], op: str = ""):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.op = op or op_name(func)
        self.bases = _unique_params(args, kwargs)
        self.fulls: Dict[int, torch.Tensor] = {}
        self.owned: Dict[int, Tuple[nn.Parameter, Touchable, int]] = {}
        for p in self.bases:
            info = info_of(p)
            if info is None or info.state is ParamState.AVAILABLE:
                self.fulls[id(p)] = p  # gathered: used as itself
                continue
            unit = touch(p, self.op)
            full = unit.materialize()
            self.fulls[id(p)] = full
            self.owned[id(p)] = (p, unit, full._version)
        self.subs: List[Tuple[torch.Tensor, torch.Tensor, tuple]] = []  # (parameter or view, what the operator got)

    def substitute(self, obj):
        if isinstance(obj, ParamView) or (isinstance(obj, torch.Tensor) and id(obj) in self.fulls):
            real = obj.replay(self.fulls) if isinstance(obj, ParamView) else self.fulls[id(obj)]
            self.subs.append((obj, real, _layout(real)))
            return real
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self.substitute(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self.substitute(v) for k, v in obj.items()}
        return obj

    def run(self):
        if self.func in _ESCAPES and self.owned:
            raise UsageError(f"{self.op} of parameter {self._name()} under infinity.Init would hand out memory of a "
                             f"temporary copy (writes to it would be lost); wrap it in `with infinity."
                             f"GatheredParameters([param], modifier_rank=0):` or use a torch operator")
        args, kwargs = self.substitute(self.args), self.substitute(self.kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = self.func(*args, **kwargs)
        changed = self._repartition()
        return self._wrap(out, (), changed)

    def _repartition(self) -> bool:
        """Partition again each full tensor the operator changed (Note [touched placeholders])."""
        changed = False
        for orig, real, layout in self.subs:
            if _layout(real) != layout:
                what = "parameter" if isinstance(orig, nn.Parameter) else "a view of parameter"
                raise UsageError(
                    f"{self.op} changes the shape, strides or storage of {what} {self._name()} in place; under "
                    f"infinity.Init a partitioned parameter and its views cannot take that change. Assign a new "
                    f"tensor instead (param.data = ..., or module.<name> = nn.Parameter(...))")
        for pid, (p, unit, version) in self.owned.items():
            full = self.fulls[pid]
            if full._version != version:
                unit.store_full(full)
                changed = True
        return changed

    def _wrap(self, out, index: tuple, changed: bool):
        if type(out) in (tuple, list):
            return type(out)(self._wrap(x, index + (i,), changed) for i, x in enumerate(out))
        if not isinstance(out, torch.Tensor):
            return out
        for orig, real, _ in self.subs:
            if out is real:
                return orig  # an in-place operator returns its argument: the parameter or view itself
        if not any(_aliases(out, self.fulls[pid]) for pid in self.owned):
            return out
        if changed:
            raise UsageError(f"{self.op} changed parameter {self._name()} and returned a new view of it; under "
                             f"infinity.Init that view cannot be made again. Change the parameter and take the view "
                             f"in two operators")
        return ParamView.of(self.bases, ViewStep(self.func, self.args, self.kwargs, index), out, out.device)

    def _name(self) -> str:
        names = [repr(i.name) for p, *_ in self.owned.values() if (i := info_of(p)) is not None]
        return ", ".join(names) or "?"


def run_on_full(func, args, kwargs, touch: Callable[[nn.Parameter, str], Touchable]) -> Any:
    """Note [touched placeholders]: run ``func`` on the full tensors of the partitioned parameters
    it reads, directly or through views; partition again the ones it changed; return views of
    them as ``ParamView``s. ``touch(param, op)`` gives a parameter's owner (or raises)."""
    return _Run(func, args, kwargs, touch).run()


def realize(value, touch: Callable[[nn.Parameter, str], Touchable], op: str) -> torch.Tensor:
    """A real tensor with the values of ``value`` (a parameter, a view, or a tensor)."""
    if not isinstance(value, (ParamView, nn.Parameter)) or not _unique_params((value,), {}):
        return value
    return _Run(torch.Tensor.detach, (value,), {}, touch, op).substitute(value)


def data_view(param: nn.Parameter, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> ParamView:
    """``param.data`` of a partitioned parameter: the view that is the whole parameter."""
    return ParamView.of((param,), None, torch.empty(shape, dtype=dtype, device="meta"), device)
