"""The operations the composition root (``initialize``, _initialize.py) injects into the
engine's parts, each typed as a Protocol that names what provides it.

Note [injected operations]: a part that must act on another without holding it (a unit that
asks the prefetcher for room, the reducer that hands shards to the sink, the optimizer that
waits for a save) takes the one operation it needs, typed here. Each Protocol's docstring names
its provider in the running engine, so a reader resolves a call without reading
_initialize.py; a test passes any callable of the same shape (a lambda, a recorder). The two a
fetch unit takes (``MakeRoom``, ``FetchOnDemand``) are in _unit.py, which this module follows,
the step gate's (``TimeStall``, ``Speculation``) in _step_gate.py, which the unit imports, the
sink's (``Landed``) in _grad_sink.py, and the speculative update's (``UpdatePiece``,
``OutputViews``) in _speculative_update.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .._offload._swap import SwapDirs
    from .._runtime._accelerator import DeviceBudget
    from ._unit import FetchUnit


class AccumulateShard(Protocol):
    """This rank's reduced gradient shard of ``unit`` goes to the optimizer's gradient shards.
    Provider: ``GradSink.accumulate`` (_grad_sink.py)."""

    def __call__(self, unit: "FetchUnit", shard_grad: torch.Tensor) -> None: ...


class NoteUnit(Protocol):
    """``unit``'s gradient entered the reducer. Provider: ``GradSink.note`` (_grad_sink.py)."""

    def __call__(self, unit: "FetchUnit") -> None: ...


class Action(Protocol):
    """An operation with no arguments and no result. Providers, by where it is injected:
    ``GradReducer.consumers_done``: ``GradSink.consumers_done`` (every reduced shard consumed);
    ``BackwardHooks.on_abort``: ``GradSink.backward_aborted`` (Note [aborted backward] in
    _backward.py); ``EngineOps.wait_for_saves``: ``SaveFence.wait_writes`` (Note [save fence] in
    _save_fence.py); ``EngineOps.reduce_rest``: ``GradReducer.reduce_all`` at stage 1, nothing at
    stages 2-3; ``EngineOps.after_step``: ``Engine.after_step``; ``EngineOps.end_aborted_backward``:
    ``Engine.end_aborted_backward``."""

    def __call__(self) -> None: ...


class CheckSameGathers(Protocol):
    """Every rank gathered the same units in the same order up to ``where`` (or a clear error
    names the first difference). Provider: ``check_same_gathers``, bound to the engine's ledger
    and units (Note [same gathers on every rank] in _same_gathers.py)."""

    def __call__(self, where: str) -> None: ...


class EngineSurface(Protocol):
    """Note [what the optimizer's holders see]: ``ZeroOptimizer.engine`` is the engine as those
    who hold the optimizer (the train command, its summary and SSD ledger, the Trainer, the model
    check) may use it: where the rank stands, its swap directories, its telemetry and bytes per
    tier, its device budget, and ``close``. Nothing else of the engine is theirs to read or call;
    ``tests/unit/test_layering.py`` checks every ``.engine.<name>`` in the apps layer against
    this list. The checkpoint layer, which saves and restores the units themselves, takes the
    whole engine from ``engine_of(model)`` (_engine.py). Provider: ``Engine``."""

    rank: int
    world_size: int
    swap_dirs: "SwapDirs"

    def telemetry(self, reset: bool = True) -> dict: ...

    def tier_bytes(self) -> dict: ...

    @property
    def device_budget(self) -> "DeviceBudget": ...

    def close(self) -> None: ...
