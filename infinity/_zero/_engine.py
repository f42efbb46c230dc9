"""The engine behind ``infinity.initialize``: one ``Engine`` per model, which holds what
``initialize`` built (the fetch units and their services, in build order: Note [build order]
in _initialize.py), casts and partitions the parameters, installs the hooks (in one place,
handles kept) and closes it all. The units are planned in _unit_plan.py (Note [fetch unit
grouping] in _unit_plan.py), gradients are reduce-scattered by ``GradReducer`` (_reduce.py) from the
backward hooks (_backward.py), edits of gathered values are ``ParameterEdits``
(_param_edits.py) and the engine's telemetry is ``EngineReport`` (_engine_report.py). What
differs between ZeRO stages is one small frozen policy (``StagePolicy``), not checks scattered
through the code.

Note [hook protocol]: the hooks at stage 3.
- pre-forward of a hooked module M (Note [hooks per unit] in _module_state.py): acquire
  (gather) the units M uses, its own and those owning external parameters it touches;
  post-forward: release them and, when autograd will come back through M, hook M's outputs
  so its units are re-acquired before M's backward (pre-backward).
- a parameter used while RELEASED inside a managed forward is gathered on demand, held until
  the running module's post-forward, and recorded as an external dependency of that
  module, so later iterations (and its backward) fetch it up front.
- post-accumulate-grad hook of each parameter: when all parameters of a unit have their
  gradient, the unit's gradients go to the reducer (stages 2 and 3) and every module whose
  backward was waiting for that unit drops its hold.
- end of backward (autograd callback): reduce what is left (parameters without a gradient
  on this rank, as zeros: Note [bucket plan] in _reduce.py), wait for every reduce-scatter,
  release every remaining hold. After backward only persistent units (the parameters below
  ``persistence_threshold``, in units of their own: Note [persistent parameters] in
  _unit_plan.py) stay gathered, until the step makes their copies stale.
The backward half (pre-backward, post-accumulate-grad, the end of backward) is
``BackwardHooks`` in _backward.py, with Note [hold until the input gradients] and Note [used
again in one backward] in _backward.py; each module's progress through backward is its ``ModuleState``'s
(Note [backward progress] in _module_state.py). At the model's own hooks the engine begins
and ends a forward (Note [phases] in _phase.py), except inside backward, where activation
checkpointing recomputes the model and its hooks run as any module's.

Note [aborted forward]: a module's forward can end by an exception, and not only on error:
non-reentrant activation checkpointing stops its recomputation inside backward by raising
(``_StopRecomputationError``) as soon as the tensors it needs are recomputed, i.e. in the
middle of the block's last submodule. The post-forward hook is therefore registered with
``always_call=True``: every frame pushed by a pre-forward hook is popped and its units
released, whatever way the forward ended (before, the aborted frames kept their units gathered,
so the step could not refresh them and later forwards saw stale values). The model's own
forward that raises (out of device memory) ends its pass there (``_abort_forward``): what it
held is free once the exception is dropped; with more ranks, the next call asks the others
whether theirs failed too (Note [one rank failing] in _comm.py). A backward that raises is
ended at the next forward (or ``zero_grad``, ``step``, ``close``): Note [aborted backward] in
_backward.py.
"""
from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from .._offload._memory_plan import stop_block_cache
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._save_fence import SaveFence
from ..errors import EngineError
from . import _function_params
from ._backward import BackwardHooks
from ._engine_report import EngineReport
from ._ledger import Hold
from ._loss_scale import scale_outputs
from ._module_state import ModuleState, hooked_modules
from ._param import info_of, make_partitioned, raw_data, set_data
from ._param_edits import ParameterEdits
from ._phase import Calls, Frame, Phase, tensors_in
from ._same_gathers import check_same_gathers
from ._unit import FetchUnit, UnitContext
from ._unit_plan import DTYPES, block_modules, plan_units  # noqa: F401 - the engine's planning, re-exported

if TYPE_CHECKING:
    from .._offload._optimizer_store import OptimizerStore
    from .._offload._placement import Placement
    from .._offload._swap import SwapDirs
    from ._activation_offload import ActivationOffloader
    from ._grad_sink import GradSink
    from ._loss_scale import LossScaler
    from ._prefetch import Prefetcher
    from ._reduce import GradReducer

# external parameters registered before initialize (e.g. inside a model's __init__)
_pending_external: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()

_PARTITION_WRITES_IN_FLIGHT = 128 << 20  # bytes of shards written by cast_and_partition before it waits


@dataclass(frozen=True)
class EngineParts:
    """What ``initialize`` built before the engine, in build order (Note [build order] in
    _initialize.py)."""

    placement: "Placement"
    ctx: UnitContext  # the services the units share: counters, ledger, stores, step gate
    calls: Calls  # the phase and the stack of module calls (Note [phases] in _phase.py)
    units: List[FetchUnit]
    uses: List[Tuple[str, nn.Module, List[int]]]  # per module: the units whose parameters it holds
    opt_store: "OptimizerStore"  # Note [optimizer store protocol] in _optimizer_store.py
    prefetcher: "Prefetcher"
    reducer: "GradReducer"
    sink: "GradSink"  # where the reducer delivers gradients (Note [gradients to the host] in _grad_sink.py)
    scaler: Optional["LossScaler"]  # fp16 only
    swap_dirs: "SwapDirs"
    memory_plan: dict  # the preflight's plan, by tier and category (Note [one memory model] in _memory_plan.py)
    activation_offload: Optional["ActivationOffloader"] = None  # activation_checkpointing.offload: cpu
    block_cache: bool = False  # torch's large CPU blocks come from the block cache (Note [block cache] in host_alloc.cpp)


class Engine(ParameterEdits, EngineReport):
    def __init__(self, model: nn.Module, cfg, parts: EngineParts):
        ctx = parts.ctx
        self.model = model
        self.cfg = cfg
        self.placement = parts.placement
        self.policy = parts.placement.policy  # the one stage policy (_tiers.py)
        self.ctx = ctx
        self.world_size = ctx.world_size
        self.rank = ctx.rank
        self.dtype = ctx.dtype
        self.itemsize = ctx.itemsize
        self.units: List[FetchUnit] = parts.units
        self.states: Dict[nn.Module, ModuleState] = {}
        for name, module, indices in parts.uses:
            state = self.states[module] = ModuleState(module, name)
            for i in indices:
                state.add_unit(self.units[i])
        self.calls = parts.calls  # Note [phases] in _phase.py
        self.counters = ctx.counters
        self.ledger = ctx.ledger
        self.gathered_buffers = ctx.gathered_buffers
        self.gate = ctx.step_gate
        self.save_fence = SaveFence()  # Note [save fence] in _save_fence.py
        self.param_store = ctx.param_store
        self.opt_store = parts.opt_store
        self.prefetcher = parts.prefetcher
        self.reducer = parts.reducer
        self.scaler = parts.scaler
        self.swap_dirs = parts.swap_dirs
        self.memory_plan = parts.memory_plan
        self.block_cache = parts.block_cache
        # the engine's hold on the block cache ends at close, or when the engine is collected unclosed
        self._block_cache_done = weakref.finalize(self, stop_block_cache) if parts.block_cache else None
        self.activation_offload = parts.activation_offload  # Note [which tensors are offloaded] in _activation_offload.py
        self.check_same_gathers = functools.partial(  # Note [same gathers on every rank] in _same_gathers.py
            check_same_gathers, self.ledger, self.units, world_size=self.world_size, rank=self.rank,
            partitioned=self.policy.partition_params)
        self.backward = BackwardHooks(  # Note [hook protocol]: the backward half
            self.units, list(self.states.values()), calls=self.calls, prefetcher=self.prefetcher,
            reducer=self.reducer if self.policy.reduce_in_backward else None, ledger=self.ledger,
            counters=self.counters, check_same_gathers=self.check_same_gathers,
            on_abort=parts.sink.backward_aborted)
        self._handles: list = []
        self._hooked: Set[nn.Module] = set()  # the modules with forward hooks
        self._forward_failed = False  # Note [aborted forward]: the other ranks not asked yet
        self._telemetry_totals: dict = {}  # running totals at the last telemetry() call
        for module, params in list(_pending_external.items()):
            if module in self.states:
                for p in params:
                    self.register_external(module, p)
        model.__dict__[_HOLD] = _EngineHold(self)
        _live.add(self)

    @property
    def live_elems(self) -> int:
        """Elements of gathered (full) parameters alive now."""
        return self.ledger.live

    @property
    def peak_live_elems(self) -> int:
        return self.ledger.peak

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        info = info_of(param)
        if info is None or getattr(info.unit, "ctx", None) is not self.ctx:
            raise EngineError("register_external_parameter: the parameter is not part of this model")
        if module not in self.states:
            raise EngineError(f"register_external_parameter: {type(module).__name__} is not a submodule of this model")
        self.states[module].add_unit(info.unit)
        if self._handles and module not in self._hooked:  # Note [hooks per unit] in _module_state.py
            self._hooked.add(module)
            self._hook(module)

    def cast_and_partition(self) -> None:
        """Cast parameters to the compute dtype; in stage 3 keep only this rank's shards.
        Parameters built under infinity.Init are adopted: whole again for stages 1-2."""
        inits = {id(iu.init): iu.init for unit in self.units for iu in unit._init_units if iu is not None}
        if not self.policy.partition_params:
            for unit in self.units:
                unit.materialize_init_params()
        move = not self.policy.partition_params  # stages 1-2: whole parameters live on the device
        for unit in self.units:
            for p in unit.params:
                data = raw_data(p)
                dtype = self.dtype if data.is_floating_point() else data.dtype
                device = acc.device() if move else data.device  # stage 3: partitioned from where they are
                if data.dtype != dtype or data.device != device:
                    set_data(p, data.to(device=device, dtype=dtype))  # one copy for the cast and the move
        for module in self.model.modules():  # buffers on the device, cast to the compute dtype (as Module.to)
            for name, b in list(module._buffers.items()):
                if b is None:
                    continue
                cast = b.is_floating_point() and b.dtype != self.dtype and self.dtype != torch.float32
                if cast or not acc.on_device(b):
                    module._buffers[name] = b.to(device=acc.device(), dtype=self.dtype if cast else b.dtype)
        if self.policy.partition_params:
            store, in_flight = self.param_store, 0
            for unit in self.units:
                unit.partition()
                for p in unit.params:
                    make_partitioned(p)
                in_flight += unit.shard_numel * self.itemsize
                if in_flight > _PARTITION_WRITES_IN_FLIGHT:  # the shards written are held until they land
                    store.flush()
                    in_flight = 0
            store.flush()  # shards must be on their tier before the first fetch
        for unit in self.units:
            unit.forget_init()
        for init in inits.values():
            init.close()  # its chunks now live in this engine's stores

    # ------------------------------------------------------------ hooks

    def install_hooks(self) -> None:
        if self.policy.partition_params:
            _function_params.install()  # Note [parameters read by autograd Functions] in _function_params.py
            per_module = self.cfg.zero.fetch_units.hooks == "module"  # Note [hooks per unit] in _module_state.py
            self._hooked = set(self.states) if per_module else hooked_modules(self.model, self.states)
            for module in [m for m in self.states if m in self._hooked]:
                self._hook(module)
        elif self.dtype == torch.float16:
            self._handles.append(self.model.register_forward_pre_hook(self._pre_forward_root))
            self._handles.append(self.model.register_forward_hook(self._post_forward_root))
        if self.policy.reduce_in_backward:
            for unit in self.units:
                for p in unit.params:
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(_held_weakly(self.backward.grad_accumulated)))
        if self.activation_offload is not None:
            self._handles.extend(self.activation_offload.install(self.model))

    def _hook(self, module: nn.Module) -> None:  # always_call: Note [aborted forward]
        self._handles += [module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                          module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def end_aborted_backward(self, *, closing: bool = False) -> None:
        """End a backward that raised (Note [aborted backward] in _backward.py), asking the ranks about it or a forward
        that raised (Note [one rank failing] in _comm.py); between passes, release what a failed backward held."""
        if self.backward.aborted:
            self.backward.abort()
            comm.after_failed_pass("backward", "its loss.backward()", closing=closing)
        elif self._forward_failed:
            self._forward_failed = False
            comm.after_failed_pass("forward", "its model's forward", closing=closing)
        elif self.calls.phase is Phase.IDLE:
            self.prefetcher.release_held()

    def _pre_forward_root(self, module, args):
        self.end_aborted_backward()
        if not self.calls.in_backward:  # in backward: recomputed by activation checkpointing (Note [phases] in _phase.py)
            self.calls.begin_forward()

    def _post_forward_root(self, module, args, output):
        if self.calls.in_backward:
            return  # recomputed: its outputs' gradients come scaled from the outputs of the first forward
        self.calls.end_forward()
        if torch.is_grad_enabled():
            self.release_idle()  # the activation peak comes next, in the loss's backward
        if self.dtype == torch.float16 and torch.is_grad_enabled():
            scale_outputs(self.scaler, output)

    def _pre_forward(self, module, args, kwargs):
        if module is self.model:
            self.end_aborted_backward()
            if not self.calls.in_backward:  # Note [phases] in _phase.py
                self.calls.begin_forward()
                self.prefetcher.begin()
        if torch.is_grad_enabled():
            self.opt_store.release_idle(block=False)  # as early as it can: HF models peak in the loss, inside forward
        state = self.states[module]
        frame = Frame(state, [], handling=sys.exc_info()[1])
        self.calls.push(frame)  # first: an acquire that raises still has its frame popped
        for unit in state.units:
            unit.acquire(Hold.CALL)
            frame.held.append(unit)
        if state.units:
            self.prefetcher.on_module(state)
        if torch.is_grad_enabled() and any(not u.trainable for u in state.units):
            return self.backward.watch_inputs(frame, args, kwargs)
        return None

    def _post_forward(self, module, args, kwargs, output):
        raised = sys.exc_info()[1]  # torch calls this hook inside its `except` when forward raised
        top = self.calls.top()
        if top is None or top.state.module is not module:
            if raised is not None:  # the forward raised before this module's pre-forward hook pushed a frame
                if module is self.model and self.calls.phase is Phase.FORWARD:
                    self._abort_forward()
                return
            raise EngineError(f"forward hooks out of order at {type(module).__name__}; was a forward interrupted?")
        frame = self.calls.pop()
        for unit in frame.held:
            unit.release(Hold.CALL)
        if raised is not None and raised is not frame.handling:
            if module is self.model and not self.calls.in_backward:
                self._abort_forward()
            return  # aborted (a forward called inside an `except` block sees that block's exception)
        if torch.is_grad_enabled() and frame.state.units:
            outs = [t for t in tensors_in(output) if t.requires_grad and t.grad_fn is not None]
            if outs:
                state, token = frame.state, frame.token
                register_multi_grad_hook(outs, lambda _grad: self.backward.pre_backward(state, token), mode="any")
        if module is self.model and not self.calls.in_backward:
            self.prefetcher.end()
            self.check_same_gathers("forward")
            self._post_forward_root(module, args, output)

    def _abort_forward(self) -> None:
        """Note [aborted forward]: unused prefetches returned, no unit kept, the trace not recorded nor compared."""
        self._forward_failed = True
        try:
            self.prefetcher.abort()
        finally:
            self.ledger.take_sequence()
            self.calls.end_forward()

    def release_idle(self) -> None:
        """Note [released pages] in aio/_memory.py: recycled buffers nobody uses now give their
        pages back until they are taken again."""
        if self.gathered_buffers is not None:
            self.gathered_buffers.release_idle()
        if self.param_store is not None:
            self.param_store.release_idle()
        self.opt_store.release_idle()

    # ------------------------------------------------------------ accounting

    def after_step(self) -> None:
        """Gathered copies of persistent units are stale once the shards were updated."""
        self.prefetcher.release_held()
        for unit in self.units:
            unit.reshard_stale()

    def close(self) -> None:
        """Remove hooks and this run's swap files (also when the step's error is re-raised:
        a failed run leaves no swap files behind).

        Note [closed engines]: a model holds its engine (``_EngineHold``), closed or not, so
        a user who keeps the model after ``close`` would keep every buffer the engine made.
        ``close`` therefore lets go of them itself: recycled gathered buffers, the parameter
        cache, hand-off and staging buffers, the optimizer's buffer sets, host cache, moments
        and gradients (the master weights in host memory stay: they may be the parameters'
        own shards). Letting go of the model and the optimizer frees the rest (Note
        [parameter side objects] in _param.py)."""
        unwinding = sys.exc_info()[1]
        if isinstance(unwinding, (KeyboardInterrupt, SystemExit)):  # Note [interrupted step] in _step_gate.py
            self.gate.stop(f"the engine was closed while {type(unwinding).__name__} unwound")
        try:
            try:
                self.save_fence.finish(comm.timeout_s())  # an asynchronous save commits first; its error is raised
            finally:
                error = self.gate.settle()  # a failed step's error nobody saw yet (Note [failed step] in _step_gate.py)
                if error is not None:
                    raise error
        finally:
            try:
                self.end_aborted_backward(closing=True)  # its holds and copies in flight too
            finally:
                self._let_go()

    def _let_go(self) -> None:
        """``close``'s second half: Note [closed engines]."""
        self.prefetcher.release_held()
        for unit in self.units:
            unit.reshard_stale()  # gathered copies (persistent units) freed: their device bytes leave the budget
        self.remove_hooks()
        for store in (self.opt_store, self.param_store):
            if store is not None:
                store.close()  # Note [closing handles] in aio/_handle.py
        if self.gathered_buffers is not None:
            self.gathered_buffers.clear()
        self.swap_dirs.remove()
        if self._block_cache_done is not None:
            self._block_cache_done()  # once: a finalizer runs at most once

def _held_weakly(method):
    """A parameter hook that holds its engine weakly.

    Note [hooks the collector cannot see]: torch keeps a parameter's post-accumulate-grad hooks
    where Python's collector does not look, so a hook holding the engine (which holds the model,
    which holds the parameter) would keep all of them alive after the user let go; the model
    holds its engine instead (``_EngineHold``), where the collector sees it."""
    ref = weakref.WeakMethod(method)

    def hook(param):
        bound = ref()
        if bound is not None:
            bound(param)
    return hook


class _EngineHold:
    """A model's hold on its engine, in the model's ``__dict__`` (Note [hooks the collector
    cannot see]): the model owns its engine at every stage, as a cycle the collector frees
    with both. A copy or a pickle of the model holds no engine."""

    __slots__ = ("engine",)

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def __reduce__(self):
        return type(None), ()


_HOLD = "_infinity_engine"
_live: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # every engine not yet collected, for lookups by unit


def engine_of(model: nn.Module) -> Optional[Engine]:
    hold = model.__dict__.get(_HOLD)
    return hold.engine if hold is not None else None


def live_engines() -> List[Engine]:
    return list(_live)


def engine_of_unit(unit) -> Optional[Engine]:
    """The engine whose units include ``unit`` (None for a unit of infinity.Init)."""
    ctx = getattr(unit, "ctx", None)
    return next((e for e in live_engines() if e.ctx is ctx), None) if ctx is not None else None


def forget_engine(model: nn.Module) -> None:
    """``initialize`` failed after the engine was built: the model is not managed."""
    hold = model.__dict__.pop(_HOLD, None)
    if hold is not None:
        _live.discard(hold.engine)
        hold.engine.swap_dirs.remove()
