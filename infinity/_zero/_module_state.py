"""A module's hook state: the units it uses and its progress through the current backward.

Note [backward progress]: each module with units is in one ``BackwardProgress`` at a time,
moved only by the transitions below (as FSDP2 moves a parameter group's ``TrainingState``
from its own pre- and post-backward), each of which raises when called in another state:

    NOT_REACHED --hold--> AWAITING --end_hold--> DONE --reset--> NOT_REACHED
                                                  |
                                                  +--hold--> AWAITING (reached again in one backward)

- ``hold``: autograd reached one of the module's outputs (pre-backward). Its units are
  acquired for ``Hold.BACKWARD`` and the hold waits for each unit whose gradients are not all
  in and for the input gradients of its calls (Note [hold until the input gradients] in
  _backward.py). From DONE, the units' gradient counters start again where they had ended
  (Note [used again in one backward] in _backward.py).
- ``await_calls``: AWAITING, and reached again through another call of the same forward (a
  module called twice): the hold waits for that call's input gradients too.
- ``arrived``: AWAITING; something the hold waited for is in. True when it waits for nothing more,
  and the caller ends the hold.
- ``end_hold``: AWAITING -> DONE; the units are released.
- ``reset``: the end of backward, after every hold ended: NOT_REACHED for the next one.

Note [hooks per unit]: at stage 3 the forward hooks acquire a module's units, enter the trace
and, on the way out, hang a multi-grad hook on its outputs for backward. Inside a block every
submodule uses the block's units, which the block's own hooks already hold from its
pre-forward to its post-forward, and in backward from the first gradient of its outputs until
all its units' gradients and its inputs' gradients are in: the submodules' hooks would only
count references to held units again, a host cost per module (about 150 modules for GPT-2's
17 units) that FSDP2 avoids by hooking each parameter group once. With ``zero.fetch_units.hooks:
unit`` (the default) a module gets hooks only where its ancestors' hooks do not already hold
every unit it uses (``hooked_modules``): the root, each block, each module outside blocks that
owns a unit (an embedding, a final norm, a head tied to the embedding's unit), and any module
reached under two names (it may run outside the ancestor that holds its units). A unit learned
in a forward (a parameter read outside its module: Note [phases] in _phase.py) joins the
nearest hooked frame's state, and ``register_external_parameter`` hooks its module. ``hooks:
module`` hooks every module, as before: the trace per module.

Forward progress is not part of this state: it is per call, a frame on the stack of ``Calls``
(a module may run twice in one forward, and again inside backward where activation
checkpointing recomputes it), and the phase of the iteration is the engine's (``Calls.phase``,
Note [phases] in _phase.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Set

from torch import nn

from ..errors import InvariantError
from ._ledger import Hold

if TYPE_CHECKING:
    from ._unit import FetchUnit


def hooked_modules(model: nn.Module, states: Dict[nn.Module, "ModuleState"]) -> Set[nn.Module]:
    """The modules whose forward hooks stage 3 installs (Note [hooks per unit]): the root, every
    module reached under two names, and every module using a unit its nearest hooked ancestor does
    not use."""
    count: Dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        count[id(m)] = count.get(id(m), 0) + 1
    by_name = {s.name: m for m, s in states.items()}
    hooked: Set[nn.Module] = set()
    for module, state in states.items():  # named_modules order: every ancestor decided before its descendants
        ancestor = _nearest_hooked(state.name, by_name, hooked)
        if ancestor is None or count.get(id(module), 1) > 1 or not set(state.units) <= set(states[ancestor].units):
            hooked.add(module)
    return hooked


def _nearest_hooked(name: str, by_name: Dict[str, nn.Module], hooked: Set[nn.Module]) -> Optional[nn.Module]:
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        module = by_name.get(name)
        if module is not None and module in hooked:
            return module
    return None


class BackwardProgress(enum.Enum):
    NOT_REACHED = "not reached"  # backward has not come to the module (or no backward runs)
    AWAITING = "awaiting"  # its units are held until what the hold waits for has arrived
    DONE = "done"  # its hold ended in this backward


@dataclass(eq=False)
class ModuleState:
    """Per-module hook state: the units the module uses, in collective order, and its
    backward progress (Note [backward progress])."""

    module: nn.Module
    name: str
    units: List["FetchUnit"] = field(default_factory=list)
    progress: BackwardProgress = BackwardProgress.NOT_REACHED
    _awaited: Set[object] = field(default_factory=set)  # AWAITING: the units and call tokens the hold waits for

    def __repr__(self) -> str:
        return f"ModuleState({self.name or '<root>'}, {self.progress.name})"

    def add_unit(self, unit: "FetchUnit") -> bool:
        if unit in self.units:
            return False
        self.units.append(unit)
        self.units.sort(key=lambda u: u.index)
        return True

    # ------------------------------------------------------------ backward progress

    def _expect(self, progress: BackwardProgress, transition: str) -> None:
        if self.progress is not progress:
            raise InvariantError(f"{transition}: {self!r} is {self.progress.name}, expected {progress.name}")

    def hold(self, calls: Set[int]) -> None:
        """NOT_REACHED or DONE -> AWAITING: hold the units until their gradients and the input
        gradients of ``calls`` (tokens) are in."""
        if self.progress is BackwardProgress.AWAITING:
            raise InvariantError(f"hold: {self!r} is AWAITING already; a module reached again while held waits for the "
                                 f"new call (await_calls)")
        again = self.progress is BackwardProgress.DONE
        awaited: Set[object] = set(calls)
        for unit in self.units:
            unit.acquire(Hold.BACKWARD)
            if again:
                unit.expect_grads_again()
            if unit.grads_pending:
                awaited.add(unit)
        self.progress, self._awaited = BackwardProgress.AWAITING, awaited

    def await_calls(self, calls: Set[int]) -> None:
        self._expect(BackwardProgress.AWAITING, "await_calls")
        self._awaited |= calls

    @property
    def waiting(self) -> bool:
        """AWAITING and something the hold waits for has not arrived."""
        return bool(self._awaited)

    def awaits(self, awaited: object) -> bool:
        return awaited in self._awaited

    def arrived(self, awaited: object) -> bool:
        """``awaited`` (a unit or a call's token) is in; True when the hold waits for nothing more."""
        self._expect(BackwardProgress.AWAITING, "arrived")
        self._awaited.discard(awaited)
        return not self._awaited

    def end_hold(self) -> None:
        """AWAITING -> DONE: release the units."""
        self._expect(BackwardProgress.AWAITING, "end_hold")
        for unit in self.units:
            unit.release(Hold.BACKWARD)
        self.progress, self._awaited = BackwardProgress.DONE, set()

    def reset(self) -> None:
        """NOT_REACHED or DONE -> NOT_REACHED, at the end of backward."""
        if self.progress is BackwardProgress.AWAITING:
            raise InvariantError(f"reset: {self!r} is still AWAITING at the end of backward")
        self.progress = BackwardProgress.NOT_REACHED
