"""Gradient reduce-scatter in constant-size buckets, overlapped with backward.

Units whose gradients are complete are appended to the open bucket; once the bucket holds
``bucket_elems`` elements (of the full gradients) its reduce-scatter is launched
asynchronously and the full gradients are freed. Whenever a unit arrives, buckets whose
reduce-scatter has finished are folded into the fp32 gradient shards (``accumulate``: the
offload to host or NVMe, itself asynchronous on NVMe), so the offload of older gradients
runs while backward computes newer ones. At most ``max_inflight`` buckets are in flight;
beyond that the oldest is waited on, so memory stays bounded by the bucket size whatever the
model size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Tuple

import torch

from . import _accelerator as acc
from . import _comm as comm
from ._unit import FetchUnit


@dataclass
class _Bucket:
    units: List[Tuple[FetchUnit, int]] = field(default_factory=list)  # (unit, column offset)
    cols: int = 0


@dataclass
class _InFlight:
    handle: comm.CommHandle
    out: torch.Tensor
    units: List[Tuple[FetchUnit, int]]
    full: torch.Tensor  # kept alive until the collective is done


class GradReducer:
    """Reduce-scatters unit gradients into ``accumulate(unit, shard_grad)``."""

    def __init__(self, world_size: int, bucket_elems: int, accumulate: Callable[[FetchUnit, torch.Tensor], None],
                 *, drop_full_grads: bool, max_inflight: int = 2, consumers_done: Callable[[], None] = lambda: None):
        self.world_size = world_size
        self.bucket_elems = max(1, bucket_elems)
        self.accumulate = accumulate
        self.drop_full_grads = drop_full_grads
        self.max_inflight = max_inflight
        self.consumers_done = consumers_done  # waits until nothing reads a completed bucket any more
        self._open = _Bucket()
        self._inflight: List[_InFlight] = []
        # Note: bucket buffers are allocated once and reused: fresh 100s-of-MB buffers every
        # flush cost more in page faults than the copies into them.
        self._ring: List[torch.Tensor] = []
        self._ring_allocated = 0
        self._ring_dirty = False  # a reused buffer may still be read by an async consumer

    def add(self, unit: FetchUnit) -> None:
        while self._inflight and self._inflight[0].handle.done():
            self._complete(self._inflight.pop(0))  # reduced already: offload it now
        own = unit.own_shard_grad()
        if own is not None:  # one rank, one parameter: its gradient is the shard gradient, no bucket copy
            self.accumulate(unit, own)
            if self.drop_full_grads:
                unit.drop_grads()
            return
        if self._open.units and (self._open.cols + unit.shard_numel) * self.world_size > self.bucket_elems:
            self.flush()  # keep every bucket within bucket_elems, so it fits a ring buffer
        self._open.units.append((unit, self._open.cols))
        self._open.cols += unit.shard_numel
        if self._open.cols * self.world_size >= self.bucket_elems:
            self.flush()

    def flush(self) -> None:
        """Launch the reduce-scatter of the open bucket."""
        bucket, self._open = self._open, _Bucket()
        if not bucket.units:
            return
        full = self._buffer(self.world_size, bucket.cols)
        for unit, col in bucket.units:
            unit.grads_into(full[:, col : col + unit.shard_numel])
            if self.drop_full_grads:
                unit.drop_grads()
        # One rank: the bucket is its own shard; no second buffer, no copy.
        out = full.view(-1) if self.world_size == 1 else torch.empty(bucket.cols, dtype=torch.float32,
                                                                       device=acc.device())
        names = ", ".join(u.module_name or "<root>" for u, _ in bucket.units[:3])
        handle = comm.reduce_scatter_tensor(out, full.view(-1), async_op=True,
                                            what=f"reduce-scatter of gradients of [{names}...]")
        self._inflight.append(_InFlight(handle, out, bucket.units, full))
        while len(self._inflight) > self.max_inflight or (self._inflight and self._inflight[0].handle.done()):
            self._complete(self._inflight.pop(0))

    def finish(self) -> None:
        """Flush and wait for everything; every gradient shard is then up to date."""
        self.flush()
        while self._inflight:
            self._complete(self._inflight.pop(0))

    def _complete(self, item: _InFlight) -> None:
        item.handle.wait()
        for unit, col in item.units:
            self.accumulate(unit, item.out[col : col + unit.shard_numel])
        base = item.full._base if item.full._base is not None else item.full
        if base.numel() == self.bucket_elems:
            self._ring.append(base)
            self._ring_dirty = True
        else:  # a one-off buffer for a unit bigger than a bucket: free it as soon as it is read
            self.consumers_done()

    def _buffer(self, rows: int, cols: int) -> torch.Tensor:
        """An (rows, cols) fp32 bucket from the ring (a one-off buffer if it does not fit)."""
        n = rows * cols
        if n > self.bucket_elems:
            return torch.empty(rows, cols, dtype=torch.float32, device=acc.device())
        if not self._ring and self._ring_allocated <= self.max_inflight:
            self._ring_allocated += 1
            return torch.empty(self.bucket_elems, dtype=torch.float32, device=acc.device())[:n].view(rows, cols)
        if not self._ring:  # every buffer is in flight: complete the oldest
            self._complete(self._inflight.pop(0))
        if self._ring_dirty:
            self.consumers_done()
            self._ring_dirty = False
        return self._ring.pop()[:n].view(rows, cols)
