"""The trace-based prefetcher (paper 002 §6.2).

Note [trace and prefetch]: the first iteration records the order in which modules with
parameters run in forward and in backward (the *trace*). In later iterations, when module i
starts, the prefetcher has already submitted the NVMe reads of the units of modules
i+1 .. i+depth (bounded by ``bucket_size`` elements in flight and by free staging buffers),
starts the host->device copies of those among i+1 .. i+device_depth whose reads have
landed (a side stream on CUDA; nothing to copy without an accelerator), and launches the
all-gathers of i+1 .. i+gather_depth (bounded by ``max_live_parameters``), so I/O, copies
and collectives run while module i computes. By default depth 3, device_depth 2 and
gather_depth 1: paper 002 §6.2's NVMe->host for i+3, host->device for i+2, all-gather for i+1.
Depths count modules that have something to fetch: modules whose units all stay gathered
(below ``persistence_threshold``, e.g. layer norms) do not use up the look-ahead.

A unit used by more than one module of a pass (a tied embedding: the input embedding at
the start of forward, the output layer at its end) is released only when its last use in
the trace has passed: after each use it stays gathered (``_kept``) until the trace's next
module that uses it runs, instead of being freed and fetched again. Kept units give way to
``max_live_parameters`` and ``device_memory_limit``: a gather that would not fit releases
them first (``make_room``, the one needed last first).

At the end of a forward that autograd will come back through, the units the backward trace
starts with (typically the output layer's, used last in forward and first in backward) are
held instead of released, so backward does not fetch them again; the hold ends when backward
reaches them, when backward ends, at the next forward or at the optimizer step.

Each iteration is checked against the trace: on the first mismatch (a block skipped,
another branch, a different depth) every prefetch not yet used is abandoned (waited for and
returned: collectives stay matched across ranks), the rest of the iteration fetches on
demand, the divergence is counted, and the order this iteration took becomes the trace.
Prefetching never makes a parameter AVAILABLE early to a
computation: modules still acquire their units, which waits for what is in flight.

The prefetcher decides how far ahead and how much; the unit moves itself: it asks each unit to
``prefetch`` to a stage (and to ``keep`` what is used again, to ``cancel_prefetch`` what was not used),
and never reads or sets a unit's state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from .._runtime._tiers import StagePolicy
from ..errors import InvariantError
from ._ledger import Hold
from ._param import ParamState
from ._phase import Phase
from ._unit import Prefetched

if TYPE_CHECKING:
    from .._runtime._telemetry_counters import Counters
    from ._ledger import GatherLedger
    from ._module_state import ModuleState
    from ._phase import Calls
    from ._unit import FetchUnit


class _Pass:
    """One direction (forward or backward) of one iteration."""

    def __init__(self, phase: Phase, trace: Optional[list]):
        self.phase = phase  # the engine's phase when the pass began: the trace it records or follows
        self.trace = trace  # what to expect; None while recording the first iteration
        self.seen: List["ModuleState"] = []
        self.diverged = False
        # per trace position: {unit of that module: the position of its next use, or None}
        self.next_use: List[Dict["FetchUnit", Optional[int]]] = _next_uses(trace) if trace else []


def _next_uses(trace: list) -> list:
    out: list = [None] * len(trace)
    later: Dict["FetchUnit", int] = {}
    for pos in range(len(trace) - 1, -1, -1):
        out[pos] = {unit: later.get(unit) for unit in trace[pos].units}
        for unit in trace[pos].units:
            later[unit] = pos
    return out


class Prefetcher:
    def __init__(self, cfg, *, policy: StagePolicy, calls: "Calls", ledger: "GatherLedger[FetchUnit]",
                 counters: "Counters"):
        self._calls = calls  # the engine's phase (Note [phases] in _phase.py): forward or backward, read at begin()
        self._ledger = ledger  # gathered elements alive now, against max_live_parameters
        self._counters = counters
        self.enabled = cfg.enabled and policy.partition_params  # stages 1-2 fetch nothing
        self.depth = cfg.depth
        self.device_depth = cfg.device_depth
        self.gather_depth = cfg.gather_depth
        self.bucket = cfg.bucket_size
        self.max_live = cfg.max_live_parameters
        self.traces = {Phase.FORWARD: None, Phase.BACKWARD: None}
        self._pass: Optional[_Pass] = None  # the pass now recording or following a trace, with its phase
        self._prefetched: List["FetchUnit"] = []

    # ------------------------------------------------------------ iteration boundaries

    def begin(self) -> None:
        """A forward or a backward began (the engine's phase says which): record its trace,
        or follow the last one."""
        phase = self._calls.phase
        if phase is Phase.IDLE:
            raise InvariantError("Prefetcher.begin: the engine is IDLE; a pass begins after the phase's transition")
        self._finish_pass()
        if phase is Phase.FORWARD:
            self.release_held()
        self._pass = _Pass(phase, self.traces[phase])
        if self.enabled and self._pass.trace:
            self._ahead(0)

    def end(self) -> None:
        backward = self._pass is not None and self._pass.phase is Phase.BACKWARD
        self._finish_pass()
        if backward:
            self.release_held()
        self._pass = None

    def abort(self) -> None:
        """Note [aborted forward] in _engine.py: the forward raised; its pass ends without
        recording what it saw as the trace, and nothing stays held for a backward."""
        self._release_kept()
        self._cancel_unused()
        self._pass = None
        self.release_held()

    def release_held(self) -> None:
        self._release_kept()
        for unit in self._ledger.held_for(Hold.INTO_BACKWARD):
            unit.release(Hold.INTO_BACKWARD)

    def _release_kept(self) -> None:
        for unit in self._ledger.held_for(Hold.KEPT):
            unit.release(Hold.KEPT)

    def make_room(self, incoming: "FetchUnit") -> None:
        """``incoming`` is about to be gathered: release kept units, the one needed last
        first, until it fits within ``max_live_parameters`` and the device budget."""
        kept = self._ledger.kept_until()
        for unit in sorted(kept, key=kept.get, reverse=True):
            if self._ledger.fits(incoming, self.max_live):
                return
            unit.release(Hold.KEPT)

    def _keep_until_next_use(self, pos: int) -> None:
        """Module ``pos`` of the trace holds its units: release those kept for it, and keep
        those used again later in this pass (Note [trace and prefetch])."""
        for unit, at in self._ledger.kept_until().items():
            if at == pos:
                unit.release(Hold.KEPT)
        for unit, at in self._pass.next_use[pos].items():
            if at is not None and not self._ledger.holds(unit, Hold.KEPT):
                unit.keep(Hold.KEPT, until=at)

    def _hold_for_backward(self) -> None:
        """The last forward module runs: keep what backward starts with gathered."""
        trace = self.traces[Phase.BACKWARD]
        if not trace or not torch.is_grad_enabled():
            return
        for state in trace[: max(1, self.gather_depth)]:
            for unit in state.units:
                if not self._ledger.holds(unit, Hold.INTO_BACKWARD):
                    unit.keep(Hold.INTO_BACKWARD)

    def _finish_pass(self) -> None:
        if self._pass is None:
            return
        p = self._pass
        if p.trace is not None and (p.diverged or len(p.seen) != len(p.trace)) and p.seen:
            if not p.diverged:
                self._counters.divergences += 1  # a shorter pass (early exit)
        if p.seen and (p.trace is None or p.seen != p.trace):
            self.traces[p.phase] = list(p.seen)
        self._release_kept()
        self._cancel_unused()

    # ------------------------------------------------------------ per module

    def on_module(self, state: "ModuleState") -> None:
        """``state``'s units were just acquired: check the trace, then prefetch ahead."""
        p = self._pass
        if p is None:
            return
        pos = len(p.seen)
        p.seen.append(state)
        if p.phase is Phase.BACKWARD:
            for unit in self._ledger.held_for(Hold.INTO_BACKWARD):
                if unit in state.units:  # acquired by its module now
                    unit.release(Hold.INTO_BACKWARD)
        if p.trace is None or p.diverged:
            return
        if pos >= len(p.trace) or p.trace[pos] is not state:
            p.diverged = True
            self._counters.divergences += 1
            self._release_kept()
            self._cancel_unused()
            if p.phase is Phase.BACKWARD:
                self.release_held()  # backward went another way: do not keep them through it
            return
        if self.enabled:
            self._keep_until_next_use(pos)
            self._ahead(pos + 1)
            if p.phase is Phase.FORWARD and pos == len(p.trace) - 1:
                self._hold_for_backward()

    def _window(self, nxt: int, depth: int) -> list:
        """The next ``depth`` modules of the trace from ``nxt`` that have a unit to fetch, each
        counted once: the submodules of a block hold the block's units too (Note [fetch unit
        grouping] in _unit_plan.py), and those of the module running now are not ahead."""
        trace = self._pass.trace
        seen = set(trace[nxt - 1].units) if nxt > 0 else set()
        out = []
        for state in trace[nxt:]:
            if len(out) >= depth:
                break
            new = [u for u in state.units if u.partitioned and not u.persistent and u not in seen]
            if new:
                out.append(state)
                seen.update(new)
        return out

    def _ahead(self, nxt: int) -> None:
        window = self._window(nxt, self.depth)  # device_depth <= depth and gather_depth <= device_depth (config)
        try:
            self._prefetch(window)
        except BaseException:  # out of device memory: what the window moved is abandoned with the pass
            self._prefetched += [u for s in window for u in s.units if not u.idle and u not in self._prefetched]
            raise  # (Note [aborted forward] in _engine.py)

    def _prefetch(self, window: list) -> None:
        self._read_ahead(window)
        for state in window[: self.device_depth]:  # copies of the shards whose reads have landed
            for unit in state.units:
                unit.prefetch(ParamState.DEVICE, read=False)
        for state in window[: self.gather_depth]:  # all-gathers, never past max_live_parameters or device_memory_limit
            for unit in state.units:
                if not self._ledger.fits(unit, self.max_live):
                    continue
                if unit.prefetch(ParamState.GATHERING, block=True) is Prefetched.NOW and unit not in self._prefetched:
                    self._prefetched.append(unit)
        self._prefetched = [u for u in self._prefetched if not u.idle]

    def _read_ahead(self, window: list) -> None:
        """Reads in trace order, within bucket_size elements in flight: the first unit that does
        not fit (or finds no staging buffer) ends them for this window, so that no later, smaller
        unit is read ahead of it; the next module's window starts from it."""
        in_flight = sum(u.staged_numel for u in self._prefetched)
        for state in window:
            for unit in state.units:
                done = unit.prefetch(ParamState.HOST, room=self.bucket - in_flight if in_flight else None)
                if done is Prefetched.SHORT:
                    return
                if done is Prefetched.NOW:
                    in_flight += unit.shard_numel
                    self._prefetched.append(unit)

    def _cancel_unused(self) -> None:
        for unit in self._prefetched:
            if not unit.refs:
                unit.cancel_prefetch()
        self._prefetched = []
