"""Where training is: the phase of the iteration and the stack of module calls in forward.

Note [phases]: the engine is in one ``Phase`` at a time. ``begin_forward`` (the root module's
pre-forward hook) and ``end_forward`` (its post-forward) bracket a forward; ``begin_backward``
(the first pre-backward or gradient hook of a backward) and ``end_backward`` (the autograd
callback queued by ``begin_backward``) bracket a backward; a backward that raised never runs
that callback, and ``abort_backward`` ends it instead (Note [aborted backward] in _backward.py). The optimizer step runs between
them, outside both: an overlapped step may still run on its thread during the next forward
(Note [step gate] in _step_gate.py), which is why the step is not a phase of this object.
A forward inside a backward (reentrant activation checkpointing recomputes each block in
backward, or the whole model) pushes frames while the phase stays BACKWARD: there the root's
hooks begin and end nothing, as FSDP2's do in ``PRE_BACKWARD``. Each transition raises when
called in a phase it does not leave (``InvariantError``), so the engine's hooks ask the
phase (``in_backward``) rather than calling a transition that would do nothing. Each module's
own progress through backward is its ``ModuleState``'s (Note [backward progress] in
_module_state.py).

A parameter touched while released reaches ``Calls.on_unavailable`` (through its fetch
unit's context): inside a module call it is gathered and held until that call's
post-forward, and recorded as an external parameter of the module; anywhere else it is an
error that says how to gather it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch

from .._runtime._log import logger
from ..errors import InvariantError
from ._ledger import Hold
from ._param import ParameterNotAvailableError, not_available_message, run_available

if TYPE_CHECKING:
    from ._module_state import ModuleState
    from ._unit import FetchUnit


class Phase(enum.Enum):
    IDLE = "idle"  # between iterations, or in the optimizer step
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class Frame:
    """One module call in progress: the units it holds until its post-forward."""

    state: ModuleState
    held: List["FetchUnit"]
    handling: Optional[BaseException] = None  # the exception being handled where the forward was called
    token: Optional[int] = None  # this call's input gradients: Note [hold until the input gradients] in _backward.py


class Calls:
    """The phase and the stack of module calls (Note [phases])."""

    def __init__(self):
        self.phase = Phase.IDLE
        self._frames: List[Frame] = []

    # ------------------------------------------------------------ phase transitions

    def begin_forward(self) -> None:
        """IDLE -> FORWARD, at the root module's pre-forward. From FORWARD: the last forward
        raised, so its root post-forward ended nothing (Note [aborted forward] in _engine.py),
        or was interrupted before any post-forward hook ran (torch runs ``always_call`` hooks
        for an ``Exception``, not a ``KeyboardInterrupt``): frames left behind are released
        first. Not in BACKWARD: a forward there is a recomputation inside backward."""
        if self.phase is Phase.BACKWARD:
            raise InvariantError("begin_forward: the engine is in BACKWARD; a forward inside backward (activation "
                                 "checkpointing's recomputation) runs its calls without beginning a forward")
        self.reset()
        self.phase = Phase.FORWARD

    def end_forward(self) -> None:
        """FORWARD -> IDLE, at the root module's post-forward."""
        self._expect(Phase.FORWARD, "end_forward")
        self.phase = Phase.IDLE

    def begin_backward(self) -> None:
        """IDLE or FORWARD -> BACKWARD, at the first backward hook (FORWARD: after a forward
        that raised). Its caller queues ``end_backward``."""
        if self.phase is Phase.BACKWARD:
            raise InvariantError("begin_backward: the engine is in BACKWARD already")
        self.phase = Phase.BACKWARD

    def end_backward(self) -> None:
        """BACKWARD -> IDLE, at the autograd callback queued by the first backward hook."""
        self._expect(Phase.BACKWARD, "end_backward")
        self.phase = Phase.IDLE

    def abort_backward(self) -> None:
        """BACKWARD -> IDLE for a backward that ended by an exception, whose ``end_backward``
        never ran (Note [aborted backward] in _backward.py); frames a recomputation inside it
        left behind are released."""
        self._expect(Phase.BACKWARD, "abort_backward")
        self.reset()
        self.phase = Phase.IDLE

    @property
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD

    def _expect(self, phase: Phase, transition: str) -> None:
        if self.phase is not phase:
            raise InvariantError(f"{transition}: the engine is in {self.phase.name}, expected {phase.name}")

    # ------------------------------------------------------------ frames

    def push(self, frame: Frame) -> None:
        self._frames.append(frame)

    def top(self) -> Optional[Frame]:
        return self._frames[-1] if self._frames else None

    def pop(self) -> Frame:
        return self._frames.pop()

    def reset(self) -> None:
        """A forward that raised leaves frames behind: release what they held."""
        while self._frames:
            for unit in self._frames.pop().held:
                unit.release(Hold.CALL)

    # ------------------------------------------------------------ parameters touched while released

    def on_unavailable(self, func, args, kwargs, infos):
        """A RELEASED parameter reached an operator: fetch it (inside a module call) and run."""
        self.fetch_on_demand(infos, op=getattr(func, "__name__", str(func)))
        return run_available(func, args, kwargs)

    def fetch_on_demand(self, infos, op: str) -> None:
        frame = self.top()
        if frame is None:
            msg = not_available_message(infos[0], op)
            if self.phase is Phase.BACKWARD:
                msg += (" This happened during backward: a parameter used there but owned by another module must be "
                        "declared with infinity.register_external_parameter(module, param).")
            raise ParameterNotAvailableError(msg)
        for unit in sorted({i.unit for i in infos}, key=lambda u: u.index):
            unit.acquire(Hold.CALL)
            frame.held.append(unit)
            if frame.state.add_unit(unit):
                logger.debug("external parameters of %s used by %s: fetched with it from now on",
                             unit.module_name, frame.state.name or "<root>")


def tensors_in(obj, depth: int = 0):
    """Tensors inside a module output (tensors, sequences, mappings, HF ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x, depth + 1)
