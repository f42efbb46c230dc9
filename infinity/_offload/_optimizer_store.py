"""The optimizer's fp32 master weights, gradient shards and Adam moments in memory.

Flat, unit after unit at ``unit.opt_offset`` (Note [shard layout] in _unit.py). ``MemoryOptimizerStore``
holds them on the device or in host memory (``none``/``cpu``); the NVMe tier is
``NvmeOptimizerStore`` in _nvme_optimizer_store.py. Both hand the update function ``Chunk``s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Tuple

import torch

from .._runtime import _accelerator as acc
from .._runtime._tiers import Tier
from ..aio import aligned_empty
from ._layout import ALIGN_ELEMS, round_up
from ._memory_plan import GRADIENTS, OPT_STATES, totals

# Elements per optimizer swap chunk by default: 3 buffer sets x 4 fp32 arrays x 16 MiB =
# 192 MiB of host memory, and the overlapped step publishes its first units early.
DEFAULT_CHUNK = 4 << 20
HOST_CACHE_AUTO = 64 << 20  # elements: at most 1 GiB of optimizer state cached by default (Note [host cache])



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


class OptimizerStore(Protocol):
    """Note [optimizer store protocol]: what the optimizer, the gradient sink, the engine and the
    checkpoints ask of the optimizer's flat fp32 space, in memory (``MemoryOptimizerStore``) or
    on NVMe (``NvmeOptimizerStore``, the swapper). Offsets and lengths are elements of this
    rank's flat space (``unit.opt_offset``)."""

    total: int
    tier: Tier  # where the states live: the device, host memory or NVMe

    def load_master(self, offset: int, values: torch.Tensor) -> None: ...

    def read_master(self, offset: int, numel: int) -> torch.Tensor: ...

    def master_view(self) -> Optional[torch.Tensor]: ...  # the master weights as one tensor in memory, or None

    # gradients: accumulated by the sink, inspected and scaled by the step
    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None: ...

    def wait_grad_writes(self) -> None: ...

    def finalize_grads(self) -> None: ...

    def grad_stats(self) -> tuple: ...

    def scale_grads(self, coef: float) -> None: ...

    def seal_grads(self) -> None: ...

    def zero_grads(self) -> None: ...

    def grads_flat(self) -> Optional[torch.Tensor]: ...  # the accumulating gradients as one tensor, or None

    # the update: every chunk, or the cached head on this thread and the tail in the background
    def update(self, fn: Callable[[Chunk], None]) -> None: ...

    def update_head(self, fn: Callable[[Chunk], None]) -> None: ...

    def update_tail(self, fn: Callable[[Chunk], None]) -> None: ...

    # memory: what sits idle through the activation peak (Note [released pages] in aio/_memory.py)
    def release_idle(self, block: bool = True) -> None: ...

    # checkpoints, accounting, shutdown
    def checkpoint_sources(self) -> dict: ...

    def checkpoint_loaded(self) -> None: ...

    def checkpoint_done(self) -> None: ...

    def state_bytes(self, params_are_master: bool) -> dict: ...  # held in memory, as the engine reports them

    def nbytes(self) -> dict: ...

    def close(self) -> None: ...


def zeros_host(n: int, what: str) -> torch.Tensor:
    return aligned_empty(n, torch.float32, what=what)  # a fresh mapping reads as zeros: writing them
    # would make every page resident


class MemoryOptimizerStore:
    """Master weights, moments and gradient shards as flat tensors in memory.

    ``overlapped``: the step runs beside the next forward and backward (Note [overlapped
    step] in _zero_optimizer.py, here with the parameters on NVMe). ``seal_grads`` then hands the
    accumulated gradients to the update and accumulation starts in a second buffer; the
    update walks the flat space in pieces of whole units, about ``chunk`` elements each
    (``update_head`` the first piece, e.g. a large embedding whole, on the caller's thread;
    ``update_tail`` the rest), and zeroes each sealed piece once used, so the sealed buffer
    comes back as the next step's accumulation buffer instead of a fresh allocation."""

    def __init__(self, tier: Tier, total: int, *, lazy_grad: bool = False, overlapped: bool = False,
                 ranges: Optional[List[tuple]] = None, chunk: Optional[int] = None):
        tier = Tier.of(tier)
        self._alloc = (lambda what=OPT_STATES: zeros_host(total, what)) if tier is Tier.CPU else (
            lambda what=None: torch.zeros(total, dtype=torch.float32, device=acc.device()))
        self.tier = tier
        self.total = total
        self.lazy_grad = lazy_grad  # stage 1: a gradient shard exists only during the step
        self.overlapped = overlapped
        self.pieces = _unit_pieces(ranges or [], total, chunk_elems(chunk, total)) if overlapped else []
        self.head = self.pieces[0][1] if self.pieces else 0
        self.master = self._alloc()
        self.grad = None if lazy_grad else self._alloc(GRADIENTS)
        self._sealed: Optional[torch.Tensor] = None  # the gradients an overlapped update reads
        self._spare: Optional[torch.Tensor] = None  # a zeroed buffer the last update gave back
        self.exp_avg = self._alloc()
        self.exp_avg_sq = self._alloc()

    def load_master(self, offset: int, values: torch.Tensor) -> None:
        self.master[offset : offset + values.numel()].copy_(values)

    def _grad_buffer(self) -> torch.Tensor:
        if self.grad is None:
            self.grad, self._spare = (self._spare if self._spare is not None else self._alloc(GRADIENTS)), None
        return self.grad

    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        self._grad_buffer()[offset : offset + shard_grad.numel()].add_(shard_grad, alpha=scale)

    def grad_stats(self) -> tuple:
        """(sum of squares in float64, all finite) over the gradient shards."""
        return sq_and_finite(self._grad_buffer())

    def scale_grads(self, coef: float) -> None:
        self.grad.mul_(coef)

    def finalize_grads(self) -> None:
        pass

    def seal_grads(self) -> None:
        if self.overlapped:
            self._sealed, self.grad = self._grad_buffer(), None
        # otherwise the step reads ``grad`` in place and zeroes it when done

    def wait_grad_writes(self) -> None:
        pass

    def update(self, fn: Callable[[Chunk], None]) -> None:
        if self._sealed is None:
            fn(Chunk(0, self.master, self.grad, self.exp_avg, self.exp_avg_sq))
        else:
            self.update_head(fn)
            self.update_tail(fn)

    def update_head(self, fn: Callable[[Chunk], None]) -> None:
        self._walk(fn, 0, self.head)

    def update_tail(self, fn: Callable[[Chunk], None]) -> None:
        self._walk(fn, self.head, self.total)
        self._spare, self._sealed = self._sealed, None

    def _walk(self, fn: Callable[[Chunk], None], lo: int, hi: int) -> None:
        g = self._sealed
        for start, end in self.pieces:
            if lo <= start < hi:
                sl = slice(start, end)
                fn(Chunk(start, self.master[sl], g[sl], self.exp_avg[sl], self.exp_avg_sq[sl]))
                g[sl].zero_()

    def zero_grads(self) -> None:
        if self.lazy_grad:
            self.grad = None
        elif self.grad is not None:
            self.grad.zero_()

    def read_master(self, offset: int, numel: int) -> torch.Tensor:
        return self.master[offset : offset + numel]

    def master_view(self) -> Optional[torch.Tensor]:
        return self.master

    def grads_flat(self) -> Optional[torch.Tensor]:
        return self.grad

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
        self.grad = self._sealed = self._spare = None

    def grad_bytes(self) -> int:
        """Bytes of gradient buffers held now: accumulating, sealed for an update, spare."""
        return sum(g.numel() * 4 for g in (self.grad, self._sealed, self._spare) if g is not None)

    def release_idle(self, block: bool = True) -> None:
        """Nothing here sits idle through the activation peak: the states are the only copy."""

    def state_bytes(self, params_are_master: bool) -> dict:
        """Optimizer states (the fp32 master unless it is the parameter shards) and gradient
        shards held in memory."""
        n = self.total * 4
        return {"optimizer": 2 * n + (0 if params_are_master else n), "grads": self.grad_bytes()}

    def nbytes(self) -> dict:
        return totals(self.plan(self.tier, self.total, self.overlapped, self.lazy_grad))

    @staticmethod
    def plan(tier: Tier, total: int, overlapped: bool, lazy_grad: bool = False) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory_plan.py): master weights, moments
        and gradients; an overlapped step's sealed gradients beside the accumulating ones,
        and for a moment the spare it gives back when the next backward has already started
        a new buffer. (Stage 1's lazy gradient exists during the step only, but then whole.)"""
        return {tier.memory: {OPT_STATES: 3 * 4 * total, GRADIENTS: (3 if overlapped else 1) * 4 * total}}




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
    (``zero.offload_optimizer.host_cache``; Note [host cache]). Automatic: the range up to
    the end of the first unit with a shard, at most HOST_CACHE_AUTO elements."""
    if host_cache is None:
        end = next((o + n for o, n in ranges if n), 0)
        host_cache = min(end, HOST_CACHE_AUTO)
    return min(round_up(host_cache, chunk), round_up(total, chunk))




def sq_and_finite(t: torch.Tensor) -> tuple:
    """Squared L2 norm and finiteness in one pass: a NaN or inf anywhere makes the norm
    non-finite (so does overflow of the sum, which only ever matters as an overflow)."""
    norm = float(torch.linalg.vector_norm(t))
    return norm * norm, math.isfinite(norm)





def state_bytes(store: OptimizerStore, params_are_master: bool) -> dict:
    """Optimizer states and gradient shards an optimizer store holds in memory."""
    return store.state_bytes(params_are_master)
