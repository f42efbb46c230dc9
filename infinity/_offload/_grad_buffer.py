"""The fp32 gradient shards of an optimizer store in memory: one flat buffer, what each
unit's range holds, and the buffer's squared norm.

Note [gradients landed in place]: with an accelerator and the buffer in pinned host memory, a
unit's first gradient since its range was last used needs no host arithmetic: the
device->host copy writes it straight into the unit's range (``landing_slot``), scaled on the
device, and its squared norm is taken on the device from the same values (``note_norm``),
so the CPU neither adds it (a read of the staged copy and a read and write of the buffer)
nor reads it again for the step's norm. A later gradient into the same range (accumulation
over micro-batches, a late gradient) is added on the host, and that range's norm is then
taken on the host. ``stats`` sums the device norms (one synchronisation) and the host norms
of the ranges added on the host.

Note [stale gradient ranges]: nothing zeroes the buffer. Each unit's range is in one of four
states: ZERO, STALE (it holds gradients a step has consumed, or ``zero_grads`` dropped),
IN_PLACE (landed in place, its norm on the device) or ADDED (written on the host). The next
gradient into a STALE range overwrites it (a copy in place, or a host write of the scaled
gradient, which is what adding it to zeros would give), so neither the update nor
``zero_grads`` makes a pass over the buffer; only the ranges still STALE when the step reads
the gradients (units that got no gradient this time, rare) are zeroed then. Writes outside
the units' ranges are not tracked: the buffer is then zeroed and normed whole, as before.
"""
from __future__ import annotations

import enum
import math
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .._runtime import _accelerator as acc


class RangeContents(enum.Enum):
    ZERO = "zero"
    STALE = "stale"  # consumed or dropped: the next gradient overwrites it
    IN_PLACE = "in place"  # copied in from the device, its norm taken there
    ADDED = "added"  # written on the host


class GradBuffer:
    def __init__(self, alloc: Callable[[], torch.Tensor], ranges: List[Tuple[int, int]], *, lazy: bool, host: bool):
        self._alloc = alloc
        self.lazy = lazy  # stage 1: the buffer exists only during the step
        self._host = host  # in host memory (the ``cpu`` tier), where gradients can land in place
        self._size: Dict[int, int] = {o: n for o, n in ranges if n}  # each unit's range: offset -> elements
        self._contents = dict.fromkeys(self._size, RangeContents.ZERO)  # Note [stale gradient ranges]
        self._norms: Dict[int, torch.Tensor] = {}  # IN_PLACE ranges: offset -> the device norm
        self._untracked = False  # written outside the units' ranges since last zeroed whole
        self._lock = threading.Lock()  # the overlapped step marks ranges consumed while the backward writes others
        self.tensor: Optional[torch.Tensor] = None if lazy else alloc()

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = self._alloc()
        return self.tensor

    # ------------------------------------------------------------ writes

    def add(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        buf = self.get()
        view = buf[offset : offset + shard_grad.numel()]
        with self._lock:
            contents = self._contents.get(offset) if self._size.get(offset) == shard_grad.numel() else None
            if contents is not None:
                self._contents[offset] = RangeContents.ADDED
                self._norms.pop(offset, None)  # its norm is the host's from now on
        if contents is None:  # not a unit's range
            self._zero_stale()
            self._untracked = True
            view.add_(shard_grad, alpha=scale)
        elif contents is RangeContents.STALE:  # overwritten: 0 + scale * g
            view.copy_(shard_grad)
            if scale != 1.0:
                view.mul_(scale)
        else:
            view.add_(shard_grad, alpha=scale)

    def landing_slot(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        """Note [gradients landed in place]: the pinned range a unit's gradient may be copied
        straight into, or None (written already since it was last used, not a unit's range,
        not pinned host memory)."""
        if not self._host or self.lazy or self._size.get(offset) != numel:
            return None
        buf = self.get()
        if not acc.is_pinned(buf):
            return None
        with self._lock:
            if self._contents[offset] not in (RangeContents.ZERO, RangeContents.STALE):
                return None
            self._contents[offset] = RangeContents.IN_PLACE
        return buf[offset : offset + numel]

    def note_norm(self, offset: int, norm: torch.Tensor) -> None:
        """The device norm of what was copied into ``landing_slot(offset)``."""
        with self._lock:
            if self._contents.get(offset) is RangeContents.IN_PLACE:
                self._norms[offset] = norm

    # ------------------------------------------------------------ reads

    def stats(self) -> Tuple[float, bool]:
        """(sum of squares in float64, all finite) over the gradients, once every copy into
        the buffer has landed. Zeroes the ranges still STALE first (Note [stale gradient
        ranges]): after this the buffer holds exactly this step's gradients."""
        buf = self.get()
        self._zero_stale()
        with self._lock:
            in_place = [o for o, h in self._contents.items() if h is RangeContents.IN_PLACE]
            added = [o for o, h in self._contents.items() if h is RangeContents.ADDED]
            norms = [self._norms.get(o) for o in in_place]
        if self._untracked or any(n is None for n in norms):
            return sq_and_finite(buf)
        sq, finite = 0.0, True
        if norms:
            sq = float(torch.stack([n for n in norms if n is not None]).double().square().sum())
            finite = math.isfinite(sq)
        for offset in added:
            part, ok = sq_and_finite(buf[offset : offset + self._size[offset]])
            sq, finite = sq + part, finite and ok
        return sq, finite

    # ------------------------------------------------------------ consumed, dropped

    def consumed(self, start: int, end: int) -> None:
        """A step has read [start, end): the next gradients overwrite it."""
        self._mark_stale(start, end)

    def drop_below(self, upto: int) -> None:
        """``zero_grads`` over [0, upto): dropped, without a pass over the buffer."""
        if self._untracked:
            self.get()[:upto].zero_()
            self._untracked = upto < self.get().numel()
        self._mark_stale(0, upto)

    def drop(self) -> None:
        """Stage 1: the buffer goes until the next step's gradients."""
        self.tensor = None
        with self._lock:
            self._contents = dict.fromkeys(self._size, RangeContents.ZERO)
            self._norms.clear()
        self._untracked = False

    def _mark_stale(self, start: float, end: float) -> None:
        with self._lock:
            for offset, contents in self._contents.items():
                if start <= offset < end and contents is not RangeContents.ZERO:
                    self._contents[offset] = RangeContents.STALE
                    self._norms.pop(offset, None)

    def _zero_stale(self) -> None:
        with self._lock:
            stale = [o for o, h in self._contents.items() if h is RangeContents.STALE]
            for offset in stale:
                self._contents[offset] = RangeContents.ZERO
        buf = self.tensor
        for offset in stale:
            if buf is not None:
                buf[offset : offset + self._size[offset]].zero_()

    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * 4


def sq_and_finite(t: torch.Tensor) -> tuple:
    """Squared L2 norm and finiteness in one pass: a NaN or inf anywhere makes the norm
    non-finite (so does overflow of the sum, which only ever matters as an overflow)."""
    norm = float(torch.linalg.vector_norm(t))
    return norm * norm, math.isfinite(norm)
