"""Test-only fault injection at the I/O layer (``infinity_aio_inject`` in native/aio): inert
until a rule is armed, then the chosen transfer on one file fails, comes back short, stalls,
or has its bytes flipped or zeroed, whatever handle makes it. No device-mapper needed."""
from __future__ import annotations

import contextlib
import errno as _errno
import os
from typing import Iterator

from ..errors import UsageError
from ._native import READ, WRITE, lib

FAULTS = {"errno": 1, "short": 2, "stall": 3, "flip": 4, "zero": 5}
OPS = {"read": READ, "write": WRITE}


class FaultRule:
    def __init__(self, rule: int):
        self.rule = rule

    @property
    def hits(self) -> int:
        """Transfer pieces the rule has hit so far."""
        return int(lib.infinity_aio_inject_hits(self.rule))


def inject(path, op: str, fault: str, *, nth: int = 1, count: int = 1, arg: int = 0) -> FaultRule:
    """From now on, the ``nth`` (1-based) piece of ``op`` ("read"/"write") on the file at
    ``path`` and the ``count - 1`` after it (``count <= 0``: all) get ``fault``:
    "errno" (fails with errno ``arg``, e.g. errno.EIO), "short" (moves ``arg`` bytes, then finds
    the end of the file), "stall" (starts after ``arg`` ms), "flip" (byte ``arg`` of the piece
    has a bit flipped: in memory after a read, in the file after a write), "zero" (the piece
    reads as zeros, or is punched out of the file after a write). A piece is at most one
    ``aio.block_size`` request. The file must exist."""
    if op not in OPS or fault not in FAULTS:
        raise UsageError(f"inject: op must be one of {sorted(OPS)} and fault one of {sorted(FAULTS)}")
    st = os.stat(path)
    rule = lib.infinity_aio_inject(st.st_dev, st.st_ino, OPS[op], nth, count, FAULTS[fault], arg)
    if rule < 0:
        raise UsageError(f"inject: refused ({_errno.errorcode.get(-rule, rule)}): nth >= 1, arg >= 0, "
                         f"and an errno fault needs arg = the errno")
    return FaultRule(rule)


def clear() -> None:
    """Remove every rule."""
    lib.infinity_aio_inject_clear()


@contextlib.contextmanager
def io_fault(path, op: str, fault: str, **kwargs) -> Iterator[FaultRule]:
    """``inject`` for the duration of a ``with`` block (every rule is cleared at its end)."""
    rule = inject(path, op, fault, **kwargs)
    try:
        yield rule
    finally:
        clear()



