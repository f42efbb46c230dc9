"""The update of each unit while backward goes on, speculating that the step will not clip.

Note [speculative update]: with every state in host memory and an accelerator, the host's
cores are idle while the device runs backward, and the overlapped step (Note [overlapped step]
in _zero_optimizer.py) hides the update behind the next forward alone. Opt-in
(``zero.offload_optimizer.speculate: on`` or ``always``): on one H200 (2026-12-04, GPT-2 1.5B,
every state on cpu, unclipped) the update was already bound by host memory bandwidth (0.37 s at
4.1 G elements/s on 16 cores, about 30 bytes an element), and the undo copies below add about
as many bytes again, so the longer update ate what the overlap with backward (0.18 s) saved:
0.71 s a step speculating, 0.83 s (spread 0.58-1.06) without in the same run, 0.59 s without in
the profile phase. Since then, where the parameters have shards of their own (bf16, fp16), the
states go to a second set instead (Note [second state set] in _offload/_optimizer_store.py:
Adam reads one set and writes the other, no copy), and only the compute-dtype outputs are
copied aside (2 bytes an element); not yet measured on a GPU. A unit's update needs
its own gradients and the step's coefficient (unscaling times clipping by the global norm),
and that coefficient is known only once every gradient is in. So the update speculates:
from the moment a piece of the flat space (whole units: ``MemoryOptimizerStore.pieces``) has
all its gradients for this step landed in the store, a thread runs Adam on it with the plan
the step would have if nothing clipped and every parameter that got a gradient last step gets
one now (``SpeculativeUpdate``), from the top of the flat space down, the order backward
delivers the units. ``step()`` stops it (``take``) and checks the guess against the real
step: no inf/NaN anywhere, no clipping (the coefficient is the unscaling alone), and the
same runs with the same hyperparameters (lr, betas, eps, weight decay, each parameter's step
count) over every speculated piece. If all hold, the speculated values are exactly the ones
the step would compute (the same Adam calls over the same inputs: bit for bit) and stand; the
step updates only the pieces below them, and the step gate says the speculated ones are ready
(``StepGate.open(ready_from)``). If any fails, everything speculated is put back and the step
runs as if nothing had been speculated.

Where each state is written before the step commits: the compute-dtype values the next forward
reads (the parameter store's shards) are updated in place, after their previous values were
copied to the undo log (``UndoLog``, host memory of its own, in the plan as ``undo_log``); the
master weights and both moments go to the store's second set (Note [second state set] in
_offload/_optimizer_store.py), or,
where the fp32 parameters are the master itself (read by the next forward in place), are
updated in place after a copy to the undo log too: 12 bytes per element for the fp32 states
plus the compute dtype's in the plan either way, piece by piece. ``kept_bytes`` in the
telemetry counts what was copied aside. The gradients are only read, never marked consumed before
the commit, so a step redone after a put-back reads them as they were. Nothing else reads the
speculated values before the commit: the next forward waits for the gate, which a step opens
only after the check; a unit's range is speculated only after its last gradient of the step
landed, so this backward never fetches it again; and whoever waits for the whole step (a
save, an edit of gathered values, a load, close) or drops the gradients (``zero_grad``) has
the speculation put back first (``StepGate.attach_speculation``, ``abandon``).

A piece is ready when each unit in it has delivered its gradients ``window`` times since the
last step: the micro-batches of one step (``gradient_accumulation_steps``, then the count the
last step saw). A unit that delivers once more (a micro-batch more than expected, a late
gradient) makes the speculation invalid: it stops and is put back at the step. Each rank
speculates over its own shards and checks its own guess: its final states are exact either
way, so no rank needs the others' verdict. The undo log covers the memory stores alone:
NVMe tiers and splits update after backward as before (``speculate_update`` in _placement.py).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._log import logger
from ..errors import InvariantError
from ._param_groups import UpdatePlan, runs_in
from ._step_gate import StepGate

if TYPE_CHECKING:
    from .._offload._optimizer_store import Chunk, MemoryOptimizerStore
    from .._runtime._telemetry_counters import Counters
    from ._unit import FetchUnit


class UpdatePiece(Protocol):
    """Adam over one chunk with a plan, its compute-dtype values written out, nothing
    published. Provider: ``ZeroOptimizer._speculate_chunk``; Note [injected operations] in _seams.py."""

    def __call__(self, chunk: "Chunk", plan: UpdatePlan) -> None: ...


class OutputViews(Protocol):
    """The (start, view) pieces of [offset, offset + n) that receive the update's
    compute-dtype values. Provider: ``ZeroOptimizer._step_targets``."""

    def __call__(self, offset: int, n: int) -> List[Tuple[int, torch.Tensor]]: ...


@dataclass
class Speculated:
    """What a speculation did, taken by ``step()``: the pieces from ``ready_from`` on, with ``plan``."""

    store: "MemoryOptimizerStore"
    outputs: OutputViews
    pieces: List[Tuple[int, int]]  # updated, top down
    plan: Optional[UpdatePlan]
    invalid: Optional[str] = None  # why it cannot stand whatever the step finds
    settled: bool = field(default=False)  # committed or put back

    @property
    def ready_from(self) -> int:
        return self.pieces[-1][0] if self.pieces else self.store.total

    def stands(self, plan: UpdatePlan) -> bool:
        """Whether the real step's plan (its coefficient folded in) does over the speculated
        pieces exactly what the speculation did."""
        if self.invalid is not None or self.plan is None:
            return False
        lo, hi = self.ready_from, self.store.total
        return list(runs_in(plan, lo, hi)) == list(runs_in(self.plan, lo, hi))

    def commit(self) -> int:
        """The speculated values are the step's: their gradients are read (the next backward
        overwrites them) and the step walks the pieces below them only. Returns the pieces."""
        self.settled = True
        if self.pieces:
            self.store.speculated(self.ready_from)
        return len(self.pieces)

    def put_back(self) -> None:
        """Every speculated piece holds what it held before (the undo log), in any order."""
        if self.settled:
            return
        self.settled = True
        log = self.store.undo_log
        if log is None:
            raise InvariantError("a speculative update ran on a store without an undo log")
        for start, end in self.pieces:
            chunk = self.store.piece(start, end)
            log.put_back(start, [chunk.master, chunk.exp_avg, chunk.exp_avg_sq], self.outputs(start, end - start))


class SpeculativeUpdate:
    """The speculation of one step at a time (Note [speculative update]); the sink reports
    each unit's landed gradients (``landed``), the optimizer takes the result (``take``)."""

    def __init__(self, store: "MemoryOptimizerStore", units: Sequence["FetchUnit"], window: int, *,
                 update: UpdatePiece, outputs: OutputViews, plan: Callable[[], Optional[UpdatePlan]], gate: StepGate,
                 counters: "Counters"):
        if store.undo_log is None:
            raise InvariantError("a speculative update needs a store with an undo log")
        self._store, self._log = store, store.undo_log
        self._pieces = list(store.pieces)
        starts = [s for s, _ in self._pieces]
        self._piece_of: Dict[int, int] = {}  # unit index -> its piece
        self._unit_at: Dict[int, int] = {}  # a unit's optimizer offset -> its index
        self._need = [0] * len(self._pieces)  # units with an optimizer range in each piece
        for unit in units:
            if unit.trainable and unit.shard_numel:
                i = bisect.bisect_right(starts, unit.opt_offset) - 1
                self._piece_of[unit.index] = i
                self._unit_at[unit.opt_offset] = unit.index
                self._need[i] += 1
        self.window = max(1, window)
        self._update, self._outputs, self._plan_of, self._gate = update, outputs, plan, gate
        self._cond = threading.Condition()
        self._counts_of = counters.speculation  # the telemetry's: pieces speculated, and committed (by the step)
        self._begin()

    def _begin(self) -> None:
        self._counts: Dict[int, int] = {}  # deliveries per unit since the last step
        self._landed = [0] * len(self._pieces)
        self._events: List[list] = [[] for _ in self._pieces]  # copies into the piece still in flight
        self._done: List[Tuple[int, int]] = []
        self._plan: Optional[UpdatePlan] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._invalid: Optional[str] = None
        self._error: Optional[BaseException] = None

    # ------------------------------------------------------------ the sink's side (main thread)

    def landed(self, unit: "FetchUnit", event=None) -> None:
        """``unit``'s gradients of one micro-batch are in the store (or will be once ``event``
        has completed: a device->host copy straight into its range)."""
        i = self._piece_of.get(unit.index)
        if i is None:
            return
        count = self._counts[unit.index] = self._counts.get(unit.index, 0) + 1
        if count > self.window:
            self._invalidate(f"{unit.module_name or '<root>'} got gradients {count} times since the last step, "
                             f"{self.window} expected")
            return
        if count < self.window or self._invalid is not None:
            return
        if self._thread is None:
            self._start()
            if self._thread is None:
                return
        with self._cond:
            self._landed[i] += 1
            if event is not None:
                self._events[i].append(event)
            self._cond.notify_all()

    def _invalidate(self, why: str) -> None:
        with self._cond:
            if self._invalid is None:
                self._invalid = why
            self._cond.notify_all()

    def _start(self) -> None:
        self._plan = self._plan_of()  # on the main thread: the groups' hyperparameters as they are now
        if self._plan is None:  # the step expects to clip: nothing to gain
            self._invalid = "not speculated: the last step clipped or met inf/NaN"
            return
        backend = acc.current()  # Note [backend per thread] in _accelerator/__init__.py
        owner = threading.current_thread()
        self._thread = threading.Thread(target=self._run, args=(backend, self._plan, owner), daemon=False,
                                        name="infinity-speculative-update")
        self._thread.start()

    # ------------------------------------------------------------ its thread

    def _run(self, backend, plan: UpdatePlan, owner: threading.Thread) -> None:
        try:
            with acc.bound(backend):
                if not self._gate.wait_settled(comm.timeout_s()):  # the previous step's tail, or a failed step
                    self._invalidate("the previous step had not settled")
                    return
                for i in reversed(range(len(self._pieces))):
                    if not self._wait_for(i, owner):
                        return
                    self._update_piece(i, plan)
        except BaseException as e:  # noqa: BLE001 - put back and reported by the step (take)
            self._error = e

    def _wait_for(self, i: int, owner: threading.Thread) -> bool:
        """Until piece ``i`` has its gradients; False once asked to stop, invalid, or the
        thread that started it has ended (not a daemon: an interpreter that exits waits for
        this thread, which must not wait for gradients that never come)."""
        with self._cond:
            while not (self._stop or self._invalid is not None or self._landed[i] >= self._need[i]):
                if not owner.is_alive():
                    return False
                self._cond.wait(timeout=0.5)
            if self._stop or self._invalid is not None:
                return False
            events, self._events[i] = self._events[i], []
        for event in events:
            acc.wait_copy_to_host(event)
        return True

    def _update_piece(self, i: int, plan: UpdatePlan) -> None:
        start, end = self._pieces[i]
        chunk = self._store.piece(start, end)
        outputs = self._outputs(start, end - start)
        self._log.keep(start, [chunk.master, chunk.exp_avg, chunk.exp_avg_sq], outputs)
        self._counts_of["kept_bytes"] += (12 * (end - start) if self._log.keeps_states else 0) + sum(
            v.numel() * v.element_size() for _, v in outputs)  # copied aside: the speculation's extra traffic
        with self._cond:
            self._done.append((start, end))  # from here on it is put back, even if the update raises
        self._update(chunk, plan)

    # ------------------------------------------------------------ the step's side (main thread)

    def take(self, learn: bool = False) -> Optional[Speculated]:
        """Stop the speculation of this step and hand over what it did (None: nothing ran);
        the next backward speculates afresh, expecting (``learn``: the step takes it) as many
        micro-batches as this step had."""
        ran = self._thread is not None
        taken = self._halt()
        if learn and self._counts:
            self.window = max(self._counts.values())
        self._begin()
        return taken if ran else None

    def _halt(self) -> Speculated:
        """Stop the thread (if any) after its piece in flight; what it did, which it forgets."""
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
        invalid = self._invalid
        if self._error is not None:
            logger.warning("the speculative update failed (%s: %s); it is put back and the step updates every piece",
                           type(self._error).__name__, self._error)
            invalid = invalid or f"it raised {type(self._error).__name__}"
        self._counts_of["speculated"] += len(self._done)
        taken = Speculated(self._store, self._outputs, self._done, self._plan, invalid)
        self._done, self._thread, self._error = [], None, None
        return taken

    def before_fetch(self, start: float) -> None:
        """A unit at optimizer offset ``start`` is about to be read (the step gate asks, on the
        main thread). If it has all its gradients of the step, the speculation may have
        updated it or be about to: a micro-batch more than expected is running its forward.
        Put it back first."""
        if self._thread is None:  # the fetch path's common case: nothing speculated
            return
        index = self._unit_at.get(int(start)) if start >= 0 else None
        if index is not None and self._counts.get(index, 0) >= self.window:
            self.abandon()

    def abandon(self) -> None:
        """The gradients are dropped, or the states read as they are, or a range updated is
        fetched again: stop, put back what was updated, and speculate no more until the step
        (which still learns how many micro-batches it had: the counts stay)."""
        if self._thread is None:
            return
        self._halt().put_back()
        self._invalid = self._invalid or "abandoned"
