"""The engine's backward hooks: which modules hold their units through backward, and when
each hold ends (Note [hook protocol] in _engine.py; each module's progress is its own
``ModuleState``'s, Note [backward progress] in _module_state.py).

Note [hold until the input gradients]: a module's units stay gathered through its backward
until the gradients of its trainable parameters have arrived; a module with a frozen unit
(LoRA's base layers, BitFit's weights) has nothing to wait for there, yet its weights are
needed to compute the gradients of its inputs. So each call of such a module routes the
inputs that need a gradient through an identity autograd function (``_InputGrads``, as
FSDP2 does for its post-backward) tagged with a token of that call; the output hook of the
same call passes the token to the pre-backward, and the hold also waits until the
identity's backward has run, i.e. until backward has computed this call's input gradients.
Tokens are per call, so a module called twice waits for both calls, a forward without a
backward leaves nothing behind, and a non-reentrant recomputation (whose outputs backward
never reaches) waits for nothing; with reentrant checkpointing the recomputation inside
backward is the call whose graph backward runs.

Note [used again in one backward]: within one run of the autograd graph, a parameter's
gradient is accumulated once, after every use of it has been differentiated, so a module's
hold ends with its units' gradients. Reentrant activation checkpointing runs one inner
backward per checkpoint: a module shared by two checkpointed blocks (or a parameter used in
both) is differentiated, and its gradient accumulated, once per inner backward. So a module
whose hold already ended (DONE) is held again when backward reaches it again, its units wait
for another accumulation; gradients that arrive after the unit's were handed to the reducer
stay in ``.grad`` and are reduced at the end of backward (Note [bucket plan] in _reduce.py),
as are those of a unit only some of whose parameters got one.

Note [aborted backward]: a backward can end by an exception (an autograd Function or a hook
that raises, out of memory, an interrupt), as a forward can (Note [aborted forward] in
_engine.py). Autograd then drops the callback queued at its start (``_end``) without calling
it, so nothing ends the backward: the phase stays BACKWARD, the modules AWAITING keep their units
gathered, the reducer keeps its partial buckets and the sink its device->host copies in
flight. The engine ends it at the next call made outside any backward while the phase is
still BACKWARD (``aborted``: no autograd graph task runs on this thread, which tells it from
a recomputation inside a live backward): the model's next forward, the optimizer's
``zero_grad`` and ``step``, and ``close``. ``abort`` then, launching no collective (another
rank's backward may have ended otherwise):
- ends the holds of the modules still AWAITING (their units are released) and resets every
  module's progress; frames a recomputation left behind are released (``Calls.abort_backward``,
  BACKWARD -> IDLE);
- waits for the reduce-scatters in flight and drops them, the partial buckets and this
  backward's sets of units (``GradReducer.abandon``);
- lands the device->host copies in flight (``GradSink.backward_aborted``);
- drops this backward's sequence of all-gathers unchecked and ends the prefetcher's pass
  (prefetches nobody used are waited for and returned).
The failed micro-batch's gradients are then partial: those reduced before the exception are
in the optimizer store, those of units not reduced yet in ``.grad``, those of the dropped
buckets nowhere. The sink marks them PARTIAL: ``step()`` refuses them (plain PyTorch would
apply its partial ``.grad``; part of it is gone here), and ``zero_grad()`` discards every
gradient since the last step (the store's ranges, ``.grad``, copies still landing, which
parameters got one, the losses noted) and the mark. The next steps are then those of plain
PyTorch that skipped the batch. Stage 1 reduces nothing in backward and runs no backward
hook: its partial gradients are the ``.grad`` that ``zero_grad`` drops. With more than one rank
the others wait in collectives of that backward that this rank never issues: it cannot train
on, and the job stops on every rank (Note [one rank failing] in _comm.py).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple, cast

import torch
from torch import nn

from ..errors import InvariantError
from ._ledger import Hold
from ._module_state import ModuleState
from ._param import info_of
from ._seams import Action, CheckSameGathers

if TYPE_CHECKING:
    from .._runtime._telemetry_counters import Counters
    from ._ledger import GatherLedger
    from ._phase import Calls, Frame
    from ._prefetch import Prefetcher
    from ._reduce import GradReducer
    from ._unit import FetchUnit


class _InputGrads(torch.autograd.Function):
    """Identity on a module call's inputs; its backward runs once backward has computed the
    gradients of those inputs, i.e. once the call's own backward is done."""

    @staticmethod
    def forward(ctx, hooks, token, *tensors):
        ctx.hooks, ctx.token = hooks, token
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hooks.inputs_done(ctx.token)
        return (None, None) + grads


def _unit_of(param: nn.Parameter) -> "FetchUnit":
    info = info_of(param)
    if info is None:
        raise InvariantError("a gradient hook ran for a parameter no fetch unit owns")
    return cast("FetchUnit", info.unit)  # the engine hooks only its units' parameters


def _needs_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()


class BackwardHooks:
    """What the engine's backward hooks do: a module's pre-backward holds it, a parameter's
    post-accumulate-grad hook and a call's ``_InputGrads`` end the holds that waited for
    them, and the callback queued at the start of backward ends it. One per engine; it
    holds no reference to the engine."""

    def __init__(self, units: List["FetchUnit"], states: List[ModuleState], *, calls: "Calls",
                 prefetcher: "Prefetcher", reducer: Optional["GradReducer"], ledger: "GatherLedger[FetchUnit]",
                 counters: "Counters", check_same_gathers: CheckSameGathers, on_abort: Action = lambda: None):
        self._units = units
        self._states = states
        self._calls = calls  # Note [phases] in _phase.py: the first hook of a backward begins it
        self._prefetcher = prefetcher
        self._reducer = reducer  # stages 2 and 3: a unit's gradients are reduced as soon as they are in
        self._ledger = ledger
        self._counters = counters
        self._check_same_gathers = check_same_gathers  # Note [same gathers on every rank] in _same_gathers.py
        self._on_abort = on_abort  # the sink: Note [aborted backward]
        self._awaiting: Dict[ModuleState, None] = {}  # the modules AWAITING now, in the order backward reached them
        self._tokens = itertools.count()  # one per module call whose input gradients a hold may wait for
        self._inputs_seen: Set[int] = set()  # tokens whose input gradients this backward has computed

    # ------------------------------------------------------------ forward: what backward will wait for

    def watch_inputs(self, frame: "Frame", args, kwargs):
        """Note [hold until the input gradients]: route this call's inputs that need a
        gradient through ``_InputGrads``; None when there are none."""
        slots: List[Tuple[Optional[int], Optional[str]]] = [(i, None) for i, a in enumerate(args) if _needs_grad(a)]
        slots += [(None, k) for k, v in kwargs.items() if _needs_grad(v)]
        if not slots:
            return None
        frame.token = next(self._tokens)
        tensors = [args[i] if k is None else kwargs[k] for i, k in slots]
        outs = _InputGrads.apply(self, frame.token, *tensors)
        args, kwargs = list(args), dict(kwargs)
        for (i, k), t in zip(slots, outs):
            if k is None:
                args[i] = t
            else:
                kwargs[k] = t
        return tuple(args), kwargs

    # ------------------------------------------------------------ the hooks

    def pre_backward(self, state: ModuleState, token: Optional[int] = None) -> None:
        """Autograd reached an output of a call of ``state``'s module (``token``: the call)."""
        self._begin()
        calls = {token} if token is not None and token not in self._inputs_seen else set()
        if state in self._awaiting:
            state.await_calls(calls)  # already held: a module called twice in forward
            return
        state.hold(calls)
        self._awaiting[state] = None
        self._prefetcher.on_module(state)
        if not state.waiting:
            self._end_hold(state)

    def grad_accumulated(self, param: nn.Parameter) -> None:
        """A parameter's post-accumulate-grad hook."""
        self._begin()
        unit = _unit_of(param)
        if unit.grad_arrived():
            if self._reducer is not None:
                self._reducer.add(unit)
            self._arrived(unit)

    def inputs_done(self, token: int) -> None:
        """Backward computed the input gradients of the call ``token``."""
        self._inputs_seen.add(token)
        self._arrived(token)

    # ------------------------------------------------------------ begin and end

    def _begin(self) -> None:
        # begun by an earlier hook; an overlapped step may still run: Note [step gate] in _step_gate.py
        if self._calls.in_backward:
            return
        self._calls.begin_backward()
        for unit in self._units:
            unit.expect_grads()
        torch.autograd.Variable._execution_engine.queue_callback(self._end)
        self._prefetcher.begin()

    def _arrived(self, awaited) -> None:
        """A unit's gradients or a call's input gradients are in: end the holds that waited
        only for them."""
        for state in [s for s in self._awaiting if s.awaits(awaited)]:
            if state.arrived(awaited):
                self._end_hold(state)

    def _end_hold(self, state: ModuleState) -> None:
        state.end_hold()  # a later pre-backward in this backward holds again: Note [used again in one backward]
        del self._awaiting[state]

    def _end(self) -> None:
        if self._reducer is not None:
            for unit in self._units:  # gradients no hook handed over: a unit used in part, late accumulations
                if any(p.grad is not None for p in unit.params):
                    unit.grads_handed_over()
                    self._reducer.add(unit)
            with self._counters.blocked("reduce_scatter"):
                self._reducer.finish()  # units without gradients join as zeros: Note [bucket plan] in _reduce.py
        for state in list(self._awaiting):
            self._end_hold(state)
        for state in self._states:
            state.reset()
        self._ledger.check_none(Hold.BACKWARD, where="backward")
        self._inputs_seen.clear()
        self._calls.end_backward()
        self._prefetcher.end()
        self._check_same_gathers("backward")

    # ------------------------------------------------------------ a backward that raised

    @property
    def aborted(self) -> bool:
        """Note [aborted backward]: the phase is BACKWARD, yet no backward runs on this thread."""
        return self._calls.in_backward and torch._C._current_graph_task_id() == -1

    def abort(self) -> None:
        """Note [aborted backward]: end a backward that ended by an exception."""
        for state in list(self._awaiting):
            self._end_hold(state)
        for state in self._states:
            state.reset()
        self._inputs_seen.clear()
        try:
            if self._reducer is not None:
                self._reducer.abandon()
        finally:
            self._ledger.take_sequence()  # not compared: the other ranks' backwards may have ended otherwise
            self._calls.abort_backward()
            self._prefetcher.end()
            self._on_abort()
        self._ledger.check_none(Hold.BACKWARD, where="an aborted backward")
