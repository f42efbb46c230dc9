"""What a speculative update overwrote, kept until the step says whether it stands.

Note [speculative update] in _zero/_speculative_update.py: before Adam updates a piece of the
flat space during backward, the piece's master weights, both moments and the compute-dtype
values the update writes out are copied here, at the same offsets; ``put_back`` restores them
bit for bit when the speculation fails. Host memory that is never pinned (nothing copies it to
the device), in the ledger's ``undo_log`` category, mapped once at ``initialize``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..aio import aligned_empty
from ._memory_plan import UNDO_LOG


def undo_log_bytes(total: int, itemsize: int) -> int:
    """Host bytes of an undo log over ``total`` elements: three fp32 states and the outputs."""
    return (12 + itemsize) * total


class UndoLog:
    """``states`` off: the store writes a second set instead (Note [second state set] in
    _optimizer_store.py) and only the outputs are kept here."""

    def __init__(self, total: int, dtype: torch.dtype, states: bool = True):
        def alloc(d: torch.dtype) -> torch.Tensor:
            return aligned_empty(total, d, what=UNDO_LOG, pin=False)

        self._states = [alloc(torch.float32) for _ in range(3)] if states else []  # master, exp_avg, exp_avg_sq
        self._outputs = alloc(dtype)

    def keep(self, offset: int, states: List[torch.Tensor], outputs: List[Tuple[int, torch.Tensor]]) -> None:
        """Copy ``states`` (the piece at ``offset``: master, exp_avg, exp_avg_sq) and the output
        views (start, view) before an update overwrites them."""
        for log, t in zip(self._states, states):
            log[offset : offset + t.numel()].copy_(t)
        for start, view in outputs:
            self._outputs[start : start + view.numel()].copy_(view)

    @property
    def keeps_states(self) -> bool:
        return bool(self._states)

    def put_back(self, offset: int, states: List[torch.Tensor], outputs: List[Tuple[int, torch.Tensor]]) -> None:
        """The inverse of ``keep``: the piece holds what it held before the update."""
        for log, t in zip(self._states, states):
            t.copy_(log[offset : offset + t.numel()])
        for start, view in outputs:
            view.copy_(self._outputs[start : start + view.numel()])

    @property
    def itemsize(self) -> int:
        return self._outputs.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._states, self._outputs))
