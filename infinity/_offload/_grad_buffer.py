"""The fp32 gradient shards of an optimizer store in memory: one flat buffer, what has been
written into it since it was last zeroed, and its squared norm.

Note [gradients landed in place]: with an accelerator and the buffer in pinned host memory, a
unit's first gradient since its range was zeroed needs no host arithmetic: the device->host
copy writes it straight into the unit's range (``landing_slot``), scaled on the device, and
its squared norm is taken on the device from the same values (``note_norm``), so the CPU
neither adds it (a read of the staged copy and a read and write of the buffer) nor reads it
again for the step's norm. A later gradient into the same range (accumulation over
micro-batches, a late gradient) is added on the host as before, and that range's norm is
then taken on the host. ``stats`` sums the device norms (one synchronisation) and the host
norms of the ranges added on the host; everything else is zero (the buffer is zeroed range
by range as the update reads it, or whole by ``zero_grads``), so it is not read at all.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from .._runtime import _accelerator as acc


class GradBuffer:
    def __init__(self, alloc: Callable[[], torch.Tensor], ranges: List[Tuple[int, int]], *, lazy: bool, host: bool):
        self._alloc = alloc
        self.lazy = lazy  # stage 1: the buffer exists only during the step
        self._host = host  # in host memory (the ``cpu`` tier), where gradients can land in place
        self._units: Dict[int, int] = {o: n for o, n in ranges if n}  # each unit's range: offset -> elements
        self._lock = threading.Lock()  # the overlapped step zeroes ranges while the backward lands others
        self._in_place: Dict[int, Optional[torch.Tensor]] = {}  # ranges landed in place: offset -> device norm
        self._added: Set[int] = set()  # ranges (offsets) added on the host
        self.zero = True  # nothing written since the buffer was last zeroed
        self.coef = 1.0  # unscaling and clipping, applied by the update as it reads each piece
        self.tensor: Optional[torch.Tensor] = None if lazy else alloc()

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = self._alloc()
        return self.tensor

    # ------------------------------------------------------------ writes

    def add(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        with self._lock:
            self._in_place.pop(offset, None)  # its norm is the host's from now on
            self._added.add(offset)
        self.get()[offset : offset + shard_grad.numel()].add_(shard_grad, alpha=scale)
        self.zero = False

    def landing_slot(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        """Note [gradients landed in place]: the pinned range a unit's gradient may be copied
        straight into, or None (written already since it was zeroed, not a unit's range, not
        pinned host memory)."""
        if not self._host or self.lazy or self._units.get(offset) != numel:
            return None
        buf = self.get()
        if not acc.is_pinned(buf):
            return None
        with self._lock:
            if offset in self._in_place or offset in self._added:
                return None
            self._in_place[offset] = None
        self.zero = False
        return buf[offset : offset + numel]

    def note_norm(self, offset: int, norm: torch.Tensor) -> None:
        """The device norm of what was copied into ``landing_slot(offset)``."""
        with self._lock:
            if offset in self._in_place:
                self._in_place[offset] = norm

    # ------------------------------------------------------------ reads

    def stats(self) -> Tuple[float, bool]:
        """(sum of squares in float64, all finite) over the gradients, once every copy into
        the buffer has landed."""
        buf = self.get()
        with self._lock:
            norms = list(self._in_place.values())
            added = sorted(self._added)
        device_norms = [n for n in norms if n is not None]
        if not norms or len(device_norms) < len(norms) or any(o not in self._units for o in added):
            return sq_and_finite(buf)
        sq = float(torch.stack(device_norms).double().square().sum())
        finite = math.isfinite(sq)
        for offset in added:
            part, ok = sq_and_finite(buf[offset : offset + self._units[offset]])
            sq, finite = sq + part, finite and ok
        return sq, finite

    # ------------------------------------------------------------ zeroing

    def zero_range(self, start: int, end: int) -> None:
        """The update has read [start, end): zero it for the next backward."""
        self.get()[start:end].zero_()
        self._forget(start, end)

    def zero_below(self, upto: int) -> None:
        if self.tensor is not None and not self.zero:
            self.tensor[:upto].zero_()
            self._forget(0, upto)
        self.zero = True

    def drop(self) -> None:
        """Stage 1: the buffer goes until the next step's gradients."""
        self.tensor = None
        self._forget(0, math.inf)
        self.zero = True

    def _forget(self, start: float, end: float) -> None:
        with self._lock:
            for offset in [o for o in self._in_place if start <= o < end]:
                del self._in_place[offset]
            self._added -= {o for o in self._added if start <= o < end}

    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * 4


def sq_and_finite(t: torch.Tensor) -> tuple:
    """Squared L2 norm and finiteness in one pass: a NaN or inf anywhere makes the norm
    non-finite (so does overflow of the sum, which only ever matters as an overflow)."""
    norm = float(torch.linalg.vector_norm(t))
    return norm * norm, math.isfinite(norm)
