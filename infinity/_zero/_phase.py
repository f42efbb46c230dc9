"""Where training is: the phase of the iteration and the stack of module calls in forward.

Note [phases]: the engine is in one ``Phase`` at a time. ``begin_forward`` (the root module's
pre-forward hook) and ``end_forward`` (its post-forward) bracket a forward; ``begin_backward``
(the first pre-backward or gradient hook of a backward) and ``end_backward`` (the autograd
callback queued by ``begin_backward``) bracket a backward. The optimizer step runs between
them, outside both: an overlapped step may still run on its thread during the next forward
(Note [step gate] in _step_gate.py), which is why the step is not a phase of this object.
A forward inside a backward (reentrant activation checkpointing recomputes each block in
backward) pushes frames while the phase stays BACKWARD.

A parameter touched while released reaches ``Calls.on_unavailable`` (through its fetch
unit's context): inside a module call it is gathered and held until that call's
post-forward, and recorded as an external parameter of the module; anywhere else it is an
error that says how to gather it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

import torch
from torch import nn

from .._runtime._log import logger
from ..errors import InvariantError
from ._ledger import Hold
from ._param import ParameterNotAvailableError, not_available_message

if TYPE_CHECKING:
    from ._unit import FetchUnit


class Phase(enum.Enum):
    IDLE = "idle"  # between iterations, or in the optimizer step
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class ModuleState:
    """Per-module hook state: the units the module uses, in collective order."""

    module: nn.Module
    name: str
    units: List["FetchUnit"] = field(default_factory=list)

    def add_unit(self, unit: "FetchUnit") -> bool:
        if unit in self.units:
            return False
        self.units.append(unit)
        self.units.sort(key=lambda u: u.index)
        return True


@dataclass(eq=False)
class Frame:
    """One module call in progress: the units it holds until its post-forward."""

    state: ModuleState
    held: List["FetchUnit"]
    handling: Optional[BaseException] = None  # the exception being handled where the forward was called
    token: Optional[int] = None  # this call's input gradients: Note [hold until the input gradients] in _engine.py


class Calls:
    """The phase and the stack of module calls (Note [phases])."""

    def __init__(self):
        self.phase = Phase.IDLE
        self._frames: List[Frame] = []

    # ------------------------------------------------------------ phase transitions

    def begin_forward(self) -> None:
        self.reset()  # a forward that raised before its post-forward left frames behind
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.FORWARD

    def end_forward(self) -> None:
        if self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE

    def begin_backward(self) -> bool:
        """True when this starts a backward (False: one is already running)."""
        if self.phase is Phase.BACKWARD:
            return False
        self.phase = Phase.BACKWARD
        return True

    def end_backward(self) -> None:
        self._expect(Phase.BACKWARD, "end_backward")
        self.phase = Phase.IDLE

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
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

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
