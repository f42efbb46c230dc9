"""``GatheredParameters`` and ``register_external_parameter``: the user-facing escape hatches."""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from .._runtime import _comm as comm
from .._runtime._log import logger
from ..errors import InvariantError, UsageError, UsageTypeError
from ._engine import EngineError, _pending_external, engine_of_unit, live_engines
from ._ledger import Hold
from ._param import info_of, raw_data
from ._unit import FetchUnit


def _as_list(params) -> list:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, nn.Module):
        raise UsageTypeError("GatheredParameters takes parameters, not a module: pass module.parameters()")
    return list(params)


class GatheredParameters:
    """Gather partitioned parameters for reading; with ``modifier_rank``, keep that rank's
    edits: on exit they are broadcast and re-partitioned into every rank's shard and fp32
    master weights. Collective: every rank must enter with the same parameters.

    Note [edits without modifier_rank]: without ``modifier_rank`` the parameters are for
    reading, as in DeepSpeed: edits made inside are discarded at exit, on every stage and
    tier, and a warning names the edited parameters. Whether an edit would otherwise survive
    depends on where the gathered tensor lives (a private buffer freed at exit, a view of a
    resident shard, whole stage 1-2 parameters), so it is detected (a fingerprint of each
    gathered parameter taken at entry and exit, any rank) and undone: the values are rebuilt
    from the stored shards (stage 3's parameter store, stages 1-2's master weights), or, where
    an edit would reach the only stored copy (one rank with the parameters resident: they are
    views of their store; stage 1-2 frozen parameters), from a copy taken at entry.
    """

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                 enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        infos = []
        for i, p in enumerate(self.params):
            if not isinstance(p, nn.Parameter):
                raise UsageTypeError(f"GatheredParameters: item {i} is a {type(p).__name__}, not an nn.Parameter")
            info = info_of(p)
            if info is None:
                raise UsageError(
                    f"GatheredParameters: item {i} (shape {tuple(p.shape)}) is not managed by infinity; only "
                    f"parameters of a model passed to infinity.initialize (or built under infinity.Init) can be gathered")
            infos.append(info)
        if modifier_rank is not None and not 0 <= modifier_rank < comm.world_size():
            raise UsageError(f"GatheredParameters: modifier_rank={modifier_rank} is not a rank of this job "
                             f"(world size {comm.world_size()})")
        self.units = sorted({info.unit for info in infos}, key=lambda u: u.index)

    def __enter__(self):
        for unit in self.units:
            unit.acquire(Hold.GATHERED)
        self._prints = self._saved = None
        if self.modifier_rank is None and self._managed():
            for engine in {id(e): e for e in map(engine_of_unit, self.units)}.values():
                engine.settle_writes()  # a handed-off shard may still be being written: edits must not reach the file
            self._prints = [_fingerprint(raw_data(p)) for unit in self.units for p in unit.params]
            self._saved = {unit: [raw_data(p).clone() for p in unit.params]
                           for unit in self.units if engine_of_unit(unit).needs_copy_to_restore(unit)}
        return self.params

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None and self.modifier_rank is not None:
                with torch.no_grad():
                    for unit in self.units:
                        for p in unit.params:
                            comm.broadcast(raw_data(p), self.modifier_rank)
                        _repartition(unit)
            elif exc_type is None and self._prints is not None:
                self._discard_edits()
        finally:
            for unit in self.units:
                unit.release(Hold.GATHERED)
        return False

    def _managed(self) -> bool:
        """The units belong to an initialized engine (not only to infinity.Init)."""
        return bool(self.units) and all(isinstance(u, FetchUnit) for u in self.units)

    def _discard_edits(self) -> None:
        """Note [edits without modifier_rank]."""
        now = [_fingerprint(raw_data(p)) for unit in self.units for p in unit.params]
        edited = torch.tensor([float(a != b) for a, b in zip(self._prints, now)], dtype=torch.float64)
        comm.all_reduce(edited, "sum")
        names, k = [], 0
        for unit in self.units:
            flags = edited[k : k + len(unit.params)]
            k += len(unit.params)
            if bool((flags > 0).any()):
                engine = engine_of_unit(unit)
                if engine is None or not isinstance(unit, FetchUnit):  # _managed() held when the block began
                    raise InvariantError(f"GatheredParameters: {unit.module_name or '<root>'} lost its engine "
                                         f"inside the block")
                engine.restore(unit, self._saved.get(unit))
                names += [info.name for info, f in zip(unit.infos, flags) if f > 0]
        if names:
            logger.warning("GatheredParameters: %s modified without modifier_rank; the edits were discarded (pass "
                           "modifier_rank=0 to keep the values of rank 0)", ", ".join(names[:5]) +
                           (f" and {len(names) - 5} more" if len(names) > 5 else ""))


def _repartition(unit) -> None:
    """The broadcast values of ``unit`` into every rank's stored shard: the engine's (shard and master weights), or,
    before ``initialize``, the Init store's chunk of an ``InitUnit`` (one parameter)."""
    engine = engine_of_unit(unit)
    if engine is not None:
        engine.repartition(unit)
    else:
        unit.store_full(raw_data(unit.params[0]))


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PIECE = 1 << 22  # elements hashed at a time: bounded temporary memory


def _fingerprint(t: torch.Tensor) -> int:
    """A number that changes when any value of ``t`` changes or values move: the sum, with
    wrap-around, of each element's bit pattern times an odd number that depends on its
    position (two different tensors collide with probability about 2**-64)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    bits = flat.view(_INT_OF[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)  # computed where the values are
    for lo in range(0, bits.numel(), _PIECE):
        piece = bits[lo : lo + _PIECE].to(torch.int64)
        weights = torch.arange(lo, lo + piece.numel(), dtype=torch.int64, device=flat.device)
        weights.mul_(0x9E3779B97F4A7C15 - (1 << 64)).bitwise_or_(1)
        total += piece.mul_(weights).sum()
    return int(total)


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``param`` though another module owns it, so it
    is gathered with ``module``. Usually detected automatically; this covers what isn't
    (e.g. use inside a custom autograd Function). Callable before or after initialize."""
    if not isinstance(module, nn.Module) or not isinstance(param, nn.Parameter):
        raise UsageTypeError("register_external_parameter(module, param) takes an nn.Module and an nn.Parameter")
    info = info_of(param)
    owner = engine_of_unit(info.unit) if info is not None else None  # None too for a parameter built under Init
    if owner is not None:
        owner.register_external(module, param)
        return
    engine = _engine_containing(module)
    if engine is not None:  # too late to wait for initialize: the parameter is not in that model
        raise EngineError(
            f"register_external_parameter: the parameter (shape {tuple(param.shape)}) is not part of the model that "
            f"{type(module).__name__} {engine.states[module].name!r} belongs to; register one of that model's parameters")
    _pending_external.setdefault(module, []).append(param)


def _engine_containing(module: nn.Module):
    """The engine whose model has ``module`` as a submodule, or None."""
    for engine in live_engines():
        if module in engine.states:
            return engine
    return None
