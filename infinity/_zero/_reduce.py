"""Gradient reduce-scatter in fixed buckets, overlapped with backward, in the same order on every rank.

Note [bucket plan]: a reduce-scatter is a collective, so every rank must launch the same
buckets, with the same units, in the same order, even when ranks run different code (an
expert no token of this rank was routed to, a branch taken on one rank only). Which units
get gradients, and in what order, is a local fact; so the buckets are planned once, from
the units alone: consecutive units in reverse unit order (the order backward usually
produces them), each bucket at most ``bucket_elems`` elements of full gradients (a unit
bigger than that is a bucket of its own). A unit whose gradients are complete is copied into
its bucket's buffer and its full gradients are freed; bucket i is launched once all its
units are in and buckets 0..i-1 are launched. At the end of backward (``finish``) the
units that got no gradient on this rank join their buckets as zeros, so every rank launches
every bucket (DDP's ``find_unused_parameters`` does the same). Units without a trainable
parameter are in no bucket. Gradients that arrive after their unit joined its bucket (Note
[used again in one backward] in _backward.py) stay in ``.grad`` until ``finish``, which agrees
across ranks on the units that have any (one small all-reduce) and reduces those in plan
order.

Whenever a unit arrives, buckets whose reduce-scatter has finished are folded into the fp32
gradient shards (``accumulate``: the offload to host or NVMe, itself asynchronous on NVMe),
so the offload of older gradients runs while backward computes newer ones. At most
``max_inflight`` buckets are in flight; beyond that the oldest is waited on. Bucket buffers
come from a ring of ``bucket_elems``-sized buffers reused across buckets; a backward that
produces gradients far from the planned order holds more buckets open, each with a buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._telemetry_counters import span
from ..errors import InvariantError
from ._seams import AccumulateShard, Action, NoteUnit
from ._unit import FetchUnit


@dataclass(eq=False)
class _Bucket:
    units: List[Tuple[FetchUnit, int]] = field(default_factory=list)  # (unit, column offset), planned
    cols: int = 0
    arrived: int = 0  # units of this backward in the buffer (or handed over directly)
    direct: set = field(default_factory=set)  # units accumulated without the bucket (one rank)
    full: Optional[torch.Tensor] = None  # (world_size, cols) buffer, from the first arrival


@dataclass
class _InFlight:
    handle: comm.CommHandle
    out: torch.Tensor
    bucket: _Bucket
    full: torch.Tensor  # kept alive until the collective is done


def plan_buckets(units: List[FetchUnit], world_size: int, bucket_elems: int) -> List[_Bucket]:
    """Note [bucket plan]: consecutive units with a trainable parameter, in reverse order."""
    buckets, cur = [], _Bucket()
    for unit in reversed(units):
        if not any(p.requires_grad for p in unit.params) or unit.shard_numel == 0:
            continue
        if cur.units and (cur.cols + unit.shard_numel) * world_size > bucket_elems:
            buckets.append(cur)
            cur = _Bucket()
        cur.units.append((unit, cur.cols))
        cur.cols += unit.shard_numel
    if cur.units:
        buckets.append(cur)
    return buckets


class GradReducer:
    """Reduce-scatters unit gradients into ``accumulate(unit, shard_grad)``."""

    def __init__(self, units: List[FetchUnit], world_size: int, bucket_elems: int,
                 accumulate: AccumulateShard, *, drop_full_grads: bool, max_inflight: int = 2,
                 consumers_done: Action = lambda: None, on_add: NoteUnit = lambda u: None):  # Note [injected
        # operations] in _seams.py
        self.world_size = world_size
        self.bucket_elems = max(1, bucket_elems)
        self.accumulate = accumulate
        self.drop_full_grads = drop_full_grads
        self.max_inflight = max_inflight
        self.consumers_done = consumers_done  # waits until nothing reads a completed bucket any more
        self.on_add = on_add  # sees each unit's gradients before they are taken (which parameters have one)
        self._units = list(units)
        self.buckets = plan_buckets(units, world_size, self.bucket_elems)
        self._where: Dict[FetchUnit, Tuple[_Bucket, int]] = {u: (b, col) for b in self.buckets for u, col in b.units}
        self._added: set = set()  # units in this backward's buckets
        self._late: set = set()  # units with gradients accumulated after they joined their bucket
        self._next = 0  # the first bucket not launched yet
        self._inflight: List[_InFlight] = []
        # Note: bucket buffers are allocated once and reused: fresh 100s-of-MB buffers every
        # flush cost more in page faults than the copies into them.
        self._ring: List[torch.Tensor] = []
        self._ring_allocated = 0
        self._ring_dirty = False  # a reused buffer may still be read by an async consumer

    def add(self, unit: FetchUnit) -> None:
        """``unit``'s gradients are complete on this rank. A second call in one backward
        brings gradients accumulated since the first (a parameter used in two reentrant
        checkpoints gets one accumulation per inner backward): they stay in ``.grad`` until
        ``finish`` reduces them (Note [bucket plan])."""
        if unit not in self._where:
            return
        if unit in self._added:
            self._late.add(unit)
            return
        self.on_add(unit)
        while self._inflight and self._inflight[0].handle.done():
            self._complete(self._inflight.pop(0))  # reduced already: offload it now
        self._added.add(unit)
        self._join(unit)

    def _reduce_late(self) -> None:
        """The late gradients of every rank, unit by unit in plan order: which units have
        some is agreed first (one small all-reduce), so every rank launches the same
        reduce-scatters, zeros where it has none."""
        units = [u for b in self.buckets for u, _ in b.units]
        late = [u in self._late for u in units]
        if self.world_size > 1:  # Note [one rank] in _runtime/_comm.py
            flags = torch.tensor(late, dtype=torch.float32)
            comm.all_reduce(flags, "sum")
            late = (flags > 0).tolist()
        for unit, is_late in zip(units, late):
            if not is_late:
                continue
            self.on_add(unit)
            own = unit.own_shard_grad()
            if own is not None:
                self.accumulate(unit, own)
            else:
                bucket = _Bucket(units=[(unit, 0)], cols=unit.shard_numel)
                bucket.full = torch.empty(self.world_size, unit.shard_numel, dtype=torch.float32, device=acc.device())
                unit.grads_into(bucket.full)
                self._launch(bucket)
            if self.drop_full_grads:
                unit.drop_grads()
        while self._inflight:
            self._complete(self._inflight.pop(0))

    def _join(self, unit: FetchUnit) -> None:
        """Put ``unit``'s gradients (zeros where it has none) into its planned bucket."""
        bucket, col = self._where[unit]
        own = unit.own_shard_grad()
        if own is not None:  # one rank, one parameter: its gradient is the shard gradient, no bucket copy
            self.accumulate(unit, own)
            bucket.direct.add(unit)
        else:
            if bucket.full is None:
                bucket.full = self._buffer(self.world_size, bucket.cols)
            unit.grads_into(bucket.full[:, col : col + unit.shard_numel])
        if self.drop_full_grads:
            unit.drop_grads()
        bucket.arrived += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in plan order, every bucket whose units are all in (Note [bucket plan])."""
        while self._next < len(self.buckets) and self.buckets[self._next].arrived == len(self.buckets[self._next].units):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if len(bucket.direct) == len(bucket.units):
            self._reset(bucket)
            return
        full = bucket.full
        if full is None:  # a unit that is not direct arrived, and the first arrival allocates the buffer
            raise InvariantError(f"reduce bucket of {len(bucket.units)} units launched without its buffer")
        # One rank: the bucket is its own shard; no second buffer, no copy (Note [one rank] in _runtime/_comm.py).
        out = full.view(-1) if self.world_size == 1 else torch.empty(bucket.cols, dtype=torch.float32,
                                                                       device=acc.device())
        names = ", ".join(u.module_name or "<root>" for u, _ in bucket.units[:3])
        with span("infinity::reduce_scatter", names):
            handle = comm.reduce_scatter_tensor(out, full.view(-1), async_op=True,
                                                what=f"reduce-scatter of gradients of [{names}...]")
        self._inflight.append(_InFlight(handle, out, bucket, full))
        while len(self._inflight) > self.max_inflight or (self._inflight and self._inflight[0].handle.done()):
            self._complete(self._inflight.pop(0))

    def reduce_all(self) -> None:
        """Stage 1 (nothing reduced in backward): every unit's gradients, just before the step."""
        for unit in self._units:
            self.add(unit)
        self.finish()

    def finish(self) -> None:
        """End of backward: units without gradients on this rank join as zeros, every bucket
        is launched and waited for; every gradient shard is then up to date."""
        for bucket in self.buckets[self._next :]:
            for unit, _ in bucket.units:
                if unit not in self._added:
                    self._added.add(unit)
                    self._join(unit)
        self._launch_ready()
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._reduce_late()
        self._added.clear()
        self._late.clear()
        self._next = 0

    @property
    def idle(self) -> bool:
        """Nothing of a backward is here: no unit added, no bucket filled, no reduce-scatter in flight."""
        return not (self._added or self._late or self._inflight or self._next) and \
            all(b.full is None and not b.arrived and not b.direct for b in self.buckets)

    def abandon(self) -> None:
        """Note [aborted backward] in _backward.py: the backward ended by an exception. The
        reduce-scatters in flight are waited for (their buffers go back to the ring) and
        dropped with the partial buckets and this backward's sets; no collective is launched."""
        inflight, self._inflight = self._inflight, []
        buffers = {id(item.full): item.full for item in inflight}
        buffers.update((id(b.full), b.full) for b in self.buckets if b.full is not None)
        for bucket in self.buckets:
            self._reset(bucket)
        self._added.clear()
        self._late.clear()
        self._next = 0
        error = None
        for item in inflight:
            try:
                item.handle.wait()
            except Exception as e:  # noqa: BLE001 - every one is waited for; the first error is raised
                error = error or e
        for full in buffers.values():
            self._recycle(full)
        if error is not None:
            raise error

    def _complete(self, item: _InFlight) -> None:
        item.handle.wait()
        bucket = item.bucket
        for unit, col in bucket.units:
            if unit not in bucket.direct:
                self.accumulate(unit, item.out[col : col + unit.shard_numel])
        self._reset(bucket)
        if not self._recycle(item.full):  # a one-off buffer for a unit bigger than a bucket: free it once read
            self.consumers_done()

    def _recycle(self, full: torch.Tensor) -> bool:
        """Give a bucket's buffer back to the ring; False for a one-off buffer (not the ring's)."""
        base = full._base if full._base is not None else full
        if base.numel() != self.bucket_elems or base is full:
            return False
        self._ring.append(base)
        self._ring_dirty = True  # an asynchronous consumer may still read it
        return True

    @staticmethod
    def _reset(bucket: _Bucket) -> None:
        bucket.full = None
        bucket.arrived = 0
        bucket.direct = set()

    def _buffer(self, rows: int, cols: int) -> torch.Tensor:
        """An (rows, cols) fp32 bucket from the ring (a one-off buffer if it does not fit)."""
        n = rows * cols
        if n > self.bucket_elems:
            return torch.empty(rows, cols, dtype=torch.float32, device=acc.device())
        if not self._ring and self._inflight and self._ring_allocated > self.max_inflight:
            self._complete(self._inflight.pop(0))  # every buffer is in flight: complete the oldest
        if not self._ring:
            self._ring_allocated += 1
            return torch.empty(self.bucket_elems, dtype=torch.float32, device=acc.device())[:n].view(rows, cols)
        if self._ring_dirty:
            self.consumers_done()
            self._ring_dirty = False
        return self._ring.pop()[:n].view(rows, cols)
