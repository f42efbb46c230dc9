"""``GatheredParameters`` and ``register_external_parameter``: the user-facing escape hatches."""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from . import _comm as comm
from ._engine import EngineError, _engines, _pending_external
from ._param import info_of, raw_data


def _as_list(params) -> list:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, nn.Module):
        raise TypeError("GatheredParameters takes parameters, not a module: pass module.parameters()")
    return list(params)


class GatheredParameters:
    """Gather partitioned parameters for reading; with ``modifier_rank``, keep that rank's
    edits: on exit they are broadcast and re-partitioned into every rank's shard and fp32
    master weights. Collective: every rank must enter with the same parameters."""

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                 enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        for i, p in enumerate(self.params):
            if not isinstance(p, nn.Parameter):
                raise TypeError(f"GatheredParameters: item {i} is a {type(p).__name__}, not an nn.Parameter")
            if info_of(p) is None:
                raise ValueError(
                    f"GatheredParameters: item {i} (shape {tuple(p.shape)}) is not managed by infinity; only "
                    f"parameters of a model passed to infinity.initialize (or built under infinity.Init) can be gathered")
        if modifier_rank is not None and not 0 <= modifier_rank < comm.world_size():
            raise ValueError(f"GatheredParameters: modifier_rank={modifier_rank} is not a rank of this job "
                             f"(world size {comm.world_size()})")
        self.units = sorted({info_of(p).unit for p in self.params}, key=lambda u: u.index)

    def __enter__(self):
        for unit in self.units:
            unit.acquire()
        return self.params

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None and self.modifier_rank is not None:
                with torch.no_grad():
                    for unit in self.units:
                        for p in unit.params:
                            comm.broadcast(raw_data(p), self.modifier_rank)
                        unit.engine.repartition(unit)
        finally:
            for unit in self.units:
                unit.release()
        return False


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``param`` though another module owns it, so it
    is gathered with ``module``. Usually detected automatically; this covers what isn't
    (e.g. use inside a custom autograd Function). Callable before or after initialize."""
    if not isinstance(module, nn.Module) or not isinstance(param, nn.Parameter):
        raise TypeError("register_external_parameter(module, param) takes an nn.Module and an nn.Parameter")
    info = info_of(param)
    if info is not None:
        info.unit.engine.register_external(module, param)
        return
    engine = _engine_containing(module)
    if engine is not None:  # too late to wait for initialize: the parameter is not in that model
        raise EngineError(
            f"register_external_parameter: the parameter (shape {tuple(param.shape)}) is not part of the model that "
            f"{type(module).__name__} {engine.states[module].name!r} belongs to; register one of that model's parameters")
    _pending_external.setdefault(module, []).append(param)


def _engine_containing(module: nn.Module):
    """The engine whose model has ``module`` as a submodule, or None."""
    for engine in list(_engines.values()):
        if module in engine.states:
            return engine
    return None
