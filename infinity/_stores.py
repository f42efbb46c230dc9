"""The homes of this rank's shards on each tier, and the pool that stages NVMe transfers.

Both stores are flat, unit after unit (the parameter store at ``unit.param_offset``, the
optimizer's at ``unit.opt_offset``: Note [shard layout] in _unit.py and Note [frozen
parameters] in _layout.py), so the optimizer's fused low-precision output for a chunk of its
flat space lands in the parameter store piece by piece, one shift per unit, without another pass.

- ``ParamStore``: the compute-dtype parameter shards of stage 3: device memory (``none``),
  host memory (``cpu``) or a swap file (``nvme``), read into pool buffers when fetched.
- ``MemoryOptimizerStore`` / ``NvmeOptimizerStore``: fp32 master weights, gradient shards
  and Adam moments, in memory (``none``/``cpu``) or in swap files (``nvme``). The NVMe one
  streams the step through fixed-size chunks: Note [optimizer swapper].
"""
from __future__ import annotations

import bisect
import functools
import math
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from . import _accelerator as acc
from ._memory import (
    GRADIENTS,
    OPT_BUFFERS,
    OPT_FILES,
    OPT_HOST_CACHE,
    OPT_STATES,
    PARAM_FILES,
    PARAM_HANDOFF,
    PARAM_SHARDS,
    PARAM_STAGING,
    totals,
)
from ._recycle import Recycler
from ._swap import SwapDir, nbytes_of, new_aio, wait_io
from ._tiers import Tier
from .aio import aligned_empty
from .aio._checksum import checksummed, sums_of
from .aio._handle import close_handles
from .errors import InfinityError, UsageError

ALIGN_ELEMS = 2048  # unit offsets on NVMe: 4 KiB for 2-byte dtypes, 8 KiB for fp32
# Elements per optimizer swap chunk by default: 3 buffer sets x 4 fp32 arrays x 16 MiB =
# 192 MiB of host memory, and the overlapped step publishes its first units early.
DEFAULT_CHUNK = 4 << 20
HOST_CACHE_AUTO = 64 << 20  # elements: at most 1 GiB of optimizer state cached by default (Note [host cache])
WRITE_HANDLES = 4  # the parameter tier's writes rotate over these (Note [write ordering])
HANDOFF_BUFFERS = 2  # staging buffers' worth of the step's fresh parameter output kept in memory (Note [hand-off])


class PoolExhausted(InfinityError, RuntimeError):
    pass


class HostPool:
    """A fixed set of equal, aligned host buffers reused for every staged transfer."""

    def __init__(self, numel: int, count: int, dtype: torch.dtype, what: str, category: str = "other"):
        self.numel, self.count, self.dtype, self.what = numel, count, dtype, what
        self.category = category  # Note [host memory ledger] in aio/_memory.py
        self._free: List[torch.Tensor] = []
        self._made = 0  # buffers are allocated on first need (a one-rank CPU run reads elsewhere)
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.count * nbytes_of(self.numel, self.dtype)

    def get(self, numel: int, timeout: float = 600.0, *, block: bool = True) -> Optional[torch.Tensor]:
        if numel > self.numel:
            raise PoolExhausted(f"{self.what}: a request of {numel} elements exceeds the buffer size {self.numel}; "
                                f"set the buffer size to at least {numel} (or leave it unset to size it automatically)")
        with self._cond:
            if not self._free and self._made < self.count:
                self._made += 1
                return aligned_empty(self.numel, self.dtype, what=self.category)
            if not block and not self._free:
                return None
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise PoolExhausted(f"{self.what}: all {self.count} buffers stayed in use for {timeout:.0f}s")
            return self._free.pop()

    def put(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    @property
    def free(self) -> int:
        """Buffers a ``get`` would return now without waiting (made or not yet made)."""
        with self._cond:
            return len(self._free) + self.count - self._made


# ------------------------------------------------------------------------ parameters


class ParamStore:
    """Compute-dtype parameter shards of stage 3 on their tier.

    Note [hand-off]: on the NVMe tier, the shards the optimizer step has just written
    also stay in host memory, up to HANDOFF_BUFFERS staging buffers' worth, oldest dropped
    first. The next forward fetches units in the order the step produces them, so most
    fetches take their shard from there (``take_kept``: a view) instead of an NVMe read that
    would compete with the step's own I/O, and without a staging buffer. The step puts its
    fresh values straight into one tensor per unit (``step_outputs``), whatever its
    chunking, and writes and keeps each once complete (``step_outputs_done``): so no fetch
    assembles a unit from two pieces, and a unit is published as soon as it is complete
    (merging small units would delay the first fetches). A fetch drops the unit it used up
    (not needed again before the next step); any other write over a range drops what was
    kept. The unit tensors come back through a Recycler (Note [recycled host memory] in
    _recycle.py).
    """

    def __init__(self, tier: Tier, dtype: torch.dtype, total: int, *, swap: Optional[SwapDir] = None, aio_cfg=None,
                 alias: Optional[torch.Tensor] = None, max_unit: int = 0, buffer_size: Optional[int] = None,
                 buffer_count: Optional[int] = None, slots: Optional[List[tuple]] = None, direct_reads: bool = False,
                 update_chunk: int = 0):
        tier = Tier.of(tier)
        self.update_chunk = update_chunk  # elements the step updates at a time (its outputs fill per chunk)
        self.direct_reads = direct_reads  # reads land in the caller's buffers: the pool stays empty (Note [one memory model])
        self.tier, self.dtype, self.total = tier, dtype, total
        self.flat: Optional[torch.Tensor] = None
        self.pool: Optional[HostPool] = None
        self.bytes_read = 0
        self.bytes_written = 0
        if tier is Tier.NVME:
            self.path = checksummed(swap.file("params.swp", nbytes_of(total, dtype)), nbytes_of(total, dtype),
                                    aio_cfg.checksums)  # Note [swap checksums] in aio/_checksum.py
            self._writers = [new_aio(aio_cfg) for _ in range(WRITE_HANDLES)]  # Note [write ordering]
            self._next_writer = 0
            self._writes: List[tuple] = []  # (start, end, handle) of writes not yet seen to land
            self._rank = swap.rank
            size = buffer_size or max_unit
            if size < max_unit:
                raise UsageError(f"zero.offload_param.buffer_size={buffer_size} is smaller than the largest fetch "
                                 f"unit's shard ({max_unit} elements); set it to at least {max_unit} or leave it unset")
            count = buffer_count or 2
            if count < 2:
                raise UsageError(f"zero.offload_param.buffer_count={buffer_count}: at least 2 staging buffers are "
                                 f"needed (one being gathered, one being read); leave it unset to size it automatically")
            self.pool = HostPool(max(size, 1), count, dtype, "parameter staging pool", PARAM_STAGING)
            self._readers = [new_aio(aio_cfg) for _ in range(count)]  # one per buffer: reads complete independently
            self._all_readers = list(self._readers)  # a reader is out of the list while its read is pending
            self._kept: List[tuple] = []  # (offset, tensor) written by the step, oldest first (Note [hand-off])
            self._kept_cap = HANDOFF_BUFFERS * nbytes_of(self.pool.numel, dtype)
            self._lock = threading.Lock()  # the step's thread writes while the forward reads
            self._spans = [(a, a + n) for a, n in slots or []]  # each trainable unit's slot (Note [frozen parameters])
            self._span_starts = [a for a, _ in self._spans]
            self._filling: dict = {}  # span start -> [its output tensor, elements written so far]
            self._outputs = Recycler(self._kept_cap, functools.partial(aligned_empty, what=PARAM_HANDOFF))
        elif alias is not None:
            self.flat = alias
        elif tier is Tier.CPU:
            self.flat = aligned_empty(total, dtype, what=PARAM_SHARDS)
        else:
            self.flat = torch.empty(total, dtype=dtype, device=acc.device())

    @property
    def resident(self) -> bool:
        return self.flat is not None

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def view(self, offset: int, numel: int) -> torch.Tensor:
        return self.flat[offset : offset + numel]

    def write(self, offset: int, values: torch.Tensor, *, keep: bool = False) -> None:
        """Store ``values`` (any float dtype; cast here) at ``offset``; async on NVMe. With
        ``keep`` (the optimizer step's fresh output, never modified afterwards) the values
        also stay in memory for the next fetch (Note [hand-off])."""
        if self.flat is not None:
            self.flat[offset : offset + values.numel()].copy_(values)
            return
        if values.dtype != self.dtype:
            values = values.to(self.dtype)
        end = offset + values.numel()
        with self._lock:
            handle = self._writers[self._next_writer]
            self._next_writer = (self._next_writer + 1) % len(self._writers)
        self._reap(handle)  # outside the lock: a fetch must not wait for this write's predecessor
        with self._lock:
            handle.pwrite(values, self.path, offset * values.element_size())
            self._writes.append((offset, end, handle))
            self.bytes_written += values.numel() * values.element_size()
            self._kept = [(o, t) for o, t in self._kept if o + t.numel() <= offset or o >= end]
            if keep and values.numel() * values.element_size() <= self._kept_cap:
                self._kept.append((offset, values))
                while sum(t.numel() for _, t in self._kept) * values.element_size() > self._kept_cap:
                    self._kept.pop(0)

    def _reap(self, handle) -> None:
        """Collect ``handle``'s earlier writes before it takes another (they were submitted
        WRITE_HANDLES writes ago, so have mostly landed): a handle keeps the tensors it wrote
        alive until collected, and the step's output tensors would otherwise stay mapped, up
        to the whole parameter space of them, until some read waited for them. So at most
        WRITE_HANDLES written outputs are uncollected (Note [one memory model] in _memory.py).
        Only the step's thread writes; a read waiting on the same handle meanwhile is fine
        (``_writes_landed`` drops only the writes it saw)."""
        with self._lock:
            mine = [w for w in self._writes if w[2] is handle]
        if mine:
            wait_io(handle, f"parameter shard writes on rank {self._rank}")
            done = {id(w) for w in mine}
            with self._lock:
                self._writes = [w for w in self._writes if id(w) not in done]

    def _spans_in(self, offset: int, end: int):
        """The unit spans [a, b) overlapping [offset, end)."""
        i = bisect.bisect_right(self._span_starts, offset) - 1
        while i < len(self._spans) and self._spans[i][0] < end:
            yield self._spans[i]
            i += 1

    def step_outputs(self, offset: int, numel: int) -> List[tuple]:
        """(start, view) pieces covering [offset, offset + numel): where the optimizer step
        puts its fresh values of that range, slices of one output tensor per unit (Note
        [hand-off]). Report them with ``step_outputs_done`` once written."""
        out, end = [], offset + numel
        for a, b in self._spans_in(offset, end):
            if a not in self._filling:
                self._filling[a] = [self._outputs.take(b - a, self.dtype), 0]
            lo, hi = max(a, offset), min(b, end)
            out.append((lo, self._filling[a][0][lo - a : hi - a]))
        return out

    def step_outputs_done(self, offset: int, numel: int) -> int:
        """The values of [offset, offset + numel) are in their ``step_outputs`` views: write
        and keep every unit now complete. Returns the offset below which every range the
        step has produced is written (a unit still filling is not, nor anything after it)."""
        end = upto = offset + numel
        for a, b in self._spans_in(offset, end):
            fill = self._filling[a]
            fill[1] += min(b, end) - max(a, offset)
            if fill[1] == b - a:
                del self._filling[a]
                self.write(a, fill[0][:], keep=True)  # a view: the write and the kept entry count as users
                self._outputs.give(fill[0])  # reused once they and every fetch's view let go
            else:
                upto = min(upto, a)
        return upto

    def take_kept(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        """[offset, offset + numel) as a view of the step's kept output, if a kept unit
        tensor holds it all. A fetch of that unit (the range starts where the tensor does)
        uses it up, so it is dropped (Note [hand-off])."""
        end = offset + numel
        with self._lock:
            for i, (o, t) in enumerate(self._kept):
                if o <= offset and end <= o + t.numel():
                    if o == offset:
                        del self._kept[i]
                    return t[offset - o : end - o]
        return None

    def flush(self) -> None:
        """Wait for every write so far."""
        if self.flat is None:
            self._writes_landed(0, self.total, block=True)

    def checkpoint_source(self):
        """The shards for a checkpoint (Note [checkpoint layout] in _checkpoint/_format.py):
        the flat tensor, or the swap file once every write to it has landed."""
        if self.flat is not None:
            return self.flat
        self.flush()
        return self.path

    def checkpoint_loaded(self) -> None:
        """A checkpoint rewrote the shards: what the step handed off is stale (Note [hand-off])."""
        if self.flat is None:
            with self._lock:
                self._kept = []

    def _writes_landed(self, offset: int, numel: int, *, block: bool) -> bool:
        """Note [write ordering]: the overlapped step publishes a range before its write has
        landed, so a read waits for the writes that overlap its range, and only for those:
        writes rotate over WRITE_HANDLES handles, and a read waits for the handles holding an
        overlapping write (a prefetch, ``block`` off, does not wait: it tries again later).
        Waiting also raises a failed write's error, so none goes unseen."""
        end = offset + numel
        with self._lock:
            mine = [w for w in self._writes if w[0] < end and w[1] > offset]
        handles = list({id(h): h for _, _, h in mine}.values())
        if not block and any(h.in_flight() for h in handles):
            return False
        for h in handles:
            wait_io(h, f"parameter shard writes on rank {self._rank}")
        done = {id(w) for w in mine}
        with self._lock:
            self._writes = [w for w in self._writes if id(w) not in done]
        return True

    def start_read(self, offset: int, numel: int, *, block: bool = True, into: Optional[torch.Tensor] = None):
        """Submit NVMe -> a pool buffer (or ``into``, aligned host memory of the caller's);
        None when ``block`` is off and the range's writes are still landing or no buffer is
        free. ``finish_read`` returns the buffer; the caller gives a pool buffer back with
        ``pool.put``."""
        if not self._writes_landed(offset, numel, block=block):
            return None
        buf = self.pool.get(numel, block=block) if into is None else into
        if buf is None:
            return None
        reader = self._readers.pop()
        reader.pread(buf[:numel], self.path, offset * self.itemsize)
        self.bytes_read += numel * self.itemsize
        return buf, reader, into is None

    def read(self, offset: int, numel: int) -> torch.Tensor:
        """A copy of [offset, offset + numel), once every write to it has landed."""
        if self.flat is not None:
            return self.flat[offset : offset + numel].clone()
        pending = self.start_read(offset, numel)
        buf = self.finish_read(pending, f"reading back parameter shards at element {offset}")
        out = buf[:numel].clone()
        if pending[2]:
            self.pool.put(buf)
        return out

    @staticmethod
    def read_done(pending) -> bool:
        """The read has landed (``finish_read`` will not block)."""
        return pending[1].in_flight() == 0

    def finish_read(self, pending, what: str = "") -> torch.Tensor:
        buf, reader, pooled = pending
        try:
            wait_io(reader, what or "a parameter shard read")
        except Exception:
            if pooled:
                self.pool.put(buf)
            raise
        finally:
            self._readers.append(reader)
        return buf

    def nbytes(self) -> dict:
        pool = self.pool or HostPool(0, 0, self.dtype, "")
        return totals(self.plan(self.tier, self.total, self.itemsize, pool.numel, 0 if self.direct_reads else pool.count,
                                self.update_chunk))

    def close(self) -> None:
        """Close the I/O handles (Note [closing handles] in aio/_handle.py)."""
        if self.tier is Tier.NVME:
            close_handles(self._writers + self._all_readers)

    def checksums(self) -> dict:
        """The block sums of the swap file by its name (Note [swap checksums] in aio/_checksum.py)."""
        sums = sums_of(getattr(self, "path", None))
        return {"params": sums} if sums else {}

    @staticmethod
    def plan(tier: Tier, total: int, itemsize: int, buffer_numel: int, buffer_count: int, chunk: int = 0) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory.py): the shards on their tier;
        on NVMe also the staging pool, and the step's output tensors (``handoff_bound``)."""
        own = total * itemsize
        if tier is Tier.NVME:
            return {"nvme": {PARAM_FILES: own}, "host": {PARAM_STAGING: buffer_count * buffer_numel * itemsize,
                                                         PARAM_HANDOFF: handoff_bound(total, buffer_numel, chunk) * itemsize}}
        return {tier.memory: {PARAM_SHARDS: own}}


def handoff_bound(total: int, buffer_numel: int, chunk: int) -> int:
    """Elements of the step's output tensors alive at once (Note [hand-off]): those the
    recycler holds, kept ones among them (HANDOFF_BUFFERS buffers' worth), those written and
    not yet collected (WRITE_HANDLES units: ``_reap``), those filling (the units of one
    update chunk, and one unit at each end), and as many again as a forward may still read
    after taking them. A cap, not a typical figure: a model whose units are all small holds
    about its whole parameter space of them (``total``), a large one less."""
    slot = _round_up(buffer_numel, ALIGN_ELEMS)  # an output tensor spans a unit's slot, padding included
    return (2 * HANDOFF_BUFFERS + WRITE_HANDLES + 2) * slot + chunk


# ------------------------------------------------------------------------ optimizer


@dataclass
class Chunk:
    """One chunk of the flat fp32 space, as seen by the update function."""

    offset: int
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class MemoryOptimizerStore:
    """Master weights, moments and gradient shards as flat tensors in memory.

    ``overlapped``: the step runs beside the next forward and backward (Note [overlapped
    step] in _optimizer.py, here with the parameters on NVMe). ``seal_grads`` then hands the
    accumulated gradients to the update and accumulation starts in a second buffer; the
    update walks the flat space in pieces of whole units, about ``chunk`` elements each
    (``update_head`` the first piece, e.g. a large embedding whole, on the caller's thread;
    ``update_tail`` the rest), and zeroes each sealed piece once used, so the sealed buffer
    comes back as the next step's accumulation buffer instead of a fresh allocation."""

    def __init__(self, tier: Tier, total: int, *, lazy_grad: bool = False, overlapped: bool = False,
                 ranges: Optional[List[tuple]] = None, chunk: Optional[int] = None):
        tier = Tier.of(tier)
        self._alloc = (lambda what=OPT_STATES: _zeros_host(total, what)) if tier is Tier.CPU else (
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
        return _sq_and_finite(self._grad_buffer())

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

    def checkpoint_sources(self) -> dict:
        """Master weights and moments by name, for a checkpoint (Note [checkpoint layout] in
        _checkpoint/_format.py)."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def checkpoint_loaded(self) -> None:
        pass

    def close(self) -> None:
        pass

    def grad_bytes(self) -> int:
        """Bytes of gradient buffers held now: accumulating, sealed for an update, spare."""
        return sum(g.numel() * 4 for g in (self.grad, self._sealed, self._spare) if g is not None)

    def nbytes(self) -> dict:
        return totals(self.plan(self.tier, self.total, self.overlapped, self.lazy_grad))

    @staticmethod
    def plan(tier: Tier, total: int, overlapped: bool, lazy_grad: bool = False) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory.py): master weights, moments
        and gradients; an overlapped step's sealed gradients beside the accumulating ones,
        and for a moment the spare it gives back when the next backward has already started
        a new buffer. (Stage 1's lazy gradient exists during the step only, but then whole.)"""
        return {tier.memory: {OPT_STATES: 3 * 4 * total, GRADIENTS: (3 if overlapped else 1) * 4 * total}}


def _zeros_host(n: int, what: str) -> torch.Tensor:
    t = aligned_empty(n, torch.float32, what=what)
    t.zero_()
    return t


_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad")


class NvmeOptimizerStore:
    """Note [optimizer swapper]: the fp32 master weights, both moments and the gradient
    shards live in swap files. ``update`` walks the flat space in chunks of ``chunk``
    elements through ``SETS`` buffer sets, each with its own read and write handle: while
    chunk k is updated on the CPU, the reads of chunks k+1 .. k+SETS-2 and the write-back of
    chunk k-1 are in flight (three sets already keep a 2 GB/s disk busy both ways; a fourth
    measured no faster). Gradient shards are written as backward produces them; with
    gradient accumulation the later micro-batches read, add and write back. The squared norm and the
    finiteness of the gradients are folded in as their final values are written (one
    micro-batch per step), or measured in a read pass otherwise. Accumulation (main thread)
    and an overlapped step (its own thread) use separate I/O handles and byte counters.

    Note [gradients in host memory]: with ``grads_in_memory``
    (``zero.offload_optimizer.gradients``) every gradient shard accumulates in one flat host
    tensor instead of the swap file (and the host cache holds no gradients of its own), and
    each chunk's update uses its slice:
    4 bytes per parameter of host memory save writing every gradient during backward and
    reading it back in the step (a third of the step's disk traffic, and the time the
    backward waited for those writes). The overlapped step's ordering argument is the same
    as for the file: a unit's gradient range is consumed by its update before the unit can
    be fetched, hence before the next backward accumulates into it.

    Note [host cache]: the first ``head`` elements of the flat space (whole chunks; by
    default the first fetch unit's range, e.g. a tied embedding) also stay in host memory.
    The overlapped step cannot hand the next forward anything before it has updated that
    range, and its gradients are complete only at the very end of backward, so its disk
    round trips would all lie on the critical path. Instead its master weights and moments
    are a write-through cache (the files stay complete and authoritative; the cache is
    filled by the first update and dropped by ``load_master``), and its gradient shards
    live in memory only (the files never hold them). ``update_head`` then runs on the
    caller's thread without waiting for a single read, and ``update_tail`` streams the rest
    through the buffer sets, whose first reads ``update_head`` has already started."""

    SETS = 3

    def __init__(self, total: int, ranges: List[tuple], swap: SwapDir, aio_cfg, chunk: Optional[int],
                 accumulation_steps: int, host_cache: Optional[int] = None, grads_in_memory: bool = False):
        self.tier = Tier.NVME
        self.total = total
        self.ranges = ranges  # (offset, numel) of every unit's shard in the flat space
        self.chunk = chunk_elems(chunk, total)
        self.head = head_elems(host_cache, ranges, self.chunk, total)  # Note [host cache]
        # Note [gradients in host memory]: every gradient shard; None = the swap file (and the head sets)
        self.grad_mem = _zeros_host(total, GRADIENTS) if grads_in_memory else None
        self._swapped = _NAMES[:3] if grads_in_memory else _NAMES  # the arrays with a swap file and a head buffer
        self.paths = {n: checksummed(swap.file(f"{n}.swp", total * 4), total * 4, aio_cfg.checksums)
                      for n in self._swapped}  # Note [swap checksums] in aio/_checksum.py
        self.head_sets = [{n: aligned_empty(self.chunk, torch.float32, what=OPT_HOST_CACHE) for n in self._swapped}
                          for _ in range(self.head // self.chunk)]
        for hs in self.head_sets:
            if "grad" in hs:
                hs["grad"].zero_()  # the gaps between aligned unit ranges must read as zero gradients
        self.head_io = new_aio(aio_cfg)
        self._head_loaded = False  # the head sets hold the current master weights and moments
        self._tail_primed = False  # the first tail chunks' reads are in flight
        self.reader = new_aio(aio_cfg)
        self.readers = [new_aio(aio_cfg) for _ in range(self.SETS)]  # a read and a write handle per set
        self.writers = [new_aio(aio_cfg) for _ in range(self.SETS)]
        self.grad_reader = new_aio(aio_cfg)
        self.grad_writer = new_aio(aio_cfg)
        self.sets = [{n: aligned_empty(self.chunk, torch.float32, what=OPT_BUFFERS) for n in _NAMES} for _ in range(self.SETS)]
        self.accumulation_steps = accumulation_steps
        self.rank = swap.rank
        self._written: set = set()  # offsets of gradient ranges written since the last step
        self._sq, self._finite, self._stats_valid = 0.0, True, accumulation_steps == 1
        self._io = {"step": [0, 0], "grad": [0, 0]}  # [read, written] bytes by the step's and the grads' handles
        self._coef = 1.0  # the gradients' scale (unscaling and clipping), applied inside the next update
        self._zero_files()

    @property
    def bytes_read(self) -> int:
        return sum(r for r, _ in self._io.values())

    @property
    def bytes_written(self) -> int:
        return sum(w for _, w in self._io.values())

    def _zero_files(self) -> None:
        zeros = self.sets[0]["grad"].zero_()
        for path in (self.paths[n] for n in self._swapped if n != "master"):
            for off in range(0, self.total, self.chunk):
                n = min(self.chunk, self.total - off)
                self.writers[0].pwrite(zeros[:n], path, off * 4)
        self._wait(self.writers[0], "zero-filling the optimizer swap files")

    # -------------------------------------------------------------- I/O helpers

    def _wait(self, handle, what: str) -> None:
        wait_io(handle, f"{what} (optimizer swapper, rank {self.rank})")

    def _read(self, handle, name: str, offset: int, out: torch.Tensor) -> None:
        handle.pread(out, self.paths[name], offset * 4)
        self._io["step"][0] += out.numel() * 4

    def _write(self, handle, name: str, offset: int, values: torch.Tensor) -> None:
        handle.pwrite(values, self.paths[name], offset * 4)
        self._io["step"][1] += values.numel() * 4

    def _grad_read(self, offset: int, out: torch.Tensor) -> None:
        self.grad_reader.pread(out, self.paths["grad"], offset * 4)
        self._wait(self.grad_reader, f"reading gradient shards at element {offset}")
        self._io["grad"][0] += out.numel() * 4

    def _grad_write(self, offset: int, values: torch.Tensor) -> None:
        self.grad_writer.pwrite(values, self.paths["grad"], offset * 4)
        self._io["grad"][1] += values.numel() * 4

    def load_master(self, offset: int, values: torch.Tensor) -> None:
        self._wait(self.head_io, "writing back the cached optimizer chunks")  # older values must land first
        buf = values.contiguous().to(torch.float32)
        self._write(self.writers[0], "master", offset, buf)
        self._wait(self.writers[0], f"writing master weights at element {offset}")
        if offset < self.head:
            self._head_loaded = False  # the next update reads the cache afresh (Note [host cache])

    def read_master(self, offset: int, numel: int) -> torch.Tensor:
        self._wait(self.head_io, "writing back the cached optimizer chunks")  # the files are then complete
        out = torch.empty(numel, dtype=torch.float32)
        self._read(self.reader, "master", offset, out)
        self._wait(self.reader, f"reading master weights at element {offset}")
        return out

    def checkpoint_sources(self) -> dict:
        """The swap files of the master weights and moments, complete once the host cache's
        write-through has landed (Note [host cache]), for a checkpoint."""
        self._wait(self.head_io, "writing back the cached optimizer chunks")
        return {name: self.paths[name] for name in _NAMES[:3]}

    def checkpoint_loaded(self) -> None:
        """A checkpoint rewrote the files: the host cache reads them afresh."""
        self._head_loaded = False

    def _head_pieces(self, offset: int, numel: int):
        """(head set, start in its chunk, length, start in the range) of the part of
        [offset, offset + numel) inside the head, which is always a prefix of the range."""
        end = min(offset + numel, self.head)
        pos = offset
        while pos < end:
            i, lo = divmod(pos, self.chunk)
            n = min(self.chunk - lo, end - pos)
            yield self.head_sets[i], lo, n, pos - offset
            pos += n

    def _in_head(self, offset: int, numel: int) -> int:
        """Elements of [offset, offset + numel) inside the head."""
        return max(0, min(offset + numel, self.head) - offset)

    # -------------------------------------------------------------- gradients

    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        g = shard_grad.mul(scale) if scale != 1.0 else shard_grad.contiguous()
        again = offset in self._written
        if again:
            self._stats_valid = False
        else:
            self._written.add(offset)
        if self._stats_valid:
            s, f = _sq_and_finite(g)
            self._sq += s
            self._finite = self._finite and f
        if self.grad_mem is not None:  # Note [gradients in host memory]
            dst = self.grad_mem[offset : offset + g.numel()]
            if again:
                dst.add_(g)
            else:
                dst.copy_(g)
            return
        for hs, lo, n, at in self._head_pieces(offset, g.numel()):  # Note [host cache]: in memory only
            dst, src = hs["grad"][lo : lo + n], g[at : at + n]
            if again:
                dst.add_(src)
            else:
                dst.copy_(src)
        h = self._in_head(offset, g.numel())
        if h == g.numel():
            return
        g = g[h:]
        if again:
            self._wait(self.grad_writer, "gradient shard writes")  # the earlier write of this range must land
            old = torch.empty_like(g)
            self._grad_read(offset + h, old)
            g = old.add_(g)
        self._grad_write(offset + h, g)  # the handle keeps g alive until written

    def wait_grad_writes(self) -> None:
        """Gradient buffers handed to ``accumulate`` may be reused once this returns."""
        self._wait(self.grad_writer, "gradient shard writes")

    def finalize_grads(self) -> None:
        """Before the step: ranges that got no gradient this step must read as zeros."""
        missing = [(o, n) for o, n in self.ranges if o not in self._written and n]
        if missing:
            zeros = torch.zeros(max(n for _, n in missing), dtype=torch.float32)
            for o, n in missing:
                self._written.add(o)
                if self.grad_mem is not None:
                    self.grad_mem[o : o + n].zero_()
                    continue
                for hs, lo, k, _ in self._head_pieces(o, n):
                    hs["grad"][lo : lo + k].zero_()
                h = self._in_head(o, n)
                if h < n:
                    self._grad_write(o + h, zeros[: n - h])
        self._wait(self.grad_writer, "gradient shard writes")

    def grad_stats(self) -> tuple:
        """Of the gradients accumulated so far (call with no step in flight: it borrows a buffer set)."""
        if self._stats_valid:
            return self._sq, self._finite
        sq, finite = 0.0, True
        for off in range(0, self.total, self.chunk):
            n = min(self.chunk, self.total - off)
            if self.grad_mem is not None:
                buf = self.grad_mem[off : off + n]
            elif off < self.head:
                buf = self.head_sets[off // self.chunk]["grad"][:n]
            else:
                buf = self.sets[0]["grad"][:n]
                self._grad_read(off, buf)
            s, f = _sq_and_finite(buf)
            sq += s
            finite = finite and f
        return sq, finite

    def scale_grads(self, coef: float) -> None:
        self._coef = coef  # applied per chunk inside update, saving a pass over the file

    def zero_grads(self) -> None:
        """Forget the gradients accumulated so far: the next accumulation overwrites instead of adding."""
        self._wait(self.grad_writer, "gradient shard writes")
        self._written.clear()
        self._sq, self._finite, self._stats_valid = 0.0, True, self.accumulation_steps == 1

    def seal_grads(self) -> None:
        """The accumulated gradients now belong to the next ``update``; accumulation starts
        afresh (the next backward may run while an overlapped update still reads: Note
        [overlapped step] in _optimizer.py says why it never reads a range being rewritten)."""
        self.zero_grads()

    # -------------------------------------------------------------- the step

    def update(self, fn: Callable[[Chunk], None]) -> None:
        """Run ``fn`` over every chunk of the flat space, in order, and write the results back."""
        self.update_head(fn)
        self.update_tail(fn)

    def update_head(self, fn: Callable[[Chunk], None]) -> None:
        """The cached chunks, on this thread (Note [host cache]). Starts the tail's first
        reads before computing, so that they land meanwhile."""
        self._prime_tail()
        if not self.head_sets:
            return
        self._wait(self.head_io, "writing back the cached optimizer chunks")  # their buffers change now
        if not self._head_loaded:
            for off, bufs in self._head_chunks():
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    self._read(self.head_io, name, off, bufs[name])
            self._wait(self.head_io, "reading the cached optimizer chunks")
            self._head_loaded = True
        for off, bufs in self._head_chunks():
            self._update_one(fn, off, bufs, self.head_io)

    def _head_chunks(self):
        """(offset, the head set's arrays cut to the chunk's length) of every cached chunk."""
        for i, hs in enumerate(self.head_sets):
            off = i * self.chunk
            n = min(self.chunk, self.total - off)
            yield off, self._with_grad({name: t[:n] for name, t in hs.items()}, off, n)

    def update_tail(self, fn: Callable[[Chunk], None]) -> None:
        """The chunks past the head, streamed through the buffer sets (Note [optimizer swapper])."""
        self._prime_tail()
        starts = self._tail_starts()
        ahead = self.SETS - 2  # chunks read ahead; one set computes, one set's writes drain
        for k, off in enumerate(starts):
            self._wait(self.readers[k % self.SETS], f"reading optimizer chunk at element {off}")  # set k % SETS
            j = k + ahead
            if j < len(starts):
                self._wait(self.writers[j % self.SETS], "writing back an optimizer chunk")  # set held chunk j - SETS
                self._read_chunk(j % self.SETS, starts[j])
            n = min(self.chunk, self.total - off)
            bufs = self._with_grad({name: t[:n] for name, t in self.sets[k % self.SETS].items()}, off, n)
            self._update_one(fn, off, bufs, self.writers[k % self.SETS])
        for w in self.writers:
            self._wait(w, "writing back optimizer chunks")
        self._coef = 1.0
        self._tail_primed = False

    def _update_one(self, fn: Callable[[Chunk], None], off: int, bufs: dict, writer) -> None:
        if self._coef != 1.0:
            bufs["grad"].mul_(self._coef)
        fn(Chunk(off, bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"]))
        for name in ("master", "exp_avg", "exp_avg_sq"):
            self._write(writer, name, off, bufs[name])

    def _tail_starts(self) -> list:
        return list(range(self.head, self.total, self.chunk))

    def _prime_tail(self) -> None:
        """Submit the reads of the first tail chunks (once per update)."""
        if self._tail_primed:
            return
        starts = self._tail_starts()
        for j in range(min(self.SETS - 2, len(starts))):
            self._read_chunk(j, starts[j])
        self._tail_primed = True

    def _with_grad(self, bufs: dict, offset: int, numel: int) -> dict:
        """A chunk's arrays, its gradients from host memory where they live there."""
        if self.grad_mem is not None:
            bufs["grad"] = self.grad_mem[offset : offset + numel]
        return bufs

    def _read_chunk(self, s: int, off: int) -> None:
        n = min(self.chunk, self.total - off)
        for name in self._swapped:
            self._read(self.readers[s], name, off, self.sets[s][name][:n])

    def nbytes(self) -> dict:
        return totals(self.plan(self.total, self.chunk, len(self.head_sets) * self.chunk, self.grad_mem is not None))

    def close(self) -> None:
        """Close the I/O handles (Note [closing handles] in aio/_handle.py)."""
        close_handles([self.head_io, self.reader, *self.readers, *self.writers, self.grad_reader, self.grad_writer])

    def checksums(self) -> dict:
        """The block sums of each swap file by array name (Note [swap checksums] in aio/_checksum.py)."""
        return {n: sums_of(p) for n, p in self.paths.items() if sums_of(p)}

    @classmethod
    def plan(cls, total: int, chunk: int, head: int, grads_in_memory: bool) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory.py): the swap files (gradients
        too unless they stay in host memory), the buffer sets, the host cache of the first
        ``head`` elements (Note [host cache]) and the gradients in host memory (Note
        [gradients in host memory]). Not yet counted: the files' block sums, 1/512 of the swap
        bytes (BlockSums.bytes_for; Note [swap checksums] in aio/_checksum.py)."""
        swapped = len(_NAMES) - (1 if grads_in_memory else 0)
        return {"nvme": {OPT_FILES: 4 * swapped * total},
                "host": {OPT_BUFFERS: cls.SETS * 4 * len(_NAMES) * chunk, OPT_HOST_CACHE: 4 * swapped * head,
                         GRADIENTS: 4 * total if grads_in_memory else 0}}


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
    return min(_round_up(chunk_size or DEFAULT_CHUNK, ALIGN_ELEMS), _round_up(max(total, 1), ALIGN_ELEMS))


def head_elems(host_cache: Optional[int], ranges: List[tuple], chunk: int, total: int) -> int:
    """Elements at the start of the flat space cached in host memory, in whole chunks
    (``zero.offload_optimizer.host_cache``; Note [host cache]). Automatic: the range up to
    the end of the first unit with a shard, at most HOST_CACHE_AUTO elements."""
    if host_cache is None:
        end = next((o + n for o, n in ranges if n), 0)
        host_cache = min(end, HOST_CACHE_AUTO)
    return min(_round_up(host_cache, chunk), _round_up(total, chunk))


def _sq_and_finite(t: torch.Tensor) -> tuple:
    """Squared L2 norm and finiteness in one pass: a NaN or inf anywhere makes the norm
    non-finite (so does overflow of the sum, which only ever matters as an overflow)."""
    norm = float(torch.linalg.vector_norm(t))
    return norm * norm, math.isfinite(norm)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def state_bytes(store, params_are_master: bool) -> dict:
    """Optimizer states and gradient shards an optimizer store holds in memory."""
    if not isinstance(store, MemoryOptimizerStore):
        return {"optimizer": 0, "grads": 0}
    n = store.total * 4
    return {"optimizer": 2 * n + (0 if params_are_master else n), "grads": store.grad_bytes()}
