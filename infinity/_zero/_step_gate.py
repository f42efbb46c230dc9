"""The step in flight: which part of the optimizer's flat space holds this step's values.

Note [step gate]: the overlapped step (Note [overlapped step] in _zero_optimizer.py) updates the
flat fp32 space chunk by chunk on a background thread while the next forward runs. The gate
is the one place that knows how far it got: the step ``publish``es the offset below which
every shard is updated, a fetch ``wait``s until its unit's range is below it, and
``join``/``settle`` wait for the whole step. The step owns the gate (it alone opens, advances
and closes it); the fetch units and the engine only consult it, so they never see the
optimizer. ``initialize`` builds it before either.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, ContextManager, Optional

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from ..errors import WaitTimeout


class StepGate:
    def __init__(self, rank: int, blocked: Callable[[str], ContextManager]):
        self._rank = rank
        self._blocked = blocked  # counters.blocked: the time a wait stalls is telemetry's optimizer_io
        self._cond = threading.Condition()
        self._upto = math.inf  # offsets below this hold the latest step's values
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._waiting = 0  # threads blocked on the step now

    # ------------------------------------------------------------ the step's side

    def open(self) -> None:
        """A step begins: nothing of the flat space is updated yet."""
        with self._cond:
            self._upto = 0

    def publish(self, upto: float) -> None:  # math.inf: every offset
        with self._cond:
            self._upto = upto
            self._cond.notify_all()

    def close(self) -> None:
        """The step is done: every offset holds its values."""
        self.publish(math.inf)

    def fail(self, error: BaseException) -> None:
        """The step failed: every waiter raises ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def run_in_background(self, target: Callable[[], None]) -> None:
        """Run the rest of the step on a thread; its exception is re-raised by the next wait.
        Not a daemon: an interpreter that exits right after step() first lets the update land."""
        backend = acc.current()  # Note [backend per thread] in _accelerator/__init__.py

        def run():
            try:
                with acc.bound(backend):
                    target()
                self.close()
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at the next wait
                self.fail(e)

        self._thread = threading.Thread(target=run, name="infinity-optimizer-step", daemon=False)
        self._thread.start()

    # ------------------------------------------------------------ the readers' side

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

    def wait(self, end: int, *, block: bool = True, what: str = "") -> bool:
        """True once the flat range below ``end`` holds this step's values; False when
        ``block`` is off and it does not yet."""
        if self._upto >= end and self._error is None:
            return True
        with self._cond:
            if not block and self._error is None:
                return self._upto >= end
            with self._blocked("optimizer_io"), self._waiter():
                ok = self._cond.wait_for(lambda: self._upto >= end or self._error is not None,
                                         timeout=comm.DEFAULT_TIMEOUT_S)
            if self._error is not None:
                raise self._error
            if not ok:
                raise WaitTimeout(f"rank {self._rank}: waited {comm.DEFAULT_TIMEOUT_S:.0f}s for the optimizer step to "
                                  f"update {what or 'a parameter shard'}")
        return True

    def join(self) -> None:
        """Wait for the whole step in flight (if any); re-raise its error."""
        if self._thread is not None:
            with self._blocked("optimizer_io"), self._waiter():
                self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    @property
    def running(self) -> bool:
        """The rest of a step is running on its thread now."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def updated_upto(self) -> float:
        """The flat offset below which the latest step's values are in place (inf: all)."""
        return self._upto
