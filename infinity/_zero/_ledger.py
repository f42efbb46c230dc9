"""The gather ledger: which units are gathered, who holds each and why, and what they cost.

Note [hold ledger]: a gathered (AVAILABLE) unit stays gathered while anything holds it, and
every holder says why. The reasons, each taken and dropped by one place:

- ``CALL``: a module call, from its pre-forward to its post-forward (the frame in ``Calls``;
  also a parameter fetched on demand inside the call);
- ``BACKWARD``: a module's backward, from its pre-backward until its units' gradients and
  its call's input gradients are in (Note [hold until the input gradients] in _backward.py);
- ``KEPT``: the prefetcher, for a unit used again later in this pass, until the trace
  reaches the position recorded with the hold (Note [trace and prefetch] in _prefetch.py);
- ``INTO_BACKWARD``: the prefetcher, for what backward starts with, from the end of forward
  until backward's module acquires it;
- ``GATHERED``: a ``GatheredParameters`` block.

A unit's reference count is the number of its holds; releasing for a reason the unit is
not held for is an error that names the holds it has. The ledger also keeps the gathered
elements alive and their peak (against ``max_live_parameters``), the sequence of
all-gathers for the cross-rank check (Note [same gathers on every rank] in _same_gathers.py) and
the engine's own device budget (``device_memory_limit``): one per engine, so engines in one
process never charge each other's bytes.
"""
from __future__ import annotations

import enum
from collections import Counter
from typing import Dict, Generic, List, Optional, Protocol, TypeVar

from .._runtime._accelerator import DeviceBudget
from ..errors import InvariantError


class Gatherable(Protocol):
    """What the ledger reads of a unit (a ``FetchUnit``, which sits above the ledger: the
    ledger names only this, so no import of it closes a cycle)."""

    @property
    def index(self) -> int: ...

    @property
    def full_numel(self) -> int: ...

    @property
    def full_nbytes(self) -> int: ...


U = TypeVar("U", bound=Gatherable)


class Hold(enum.Enum):
    CALL = "its module's call"
    BACKWARD = "its module's backward"
    KEPT = "a later use in this pass"
    INTO_BACKWARD = "the start of backward"
    GATHERED = "GatheredParameters"


class GatherLedger(Generic[U]):
    def __init__(self, world_size: int, device_memory_limit: Optional[int] = None):
        self._world_size = world_size
        self.budget = DeviceBudget(device_memory_limit)
        self.live = 0  # gathered elements alive now
        self.peak = 0
        self.sequence: List[int] = []  # units all-gathered since the last check, by index
        self._holds: Dict[U, Counter] = {}
        self._kept_until: Dict[U, Optional[int]] = {}  # Hold.KEPT: the trace position that ends it

    # ------------------------------------------------------------ holds

    def take(self, unit: U, why: Hold, until: Optional[int] = None) -> None:
        self._holds.setdefault(unit, Counter())[why] += 1
        if why is Hold.KEPT:
            self._kept_until[unit] = until

    def drop(self, unit: U, why: Hold) -> int:
        """Drop one hold; the number of holds left on the unit."""
        holds = self._holds.get(unit)
        if not holds or not holds[why]:
            raise InvariantError(f"{unit!r} released for {why.value}, but it is held only for "
                                 f"{self.describe(unit) or 'nothing'}")
        holds[why] -= 1
        if not holds[why]:
            del holds[why]
            if why is Hold.KEPT:
                self._kept_until.pop(unit, None)
        if not holds:
            del self._holds[unit]
            return 0
        return sum(holds.values())

    def count(self, unit: U) -> int:
        holds = self._holds.get(unit)
        return sum(holds.values()) if holds else 0

    def holds(self, unit: U, why: Hold) -> bool:
        holds = self._holds.get(unit)
        return bool(holds and holds[why])

    def held_for(self, why: Hold) -> List[U]:
        """The units held for ``why``, in the order they were first held."""
        return [u for u, holds in self._holds.items() if holds[why]]

    def kept_until(self) -> Dict[U, Optional[int]]:
        """Hold.KEPT: each kept unit and the trace position that ends its hold."""
        return dict(self._kept_until)

    def describe(self, unit: U) -> str:
        holds: Counter = self._holds.get(unit) or Counter()
        return ", ".join(f"{why.value}" + (f" (x{n})" if n > 1 else "") for why, n in holds.items())

    def check_none(self, *whys: Hold, where: str) -> None:
        """No unit is held for any of ``whys`` (at the end of a pass)."""
        left = [u for u, holds in self._holds.items() if any(holds[w] for w in whys)]
        if left:
            raise InvariantError(f"after {where}, {len(left)} unit(s) still held: "
                                 + "; ".join(f"{u!r} for {self.describe(u)}" for u in left[:4]))

    # ------------------------------------------------------------ gathered bytes

    def fits(self, unit: U, max_live: int) -> bool:
        """Whether gathering ``unit`` now stays within ``max_live`` elements and the budget."""
        return self.live + unit.full_numel <= max_live and self.budget.fits(unit.full_nbytes)

    def gathered(self, unit: U) -> None:
        self.live += unit.full_numel
        self.peak = max(self.peak, self.live)
        if self._world_size > 1:  # one rank has nothing to compare: Note [one rank] in _runtime/_comm.py
            self.sequence.append(unit.index)

    def freed(self, unit: U) -> None:
        self.live -= unit.full_numel

    def take_sequence(self) -> List[int]:
        seq, self.sequence = self.sequence, []
        return seq
