"""Stage 3's compute-dtype parameter shards on the NVMe tier: params.swp (or master.swp, the
optimizer's), read into ``HostPool`` buffers when fetched, with the step's fresh output handed
to the next forward (Note [hand-off]), a cache for backward's re-reads (Note [parameter cache])
and a split's host share (Note [split tiers] in _split.py). The resident tiers are
``MemoryParamStore`` in _param_store.py, behind the same protocol (Note [parameter store
protocol] in _param_store.py).
"""

from __future__ import annotations

import bisect
import functools
import threading
from typing import List, Optional

import torch

from .._runtime._recycle import Recycler
from .._runtime._telemetry_counters import seconds_into
from .._runtime._tiers import Tier
from ..aio import aligned_empty
from ..aio._checksum import checksummed, sums_of
from ..aio._handle import close_handles
from ..errors import InvariantError, UsageError
from ._host_pool import HostPool, ShardsUnderCopy
from ._layout import ALIGN_ELEMS, ParamSource, round_up
from ._memory_plan import PARAM_CACHE, PARAM_FILES, PARAM_HANDOFF, PARAM_SHARDS, PARAM_STAGING, totals
from ._ordered_writes import WRITE_HANDLES, MasterFile, OrderedWrites
from ._swap import Swap, nbytes_of, new_aio, wait_io

HANDOFF_BUFFERS = 2  # staging buffers' worth of the step's fresh parameter output kept in memory (Note [hand-off])


class NvmeParamStore:
    """Compute-dtype parameter shards of stage 3 in swap files.

    Note [hand-off]: the shards the optimizer step has just written also stay in host memory,
    up to HANDOFF_BUFFERS staging buffers' worth, oldest dropped first. The next forward
    fetches units in the order the step produces them, so most fetches take their shard from
    there (``take_handoff``: a view) instead of an NVMe read that would compete with the step's
    own I/O, and without a staging buffer. The step puts its fresh values straight into one
    tensor per unit (``step_outputs``), whatever its chunking, and writes and keeps each once
    complete (``step_outputs_done``): so no fetch assembles a unit from two pieces, and a unit
    is published as soon as it is complete (merging small units would delay the first
    fetches). A fetch drops the unit it used up (not needed again before the next step); any
    other write over a range drops what was kept. The unit tensors come back through a
    Recycler (Note [recycled host memory] in _recycle.py).

    Note [parameter cache]: backward fetches every unit again, in reverse order, and without
    a cache each is an NVMe read of the shard forward just read. So a fetch also keeps a copy
    of its shard in host memory (``remember``), whole units first come first kept, up to
    ``cache_elems`` elements (``zero.offload_param.max_in_cpu``, DeepSpeed's knob and unit:
    elements; per rank); a fetch takes its shard from there first (``cached``: a view, no
    read). Entries are never stale: a write over a cached shard (the step's fresh output,
    a checkpoint load, an edit) updates it in place, under the same lock, before the step
    publishes the range (the step gate orders every fetch after that), so the next forward
    is served from it too, and nothing on the disk is read again while the cache covers the
    model. In-place updates are safe for the same reason as the step's in-place master
    update: no fetch holds a unit's shard while the step rewrites it. The cache's memory is
    its own ledger category (``param_cache``), allocated as it fills and never more than
    the cap.
    """

    tier = Tier.NVME

    def __init__(self, dtype: torch.dtype, total: int, *, swap: Swap, aio_cfg, max_unit: int = 0,
                 buffer_size: Optional[int] = None, buffer_count: Optional[int] = None,
                 slots: Optional[List[tuple]] = None, direct_reads: bool = False, update_chunk: int = 0,
                 master: Optional[MasterFile] = None, cache_elems: int = 0, host_upto: int = 0):
        # Note [parameters from the master] in _placement.py: ``master`` is master.swp shared with the NVMe
        # optimizer store (MASTER_FILE)
        self.source = ParamSource.MASTER_FILE if master is not None else ParamSource.OWN
        self.update_chunk = update_chunk  # elements the step updates at a time (its outputs fill per chunk)
        # reads land in the caller's buffers: the pool stays empty (Note [one memory model] in _memory_plan.py)
        self.direct_reads = direct_reads
        self.dtype, self.total = dtype, total
        self._under_copy = ShardsUnderCopy()
        self.bytes_read = 0
        self.cache_elems = cache_elems  # Note [parameter cache]: backward's re-reads
        self.own_from = master.total if master is not None else 0  # below: the master's elements
        # Note [split tiers] in _split.py: the first ``host_upto`` elements (whole units) in host memory only,
        # params.swp from there on
        self.host_upto, self._host = self._host_share(host_upto, master)
        # seconds reads spent obtaining shards from each tier, running totals (Note [engine telemetry keys] in
        # _runtime/_telemetry.py): the host share's, and params.swp's (or master.swp's) reads
        self.tier_seconds = dict.fromkeys(("cpu", "nvme") if self.host_upto else ("nvme",), 0.0)
        self._own: Optional[OrderedWrites] = None  # params.swp's writes, where it exists
        self._files = self._swap_files(swap, aio_cfg, master)
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
        self._handoff: List[tuple] = []  # (offset, tensor) written by the step, oldest first (Note [hand-off])
        self._handoff_cap = HANDOFF_BUFFERS * nbytes_of(self.pool.numel, dtype)
        self._lock = threading.Lock()  # the step's thread writes while the forward reads
        # each trainable unit's slot (Note [frozen parameters] in _layout.py)
        self._spans = [(a, a + n) for a, n in slots or []]
        self._span_starts = [a for a, _ in self._spans]
        self._filling: dict = {}  # span start -> [its output tensor, elements written so far, any changed]
        self._outputs = Recycler(self._handoff_cap, functools.partial(aligned_empty, what=PARAM_HANDOFF))
        self._cache: dict = {}  # unit offset -> its shard in host memory
        self._cached = 0  # elements in _cache

    def _host_share(self, host_upto: int, master: Optional[MasterFile]) -> tuple:
        """(elements, tensor) of the split's host share (Note [split tiers] in _split.py); params.swp follows it."""
        if not host_upto:
            return 0, None
        if master is not None:
            raise InvariantError("a split parameter tier keeps its shards out of master.swp")
        self.own_from = host_upto
        return host_upto, aligned_empty(host_upto, self.dtype, what=PARAM_SHARDS)

    def _swap_files(self, swap: Swap, aio_cfg, master: Optional[MasterFile]) -> List[tuple]:
        """(first element, its ordered writes) of each file the shards are in (Note [write
        ordering] in _ordered_writes.py): under MASTER_FILE master.swp holds the trainable
        units (the first ``master.total`` elements: Note [frozen parameters] in _layout.py), the
        step handing its master values to this tier; params.swp holds the rest, if any (every
        unit where the store keeps its own; the frozen ones under MASTER_FILE: Note
        [parameters from the master] in _placement.py)."""
        files = [] if master is None else [(0, master.writes)]
        if self.total > self.own_from:
            nbytes = nbytes_of(self.total - self.own_from, self.dtype)
            path = checksummed(swap.file("params.swp", nbytes), nbytes,
                               aio_cfg.checksums)  # Note [swap checksums] in aio/_checksum.py
            self._own = OrderedWrites(path, nbytes_of(1, self.dtype), aio_cfg, swap.rank)
            files.append((self.own_from, self._own))
        return files

    def _file_at(self, offset: int) -> tuple:
        """The ordered writes of the file holding element ``offset``, and its offset there."""
        start, writes = self._files[-1] if offset >= self._files[-1][0] else self._files[0]
        return writes, offset - start

    @property
    def path(self) -> str:
        """The first swap file the shards are in (master.swp under MASTER_FILE, else params.swp)."""
        return self._files[0][1].path

    @property
    def own_path(self) -> Optional[str]:
        """params.swp: the shards this store keeps in a file of its own, from element
        ``own_from`` on; None where there is none (Note [parameters from the master] in _placement.py)."""
        return None if self._own is None else self._own.path

    @property
    def memory_elems(self) -> int:
        """The first elements held in host memory: the split's host share (Note [split tiers] in _split.py)."""
        return self.host_upto

    @property
    def bytes_written(self) -> int:
        """Bytes this store wrote to its own file (master.swp's count as the optimizer's:
        Note [parameters from the master] in _placement.py)."""
        return 0 if self._own is None else self._own.bytes_written

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def resident_tensors(self) -> List[torch.Tensor]:
        """The memory tensors that hold every shard: none on NVMe."""
        return []

    def host_share(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        """The shard at ``offset`` as a view of the split's host share (Note [split tiers] in
        _split.py), or None where it is in params.swp. The lookup is the host share's seconds."""
        if self._host is None or offset + numel > self.host_upto:
            return None
        with seconds_into(self.tier_seconds, "cpu"):
            return self._host[offset : offset + numel]

    def write(self, offset: int, values: torch.Tensor, *, keep: bool = False) -> None:
        """Store ``values`` (any float dtype; cast here) at ``offset``, asynchronously. With
        ``keep`` (the optimizer step's fresh output, never modified afterwards) the values
        also stay in memory for the next fetch (Note [hand-off])."""
        if values.dtype != self.dtype:
            values = values.to(self.dtype)
        if offset < self.host_upto:  # Note [split tiers] in _split.py: whole units, never on the disk
            n = min(values.numel(), self.host_upto - offset)
            self._host[offset : offset + n].copy_(values[:n])
            if n == values.numel():
                return
            offset, values = offset + n, values[n:]
        end = offset + values.numel()
        writes, at = self._file_at(offset)
        writes.write(at, values)  # Note [write ordering] in _ordered_writes.py
        with self._lock:
            self._handoff = [(o, t) for o, t in self._handoff if o + t.numel() <= offset or o >= end]
            cached = self._update_cache(offset, values)
            if keep and not cached and values.numel() * values.element_size() <= self._handoff_cap:
                self._handoff.append((offset, values))
                while sum(t.numel() for _, t in self._handoff) * values.element_size() > self._handoff_cap:
                    self._handoff.pop(0)

    def _spans_in(self, offset: int, end: int):
        """The unit spans [a, b) overlapping [offset, end)."""
        i = bisect.bisect_right(self._span_starts, offset) - 1
        while i < len(self._spans) and self._spans[i][0] < end:
            yield self._spans[i]
            i += 1

    def keep_until_copied(self, shard: torch.Tensor, event) -> None:
        """A fetch is done with ``shard`` (a view of host memory: a hand-off, the cache, the
        host share) but its copy to the device may still read it: the view is kept, so the
        memory is not recycled, until the copy's event (Note [buffers under a copy] in _host_pool.py)."""
        self._under_copy.keep(shard, event)

    def wait_copies(self) -> None:
        """Before the step rewrites host shards in place: every copy still reading one has landed."""
        self._under_copy.wait()

    def step_outputs(self, offset: int, numel: int) -> List[tuple]:
        """(start, view) pieces covering [offset, offset + numel): where the optimizer step
        puts its fresh values of that range, slices of one output tensor per unit (Note
        [hand-off]). Report them with ``step_outputs_done`` once written."""
        self._under_copy.pruned()  # views whose copies landed let their tensors be recycled
        out, end = [], offset + numel
        for a, b in self._spans_in(offset, end):
            if a not in self._filling:
                self._filling[a] = [self._outputs.take(b - a, self.dtype), 0, False]
            lo, hi = max(a, offset), min(b, end)
            out.append((lo, self._filling[a][0][lo - a : hi - a]))
        return out

    def step_outputs_done(self, offset: int, numel: int, changed: bool = True) -> int:
        """The values of [offset, offset + numel) are in their ``step_outputs`` views
        (``changed``: the step changed some of them): write and keep every unit now complete,
        unless the step changed none of it, whose shard already holds these values (Note
        [unchanged ranges are not written] in _swap_pipeline.py). Returns the offset
        below which every range the step has produced is written (a unit still filling is
        not, nor anything after it)."""
        end = upto = offset + numel
        for a, b in self._spans_in(offset, end):
            fill = self._filling[a]
            fill[1] += min(b, end) - max(a, offset)
            fill[2] = fill[2] or changed
            if fill[1] == b - a:
                del self._filling[a]
                if fill[2]:
                    self.write(a, fill[0][:], keep=True)  # a view: the write and the kept entry count as users
                self._outputs.give(fill[0])  # reused once they and every fetch's view let go
            else:
                upto = min(upto, a)
        return upto

    def _update_cache(self, offset: int, values: torch.Tensor) -> bool:
        """Note [parameter cache]: a write covering a cached shard (the step writes a unit's
        slot, padding included) updates it; one covering part of it drops it (caller holds
        the lock). True when the cache holds the unit starting at ``offset``, now updated: the
        next fetch is served from it, so keeping the write for it too (Note [hand-off]) would
        hold the same values twice."""
        end = offset + values.numel()
        for o in [o for o, t in self._cache.items() if o < end and o + t.numel() > offset]:
            t = self._cache[o]
            if offset <= o and o + t.numel() <= end:
                t.copy_(values[o - offset : o - offset + t.numel()])
            else:
                self._cached -= self._cache.pop(o).numel()
        return offset in self._cache

    def cached(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        """The shard at ``offset`` from the parameter cache, if it holds it (Note [parameter cache])."""
        if not self.cache_elems:
            return None
        with self._lock:
            t = self._cache.get(offset)
        return t if t is not None and t.numel() == numel else None

    def remember(self, offset: int, shard: torch.Tensor) -> None:
        """Keep a copy of a fetched shard in the parameter cache while it has room (Note
        [parameter cache]); a full cache keeps what it has."""
        n = shard.numel()
        with self._lock:
            if offset in self._cache or self._cached + n > self.cache_elems:
                return
            self._cached += n
        t = aligned_empty(n, self.dtype, what=PARAM_CACHE, hugepage=n * self.itemsize >= 2 << 20)
        t.copy_(shard)
        with self._lock:
            self._cache[offset] = t

    def release_idle(self) -> None:
        """The step's returned output tensors give their pages back until it takes them again
        (Note [released pages] in aio/_memory.py)."""
        self._outputs.release_idle()

    def take_handoff(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        """[offset, offset + numel) as a view of the step's kept output, if a kept unit
        tensor holds it all. A fetch of that unit (the range starts where the tensor does)
        uses it up, so it is dropped (Note [hand-off])."""
        end = offset + numel
        with self._lock:
            for i, (o, t) in enumerate(self._handoff):
                if o <= offset and end <= o + t.numel():
                    if o == offset:
                        del self._handoff[i]
                    return t[offset - o : end - o]
        return None

    def flush(self, offset: int = 0, numel: Optional[int] = None, *, block: bool = True) -> bool:
        """Wait for every write so far (over [offset, offset + numel) only, if given). Without
        ``block``, False instead of waiting while one is still in flight."""
        return self._writes_landed(offset, self.total - offset if numel is None else numel, block=block)

    def checkpoint_parts(self) -> List[tuple]:
        """(source, elements) that make up the shards for a checkpoint (Note [checkpoint
        layout] in _checkpoint/_format.py), in order, once every write has landed: the split's
        host share, if any, then each swap file (under MASTER_FILE master.swp, then params.swp:
        Note [parameters from the master] in _placement.py)."""
        self.flush()
        bounds = [start for start, _ in self._files[1:]] + [self.total]
        host = [(self._host, self.host_upto)] if self._host is not None else []  # Note [split tiers] in _split.py
        return host + [(w.path, stop - start) for (start, w), stop in zip(self._files, bounds)]

    def own_part(self) -> Optional[tuple]:
        """(destination, first element) of the shards this store keeps itself, which a
        checkpoint load rewrites; None where master.swp holds them all (Note [parameters from
        the master] in _placement.py)."""
        self.flush()
        if self._host is not None:  # the split's host share, then params.swp (Note [split tiers] in _split.py)
            rest = [(self._own.path, self.total - self.host_upto)] if self._own is not None else []
            return [(self._host, self.host_upto)] + rest, 0
        return None if self._own is None else (self._own.path, self.own_from)

    def checkpoint_loaded(self) -> None:
        """A checkpoint rewrote the shards: what the step handed off is stale (Note [hand-off]),
        and so are the units a failed step left filling (Note [failed step] in _step_gate.py)."""
        with self._lock:
            self._handoff = []
            self._cache, self._cached = {}, 0
        filling, self._filling = self._filling, {}
        for fill in filling.values():
            self._outputs.give(fill[0])

    def _writes_landed(self, offset: int, numel: int, *, block: bool) -> bool:
        end = offset + numel  # Note [write ordering] in _ordered_writes.py
        for i, (start, writes) in enumerate(self._files):
            stop = self._files[i + 1][0] if i + 1 < len(self._files) else self.total
            lo, hi = max(offset, start), min(end, stop)
            if lo < hi and not writes.landed(lo - start, hi - lo, block=block):
                return False
        return True

    def start_read(self, offset: int, numel: int, *, block: bool = True, into: Optional[torch.Tensor] = None):
        """Submit NVMe -> a pool buffer (or ``into``, aligned host memory of the caller's);
        None when ``block`` is off and the range's writes are still landing or no buffer is
        free. ``finish_read`` returns the buffer; the caller gives a pool buffer back with
        ``pool.put``. Its seconds, waits for the range's writes and a buffer included, are the NVMe tier's."""
        with seconds_into(self.tier_seconds, "nvme"):
            if not self._writes_landed(offset, numel, block=block):
                return None
            buf = self.pool.get(numel, block=block) if into is None else into
            if buf is None:
                return None
            reader = self._readers.pop()
            writes, at = self._file_at(offset)
            reader.pread(buf[:numel], writes.path, at * self.itemsize)
            self.bytes_read += numel * self.itemsize
            return buf, reader, into is None

    def read(self, offset: int, numel: int) -> torch.Tensor:
        """A copy of [offset, offset + numel), once every write to it has landed."""
        host = self.host_share(offset, numel)
        if host is not None:
            return host.clone()
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
            with seconds_into(self.tier_seconds, "nvme"):  # the read landing
                wait_io(reader, what or "a parameter shard read")
        except Exception:
            if pooled:
                self.pool.put(buf)
            raise
        finally:
            self._readers.append(reader)
        return buf

    def nbytes(self) -> dict:
        return totals(self.plan(self.total, self.itemsize, self.pool.numel, 0 if self.direct_reads else self.pool.count,
                                self.update_chunk, self.source, cache=self.cache_elems,
                                frozen=self.total - self.own_from, host_upto=self.host_upto))

    def close(self) -> None:
        """Close the I/O handles (Note [closing handles] in aio/_handle.py)."""
        for _, writes in self._files:
            writes.close()
        close_handles(self._all_readers)
        # Note [closed engines] in _engine.py: the cache, hand-off and staging memory goes now
        self._cache, self._cached = {}, 0
        self._host = None
        self._handoff = []
        self._filling = {}
        self._outputs.clear()
        self.pool.clear()

    def checksums(self) -> dict:
        """The block sums of the swap file by its name (Note [swap checksums] in aio/_checksum.py)."""
        sums = sums_of(self.own_path) if self.own_path else None  # master.swp's sums are the optimizer's
        return {"params": sums} if sums else {}

    @staticmethod
    def plan(total: int, itemsize: int, buffer_numel: int, buffer_count: int, chunk: int = 0,
             source: ParamSource = ParamSource.OWN, cache: int = 0, frozen: int = 0, host_upto: int = 0) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory_plan.py): the shards' files, the
        staging pool, and the step's output tensors (``handoff_bound``). ``source`` MASTER_FILE:
        the trainable shards are the optimizer's master.swp, and only the ``frozen`` elements
        after them have a file of their own (Note [parameters from the master] in
        _placement.py); ``cache``: elements of the parameter cache (Note [parameter cache]);
        ``host_upto``: the split's host share, shards in host memory with no file behind them
        (Note [split tiers] in _split.py)."""
        files = frozen * itemsize if source is ParamSource.MASTER_FILE else (total - host_upto) * itemsize
        return {"nvme": {PARAM_FILES: files}, "host": {PARAM_SHARDS: host_upto * itemsize,
                                                       PARAM_CACHE: min(cache, total - host_upto) * itemsize,
                                                       PARAM_STAGING: buffer_count * buffer_numel * itemsize,
                                                       PARAM_HANDOFF: handoff_bound(total, buffer_numel, chunk) * itemsize}}


def handoff_bound(total: int, buffer_numel: int, chunk: int) -> int:
    """Elements of the step's output tensors alive at once (Note [hand-off]): those the
    recycler holds, kept ones among them (HANDOFF_BUFFERS buffers' worth), those written and
    not yet collected (WRITE_HANDLES units: ``OrderedWrites._reap``), those filling (the units of one
    update chunk, and one unit at each end), and as many again as a forward may still read
    after taking them. A cap, not a typical figure: a model whose units are all small holds
    about its whole parameter space of them (``total``), a large one less."""
    slot = round_up(buffer_numel, ALIGN_ELEMS)  # an output tensor spans a unit's slot, padding included
    return (2 * HANDOFF_BUFFERS + WRITE_HANDLES + 2) * slot + chunk
