"""The step in flight: which part of the optimizer's flat space holds this step's values.

Note [step gate]: the overlapped step (Note [overlapped step] in _zero_optimizer.py) updates the
flat fp32 space chunk by chunk on a background thread while the next forward runs. The gate
is the one place that knows how far it got: the step ``publish``es the offset below which
every shard is updated, a fetch ``wait``s until its unit's range is below it, and
``join``/``settle`` wait for the whole step. The step owns the gate (it alone opens, advances
and closes it); the fetch units and the engine only consult it, so they never see the
optimizer. ``initialize`` builds it before either.

Note [failed step]: an exception inside the optimizer step (an I/O fault, an interrupt, any
error, on the main thread or on the overlapped step's) ends it in one of two ways, told
apart by whether the update had begun changing a state (Adam had started on a chunk of the
flat space), a write had failed or a request timed out, still in flight (a file may no longer
hold what the engine believes it holds), or other ranks took part (one rank cannot know that
the others' steps failed too, so none undoes its own alone):
- neither: every state holds its value BEFORE the step. The step is undone: the step counts,
  the step number and the loss scale are put back; the sink and the stores drop the step's
  gradients and forget the reads in flight (``OptimizerStore.abandon_update``; stage 1's
  ``.grad`` stays, as in plain PyTorch). The batch is skipped, as plain PyTorch skips one whose
  step raised and whose gradients ``zero_grad`` drops. The gate is SETTLED again and the
  engine trains on.
- otherwise the states are between two steps (chunks below the failure hold the new values,
  those above the old ones, a chunk whose write failed may hold neither); finishing the step
  would need each chunk's new values kept until its writes land, which the stores do not do.
  The gate turns FAILED and nothing reads or writes the states any more: every fetch (so
  every forward at stage 3, and ``GatheredParameters``), ``step()`` and save refuses with an
  ``EngineError`` that names the failure, until ``infinity.load_checkpoint`` has drained the
  failed step's I/O, rewritten every state and forgotten what the step left half done (the
  parameter store's units still filling), and cleared the gate; ``close`` works.
The error itself is raised once, where it happened (``step()``) or, on the step's thread, by
the next ``wait`` or ``join`` on the main thread.

Note [interrupted step]: a signal's exception (KeyboardInterrupt from SIGINT, SystemExit from
the train job's SIGTERM handler) lands on the main thread only, anywhere, while the rest of
an overlapped step may be running on its own thread with reads and writes in flight. That
thread is not a daemon (a daemon would be killed mid-I/O while the interpreter finalizes,
with native handles still in use: an abort at exit), so whatever ends the process waits for
it, and the whole tail of a large model's step is minutes of I/O. So the step stops at its
next chunk (``StepStopped``; the chunks before it updated, the rest not: FAILED, Note [failed
step]) when (a) the thread that started it has ended: the interpreter is shutting down after
an exception left the main thread (its ``threading`` shutdown marks that thread stopped before
it joins the others); (b) a join of the step (``wait_step``, the next ``step()``, ``close``) is
interrupted: the thread is asked to stop and joined again, so nothing is torn down under it;
(c) ``close`` runs while a KeyboardInterrupt or SystemExit unwinds (a ``finally:
infinity.close(model)``), since nothing reads the states of an engine being closed. The
stopped step drains its own I/O before its thread ends. A step asked to stop is no failure
``close`` reports; a later ``step()`` or fetch refuses, as after any failed step, until a
checkpoint is loaded. A wait of a fetch on the step (``wait``) is interruptible as it is:
the exception leaves the forward (Note [aborted forward] in _engine.py) and the step goes on.
The other long waits of the main thread return to Python at least every half second so that
the exception lands there too: a collective's (Note [one rank failing] in _comm.py) and an aio
wait's (``AsyncIO._wait_in_slices`` in aio/_handle.py).
"""
from __future__ import annotations

import contextlib
import enum
import math
import threading
from typing import Callable, ContextManager, Optional, Protocol

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from ..errors import EngineError, InvariantError, WaitTimeout


class StepStopped(EngineError):
    """The overlapped step was asked to stop before its end (Note [interrupted step])."""


class GateState(enum.Enum):
    SETTLED = "settled"  # no step in flight: every offset holds the latest step's values
    OPEN = "open"  # a step in flight: the offsets below the published one hold its values
    FAILED = "failed"  # a step failed after it changed a state: Note [failed step]


class TimeStall(Protocol):
    """A context manager that counts the time it is held as stall time of ``stage`` in the
    telemetry. Provider: ``Counters.blocked`` (_runtime/_telemetry_counters.py); Note
    [injected operations] in _seams.py."""

    def __call__(self, stage: str, unit: str = "") -> ContextManager: ...


class Speculation(Protocol):
    """What the gate asks of a speculative update (``SpeculativeUpdate`` in
    _speculative_update.py; Note [injected operations] in _seams.py)."""

    def abandon(self) -> None: ...  # put back whatever it updated; no more this step

    def before_fetch(self, start: float) -> None: ...  # a unit at ``start`` is about to be read


class StepGate:
    def __init__(self, rank: int, blocked: TimeStall):
        self._rank = rank
        self._blocked = blocked  # counters.blocked: the time a wait stalls is telemetry's optimizer_io
        self._cond = threading.Condition()
        self._state = GateState.SETTLED
        self._upto = math.inf  # offsets below this hold the latest step's values
        self._ready_from = math.inf  # and those from this one on: Note [speculative update] in _speculative_update.py
        self._speculation: Optional[Speculation] = None  # Note [speculative update] in _speculative_update.py
        self._error: Optional[BaseException] = None  # a failure the main thread has not seen yet
        self._failure: Optional[BaseException] = None  # FAILED: what ended the step
        self._thread: Optional[threading.Thread] = None
        self._owner: Optional[threading.Thread] = None  # the thread that started the step in flight
        self._stop_reason: Optional[str] = None  # why the step in flight was asked to stop: Note [interrupted step]
        self._waiting = 0  # threads blocked on the step now

    # ------------------------------------------------------------ the step's side

    def open(self, ready_from: float = math.inf) -> None:
        """A step begins: nothing of the flat space is updated yet, but what lies from
        ``ready_from`` on (updated while backward ran: Note [speculative update] in
        _speculative_update.py)."""
        with self._cond:
            self._expect(GateState.SETTLED, "open")
            self._state, self._upto, self._ready_from = GateState.OPEN, 0, ready_from

    def publish(self, upto: float) -> None:  # math.inf: every offset
        with self._cond:
            self._upto = upto
            self._cond.notify_all()

    def close(self) -> None:
        """The step is done: every offset holds its values."""
        with self._cond:
            if self._state is GateState.OPEN:
                self._state = GateState.SETTLED
            self._ready_from = math.inf
        self.publish(math.inf)

    def fail(self, error: BaseException, *, changed: bool = True, raised: bool = False) -> None:
        """The step failed (Note [failed step]). ``changed``: it changed a state, and the gate
        turns FAILED; else it is SETTLED with every offset at the previous step's values.
        ``raised``: the error reached the caller already; else the next wait or join raises it."""
        with self._cond:
            if changed:
                self._state, self._failure = GateState.FAILED, error
            elif self._state is GateState.OPEN:
                self._state = GateState.SETTLED
            self._error = None if raised else error
            self._upto = math.inf
            self._cond.notify_all()

    def clear(self) -> None:
        """FAILED -> SETTLED: every state was rewritten (a checkpoint was loaded)."""
        with self._cond:
            if self._state is GateState.FAILED:
                self._state, self._failure = GateState.SETTLED, None

    def run_in_background(self, target: Callable[[], None],
                          changed: Callable[[BaseException], bool] = lambda e: True) -> None:
        """Run the rest of the step on a thread; if it raises, ``changed(error)`` undoes what it
        can and says whether a state changed (Note [failed step]); the error is re-raised by
        the next wait. Not a daemon: an interpreter that exits right after step() first lets
        the update land."""
        backend = acc.current()  # Note [backend per thread] in _accelerator/__init__.py
        self._owner, self._stop_reason = threading.current_thread(), None

        def run():
            try:
                with acc.bound(backend):
                    target()
                self.close()
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at the next wait
                self.fail(e, changed=_changed(changed, e))

        self._thread = threading.Thread(target=run, name="infinity-optimizer-step", daemon=False)
        self._thread.start()

    def stop(self, reason: str) -> None:
        """Ask the step in flight, if any, to end at its next chunk (Note [interrupted step])."""
        with self._cond:
            if self.running:
                self._stop_reason = reason

    def check_stop(self) -> None:
        """On the step's thread, before each chunk: raise ``StepStopped`` once the step was
        asked to stop or the thread that started it has ended (Note [interrupted step])."""
        reason = self._stop_reason
        if reason is None and self._owner is not None and not self._owner.is_alive():
            reason = f"the thread that started it ({self._owner.name}) has ended"
        if reason is not None:
            raise StepStopped(f"rank {self._rank}: the optimizer step was stopped before its end: {reason}")

    # ------------------------------------------------------------ the readers' side

    @property
    def state(self) -> GateState:
        return self._state

    @property
    def waited_on(self) -> bool:
        """Whether a thread is blocked on the step now: the step is the critical path."""
        return self._waiting > 0

    @contextlib.contextmanager
    def _waiter(self):
        with self._cond:  # reentrant: ``wait`` holds it already
            self._waiting += 1
        try:
            yield
        finally:
            with self._cond:
                self._waiting -= 1

    def wait(self, end: int, *, start: float = -1, block: bool = True, what: str = "", unit: str = "") -> bool:
        """True once the flat range [start, end) holds this step's values; False when
        ``block`` is off and it does not yet. Raises a failed step's error (Note [failed step])."""
        def ready() -> bool:
            return self._upto >= end or start >= self._ready_from

        if self._speculation is not None:
            self._speculation.before_fetch(start)

        if ready() and self._state is not GateState.FAILED and self._error is None:
            return True
        with self._cond:
            if not block and self._state is GateState.OPEN:
                return ready()
            with self._blocked("optimizer_io", unit), self._waiter():
                ok = self._cond.wait_for(ready, timeout=comm.timeout_s())
            self._raise_failure()
            if not ok:
                raise WaitTimeout(f"rank {self._rank}: waited {comm.timeout_s():.0f}s for the optimizer step to "
                                  f"update {what or 'a parameter shard'}")
        return True

    def attach_speculation(self, speculation: "Speculation") -> None:
        """Whoever waits for the whole step (a save, an edit, a load, close) first has a
        speculative update put back, and so does a fetch of a range it may have updated: the
        states hold the latest step's values, not this backward's guess (Note [speculative
        update] in _speculative_update.py)."""
        self._speculation = speculation

    def _abandon_speculation(self) -> None:
        if self._speculation is not None:
            self._speculation.abandon()

    def wait_settled(self, timeout: float) -> bool:
        """On another thread than the step's: True once no step is in flight, False on a
        timeout or after a failed step (Note [speculative update] in _speculative_update.py)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state is not GateState.OPEN, timeout=timeout)
            return self._state is GateState.SETTLED and self._error is None

    def join(self) -> None:
        """Wait for the whole step in flight (if any); raise a failed step's error, or refuse
        after one that changed a state (Note [failed step])."""
        self._abandon_speculation()
        self._join_thread()
        with self._cond:
            self._raise_failure()

    def settle(self) -> Optional[BaseException]:
        """Wait for the whole step in flight (if any); the error of a failed one that nobody
        saw yet, returned, not raised (``close``, a checkpoint load)."""
        self._abandon_speculation()
        self._join_thread()
        with self._cond:
            error, self._error = self._error, None
        return None if isinstance(error, StepStopped) else error  # asked for: Note [interrupted step]

    def _join_thread(self) -> None:
        if self._thread is None:
            return
        with self._blocked("optimizer_io"), self._waiter():
            try:
                self._thread.join()
            except BaseException as interrupt:  # a signal's exception: Note [interrupted step]
                self.stop(f"{type(interrupt).__name__} while rank {self._rank} waited for it")
                self._thread.join(timeout=comm.timeout_s())  # one chunk, its I/O drained
                raise
        self._thread = None

    def _raise_failure(self) -> None:
        """Under ``_cond``: the failure not seen yet, once; then FAILED's refusal."""
        error, self._error = self._error, None
        if error is not None:
            raise error
        if self._state is GateState.FAILED:
            raise EngineError(
                f"rank {self._rank}: the optimizer step failed ({type(self._failure).__name__}: {self._failure}) after "
                f"it had updated some of the model's states and not others, so they are not used any more. Load a "
                f"checkpoint (infinity.load_checkpoint) to go on, or close the engine") from self._failure

    def _expect(self, state: GateState, transition: str) -> None:
        if self._state is not state:
            self._raise_failure()
            raise InvariantError(f"step gate: {transition} while {self._state.name}, expected {state.name}")

    @property
    def running(self) -> bool:
        """The rest of a step is running on its thread now."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def updated_upto(self) -> float:
        """The flat offset below which the latest step's values are in place (inf: all)."""
        return self._upto


def _changed(changed: Callable[[BaseException], bool], error: BaseException) -> bool:
    try:
        return changed(error)
    except BaseException:  # noqa: BLE001 - undoing failed too: the states cannot be vouched for
        return True
