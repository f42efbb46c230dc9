"""The optimizer's fp32 master weights, gradient shards and Adam moments in memory.

Flat, unit after unit at ``unit.opt_offset`` (Note [shard layout] in _unit.py). ``MemoryOptimizerStore``
holds them on the device or in host memory (``none``/``cpu``); the NVMe tier is
``NvmeOptimizerStore`` in _nvme_optimizer_store.py. Both hand the update function ``Chunk``s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from .._runtime import _accelerator as acc
from .._runtime._telemetry_counters import seconds_into
from .._runtime._tiers import Tier
from ..aio import aligned_empty
from ._grad_buffer import GradBuffer, sq_and_finite  # noqa: F401 - sq_and_finite: the stores' one norm
from ._layout import ALIGN_ELEMS, ParamSource, round_up
from ._memory_plan import GRADIENTS, OPT_STATES, UNDO_LOG, totals
from ._undo_log import UndoLog, undo_log_bytes

# Elements per optimizer swap chunk by default: 3 buffer sets x 4 fp32 arrays x 16 MiB =
# 192 MiB of host memory, and the overlapped step publishes its first units early.
DEFAULT_CHUNK = 4 << 20
# elements: at most 1 GiB of optimizer state cached by default (Note [host cache] in _nvme_optimizer_store.py)
HOST_CACHE_AUTO = 64 << 20



@dataclass
class Chunk:
    """One chunk of the flat fp32 space, as seen by the update function, which may say in
    ``changed`` the (start, end) element ranges it changed (None: all of it; Note [unchanged
    ranges are not written] in _swap_pipeline.py)."""

    offset: int
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    changed: Optional[List[Tuple[int, int]]] = None
    grad_read: Optional[Callable[[], None]] = None  # the update is done reading ``grad``, before it publishes
    # the chunk (Note [one gradient buffer])
    sources: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # the states before the step, when
    # master / exp_avg / exp_avg_sq are the second set's that it writes (Note [second state set])


class OptimizerStore(Protocol):
    """Note [optimizer store protocol]: what the optimizer, the gradient sink, the engine and the
    checkpoints ask of the optimizer's flat fp32 space, in memory (``MemoryOptimizerStore``) or
    on NVMe (``NvmeOptimizerStore``, the swapper). Offsets and lengths are elements of this
    rank's flat space (``unit.opt_offset``)."""

    total: int
    tier: Tier  # where the states live: the device, host memory or NVMe
    tier_seconds: Dict[str, float]  # the update's seconds per tier: Note [engine telemetry keys] in _telemetry.py

    @property
    def memory_elems(self) -> int: ...  # the first elements held in memory (all, or a split's host share: Note
    # [split tiers] in _split.py)

    def load_master(self, offset: int, values: torch.Tensor) -> None: ...

    def read_master(self, offset: int, numel: int) -> torch.Tensor: ...

    def master_view(self) -> Optional[torch.Tensor]: ...  # the master weights as one tensor in memory, or None

    # gradients: accumulated by the sink, inspected and scaled by the step
    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None: ...

    # Note [gradients landed in place] in _grad_buffer.py: a unit's range to copy its gradient into, or None
    def landing_slot(self, offset: int, numel: int) -> Optional[torch.Tensor]: ...

    def note_norm(self, offset: int, norm: torch.Tensor) -> None: ...

    def wait_grad_writes(self) -> None: ...

    def finalize_grads(self) -> None: ...

    def grad_stats(self) -> tuple: ...

    def seal_grads(self) -> None: ...

    def zero_grads(self) -> None: ...

    def grads_flat(self) -> Optional[torch.Tensor]: ...  # the accumulating gradients as one tensor, or None

    # the update: every chunk, or the cached head on this thread and the tail in the background
    def update(self, fn: Callable[[Chunk], None]) -> None: ...

    def update_head(self, fn: Callable[[Chunk], None]) -> None: ...

    def update_tail(self, fn: Callable[[Chunk], None]) -> None: ...

    # Note [failed step] in _step_gate.py: the update failed before it changed a state, or a checkpoint load
    # follows one that did: I/O in flight waited for, the gradients it sealed dropped, the next update afresh
    def abandon_update(self) -> None: ...

    # memory: what sits idle through the activation peak (Note [released pages] in aio/_memory.py)
    def release_idle(self, block: bool = True) -> None: ...

    # checkpoints, accounting, shutdown
    def checkpoint_sources(self) -> dict: ...

    def checkpoint_loaded(self) -> None: ...

    def checkpoint_done(self) -> None: ...

    def state_bytes(self, source: ParamSource) -> dict: ...  # held in memory, as the engine reports them

    def nbytes(self) -> dict: ...

    def close(self) -> None: ...


def zeros_host(n: int, what: str) -> torch.Tensor:
    return aligned_empty(n, torch.float32, what=what)  # a fresh mapping reads as zeros: writing them
    # would make every page resident


# Note [second state set]: with a speculative update (Note [speculative update] in
# _zero/_speculative_update.py) and parameters of their own (not read from the master), the store
# holds a second set of master weights and moments. Every piece of a step is updated out of
# place, Adam reading the current set (``Chunk.sources``) and writing the second one, the
# pieces nobody updates (no gradient, padding) copied across, and when the whole flat space is
# written (the end of ``update_tail``) the two sets trade places. A guess that does not stand
# then leaves the states as they were without a copy: only the compute-dtype outputs, written in
# place for the next forward, wait in the undo log. The second set's bytes are the undo log's
# states (12 per element), and the update moves no more bytes than in place.


class MemoryOptimizerStore:
    """Master weights, moments and gradient shards as flat tensors in memory (the gradients
    a ``GradBuffer``: Note [gradients landed in place] in _grad_buffer.py).

    ``overlapped``: the step runs beside the next forward and backward (Note [overlapped
    step] in _zero_optimizer.py). The update walks the flat space in pieces of whole units,
    about ``chunk`` elements each (``update_head`` the first piece, e.g. a large embedding
    whole, on the caller's thread; ``update_tail`` the rest).

    Note [one gradient buffer]: the overlapped update and the next backward share one
    gradient buffer. The update marks each piece consumed (Note [stale gradient ranges] in
    _grad_buffer.py) once Adam has read it and before it publishes the piece
    (``Chunk.grad_read``); the next backward writes a unit's gradient only after computing
    with the unit, which it fetched only once the step gate had published the unit's range.
    So every gradient the backward writes lands in a piece already read, and a second buffer
    (4 bytes per parameter of host memory, and its page faults) is not needed. ``zero_grads``
    leaves the pieces an update has yet to read alone (the update consumes them)."""

    def __init__(self, tier: Tier, total: int, *, lazy_grad: bool = False, overlapped: bool = False,
                 ranges: Optional[List[tuple]] = None, chunk: Optional[int] = None,
                 undo_dtype: Optional[torch.dtype] = None, second_set: bool = False):
        tier = Tier.of(tier)
        self._alloc = (lambda what=OPT_STATES: zeros_host(total, what)) if tier is Tier.CPU else (
            lambda what=None: torch.zeros(total, dtype=torch.float32, device=acc.device()))
        self.tier = tier
        self.total = total
        self.memory_elems = total
        self.tier_seconds = {tier.value: 0.0}  # every chunk is on this tier (Note [engine telemetry keys] in _telemetry.py)
        self.lazy_grad = lazy_grad  # stage 1: a gradient shard exists only during the step
        self.overlapped = overlapped
        self.pieces = _unit_pieces(ranges or [], total, chunk_elems(chunk, total)) if overlapped else []
        self.head = self.pieces[0][1] if self.pieces else 0
        self.master = self._alloc()
        self.grads = GradBuffer(lambda: self._alloc(GRADIENTS), ranges or [], lazy=lazy_grad, host=tier is Tier.CPU)
        self._sealed: Optional[torch.Tensor] = None  # the gradients an overlapped update reads: the buffer itself
        self._read_upto = 0  # an overlapped update has read and zeroed the gradients below this offset
        self.exp_avg = self._alloc()
        self.exp_avg_sq = self._alloc()
        # Note [speculative update] in _zero/_speculative_update.py: the pieces from this offset on were updated
        # while backward ran, the update walks those below it; the undo log keeps what such an update overwrote
        self.speculated_from = total
        self.second_set = second_set and undo_dtype is not None  # Note [second state set]
        self._next = tuple(self._alloc(UNDO_LOG) for _ in range(3)) if self.second_set else None
        self.undo_log = UndoLog(total, undo_dtype, states=not self.second_set) if undo_dtype is not None else None

    @property
    def grad(self) -> Optional[torch.Tensor]:
        return self.grads.tensor

    def load_master(self, offset: int, values: torch.Tensor) -> None:
        self.master[offset : offset + values.numel()].copy_(values)

    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        self.grads.add(offset, shard_grad, scale)

    def landing_slot(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        return self.grads.landing_slot(offset, numel)  # Note [gradients landed in place] in _grad_buffer.py

    def note_norm(self, offset: int, norm: torch.Tensor) -> None:
        self.grads.note_norm(offset, norm)

    def grad_stats(self) -> tuple:
        """(sum of squares in float64, all finite) over the gradient shards."""
        return self.grads.stats()

    def finalize_grads(self) -> None:
        pass

    def seal_grads(self) -> None:
        if self.overlapped:  # Note [one gradient buffer]
            self._sealed = self.grads.get()
            self._read_upto = 0
        # otherwise the step reads ``grad`` in place and zeroes it when done

    def wait_grad_writes(self) -> None:
        pass

    def update(self, fn: Callable[[Chunk], None]) -> None:
        if self._sealed is None:
            with seconds_into(self.tier_seconds, self.tier.value):
                fn(Chunk(0, self.master, self.grads.get(), self.exp_avg, self.exp_avg_sq))
        else:
            self.update_head(fn)
            self.update_tail(fn)

    def update_head(self, fn: Callable[[Chunk], None]) -> None:
        self._walk(fn, 0, self.head)

    def update_tail(self, fn: Callable[[Chunk], None]) -> None:
        self._walk(fn, self.head, self.total)
        self._sealed = None
        self.speculated_from = self.total
        if self._next is not None:  # every piece written to the second set: it holds the states now
            now = (self.master, self.exp_avg, self.exp_avg_sq)
            self.master, self.exp_avg, self.exp_avg_sq = self._next
            self._next = now

    def speculated(self, ready_from: int) -> None:
        """The pieces from ``ready_from`` on were updated while backward ran and stand: their
        gradients are read, and the update walks the pieces below (Note [speculative update]
        in _zero/_speculative_update.py)."""
        self.speculated_from = ready_from
        self.grads.consumed(ready_from, self.total)

    def piece(self, start: int, end: int, grads: Optional[torch.Tensor] = None,
              grad_read: Optional[Callable[[], None]] = None) -> Chunk:
        """The chunk of one piece [start, end): over ``grads`` (the accumulating ones by default,
        which a speculative update reads before the step seals them and marks nothing read:
        Note [speculative update] in _zero/_speculative_update.py), writing the second set
        where there is one (Note [second state set])."""
        sl = slice(start, end)
        g = (self.grads.get() if grads is None else grads)[sl]
        states = (self.master[sl], self.exp_avg[sl], self.exp_avg_sq[sl])
        if self._next is None:
            return Chunk(start, states[0], g, states[1], states[2], grad_read=grad_read)
        m, a, b = (t[sl] for t in self._next)
        return Chunk(start, m, g, a, b, grad_read=grad_read, sources=states)

    def _walk(self, fn: Callable[[Chunk], None], lo: int, hi: int) -> None:
        g = self._sealed
        hi = min(hi, self.speculated_from)
        for start, end in self.pieces:
            if lo <= start < hi:
                with seconds_into(self.tier_seconds, self.tier.value):
                    fn(self.piece(start, end, g, grad_read=functools.partial(self._grad_read, start, end)))

    def _grad_read(self, start: int, end: int) -> None:
        self.grads.consumed(start, end)
        self._read_upto = end  # pieces are walked in order, the head first

    def abandon_update(self) -> None:
        self._sealed = None
        self.speculated_from = self.total  # a second set half written is scratch: the states did not move
        self.zero_grads()

    def zero_grads(self) -> None:
        if self.lazy_grad:
            self.grads.drop()
        else:  # Note [one gradient buffer]: while an update reads the buffer, it consumes the rest itself
            self.grads.drop_below(self.total if self._sealed is None else self._read_upto)

    def read_master(self, offset: int, numel: int) -> torch.Tensor:
        return self.master[offset : offset + numel]

    def master_view(self) -> Optional[torch.Tensor]:
        return self.master

    def grads_flat(self) -> Optional[torch.Tensor]:
        return self.grads.tensor

    def checkpoint_sources(self) -> dict:
        """Master weights and moments by name, for a checkpoint (Note [checkpoint layout] in
        _checkpoint/_format.py)."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def checkpoint_loaded(self) -> None:
        pass

    def checkpoint_done(self) -> None:
        pass

    def close(self) -> None:
        """Note [closed engines] in _engine.py: the moments and gradients go now; the master
        weights stay, as they may be the parameters' own shards (Note [parameters from the
        master] in _placement.py)."""
        self.exp_avg = self.exp_avg_sq = None
        self._next = None  # the second state set, scratch between steps
        self.grads.drop()
        self._sealed = None

    def grad_bytes(self) -> int:
        """Bytes of the gradient buffer held now (Note [one gradient buffer])."""
        return self.grads.nbytes()

    def release_idle(self, block: bool = True) -> None:
        """Nothing here sits idle through the activation peak: the states are the only copy."""

    def state_bytes(self, source: ParamSource) -> dict:
        """Optimizer states (the fp32 master unless it is the parameter shards: Note
        [parameters from the master] in _placement.py) and gradient shards held in memory."""
        n = self.total * 4
        return {"optimizer": 2 * n + (0 if source is ParamSource.MASTER else n), "grads": self.grad_bytes()}

    def nbytes(self) -> dict:
        undo = self.undo_log.itemsize if self.undo_log is not None else 0
        return totals(self.plan(self.tier, self.total, self.overlapped, self.lazy_grad, undo))

    @staticmethod
    def plan(tier: Tier, total: int, overlapped: bool, lazy_grad: bool = False, undo_itemsize: int = 0) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory_plan.py): master weights, moments
        and one gradient buffer, overlapped or not (Note [one gradient buffer]), and a
        speculative update's undo log (``undo_itemsize``: the outputs' bytes per element; 0:
        none). (Stage 1's lazy gradient exists during the step only, but then whole.)"""
        undo = undo_log_bytes(total, undo_itemsize) if undo_itemsize else 0
        return {tier.memory: {OPT_STATES: 3 * 4 * total, GRADIENTS: 4 * total, UNDO_LOG: undo}}




def _unit_pieces(ranges: List[tuple], total: int, target: int) -> List[tuple]:
    """[start, end) pieces covering the flat space, each made of whole units (with the
    padding after them), consecutive units merged until a piece reaches ``target`` elements."""
    bounds = sorted({o for o, _ in ranges if 0 < o < total} | {total})
    pieces, start = [], 0
    for b in bounds:
        if b - start >= target or b == total:
            pieces.append((start, b))
            start = b
    return [p for p in pieces if p[1] > p[0]]




def chunk_elems(chunk_size: Optional[int], total: int) -> int:
    """Elements per optimizer swap chunk (``zero.offload_optimizer.chunk_size``)."""
    return min(round_up(chunk_size or DEFAULT_CHUNK, ALIGN_ELEMS), round_up(max(total, 1), ALIGN_ELEMS))


def head_elems(host_cache: Optional[int], ranges: List[tuple], chunk: int, total: int) -> int:
    """Elements at the start of the flat space cached in host memory, in whole chunks
    (``zero.offload_optimizer.host_cache``; Note [host cache] in _nvme_optimizer_store.py). Automatic: the range up to
    the end of the first unit with a shard, at most HOST_CACHE_AUTO elements."""
    if host_cache is None:
        end = next((o + n for o, n in ranges if n), 0)
        host_cache = min(end, HOST_CACHE_AUTO)
    return min(round_up(host_cache, chunk), round_up(total, chunk))




def state_bytes(store: OptimizerStore, source: ParamSource) -> dict:
    """Optimizer states and gradient shards an optimizer store holds in memory."""
    return store.state_bytes(source)
