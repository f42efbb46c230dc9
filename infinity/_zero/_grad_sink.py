"""Where the reducer delivers gradients: the optimizer store's shards, and which parameters got
a gradient in this backward."""
from __future__ import annotations

import collections
import enum
from typing import TYPE_CHECKING, List, Optional, Protocol

import torch

from .._offload._optimizer_store import OptimizerStore
from .._runtime import _accelerator as acc
from .._runtime._telemetry_counters import span
from .._runtime._tiers import Tier

if TYPE_CHECKING:
    from ._unit import FetchUnit


GRADS_IN_FLIGHT = 4  # device->host gradient copies the sink lets run ahead of the CPU (Note [gradients to the host])


class Received(enum.Enum):
    """The gradients delivered since the last ``zero_grad`` (Note [aborted backward] in _backward.py)."""

    WHOLE = "whole"  # every backward since then ended
    PARTIAL = "partial"  # one ended by an exception: some of its gradients are in, the rest never came


class GradSink:
    """Where the reducer delivers gradients: each unit's shard gradient accumulated into the
    optimizer store (scaled by 1 / (ranks x accumulation steps)), and which parameters got a
    gradient in this backward (Note [update plan] in _param_groups.py), consumed by the step.

    Note [gradients to the host]: a store in host memory or on NVMe adds gradients on the CPU.
    A shard gradient on the device is copied into pinned memory on the device->host stream;
    before the reducer reuses a bucket (``consumers_done``) the compute stream waits for the
    last copy's event, the CPU does not. The sink adds a landed copy to the store when a later
    gradient arrives, waits for the oldest only when GRADS_IN_FLIGHT staged copies are in
    flight, and lands all of them before the step reads the gradients (``flush``), in the
    order they came (a range accumulated twice keeps its order). A unit's first gradient into
    pinned host memory is copied straight into its range instead, with nothing to add (Note
    [gradients landed in place] in _grad_buffer.py)."""

    def __init__(self, store: OptimizerStore, units: List["FetchUnit"], grad_scale: float, counters):
        self._store = store
        self._host_store = store.tier is not Tier.DEVICE  # the CPU and NVMe tiers read gradients on the CPU
        self._landing: collections.deque = collections.deque()  # (unit, host copy or None, event, scale), oldest first
        self._staged = 0  # copies in ``_landing`` into staging memory (not landed in place), to add on landing
        self.grad_scale = grad_scale
        self._counters = counters
        self._unit_first = _first_param_index(units)
        self.got_grad = torch.zeros(sum(len(u.params) for u in units), dtype=torch.float64)
        self.received = Received.WHOLE
        self.on_landed: Landed = _nobody  # Note [speculative update] in _speculative_update.py

    def note(self, unit: "FetchUnit") -> None:
        """The reducer takes ``unit``'s gradients: flag the parameters that have one."""
        first = self._unit_first[unit.index]
        for j, p in enumerate(unit.params):
            if p.grad is not None:
                self.got_grad[first + j] = 1.0

    def accumulate(self, unit: "FetchUnit", shard_grad: torch.Tensor) -> None:
        self._counters.bytes["grad_offload"] += shard_grad.numel() * shard_grad.element_size()
        if self._host_store and shard_grad.device.type != "cpu":  # Note [gradients to the host]
            slot = self._store.landing_slot(unit.opt_offset, shard_grad.numel())
            if slot is not None:  # Note [gradients landed in place] in _grad_buffer.py
                src = shard_grad if self.grad_scale == 1.0 else shard_grad * self.grad_scale
                self._store.note_norm(unit.opt_offset, torch.linalg.vector_norm(src))
                with span("infinity::copy_to_host", unit.label):
                    _, event = acc.start_copy_to_host(src, out=slot)
                self._counters.bytes["grad_landed_in_place"] += src.numel() * src.element_size()
                self._landing.append((unit, None, event, 1.0))
                self.on_landed(unit, event)
                self._land(wait=False)
                return
            with span("infinity::copy_to_host", unit.label):
                host, event = acc.start_copy_to_host(shard_grad)
            self._landing.append((unit, host, event, self.grad_scale))
            self._staged += 1
            self._land(wait=self._staged > GRADS_IN_FLIGHT)
            return
        with self._counters.blocked("grad_offload", unit.label):
            self._store.accumulate(unit.opt_offset, shard_grad, self.grad_scale)
        self.on_landed(unit, None)

    def _land(self, wait: bool, every: bool = False) -> None:
        """Add the landed copies to the store, oldest first (one copied in place has nothing
        to add); ``wait``: up to the oldest staged copy at least, ``every``: all of them."""
        while self._landing and (wait or self._landing[0][2].query()):
            unit, host, event, scale = self._landing.popleft()
            with self._counters.blocked("grad_offload", unit.label):
                acc.wait_copy_to_host(event)
                if host is not None:
                    with span("infinity::grad_landing", unit.label):
                        self._store.accumulate(unit.opt_offset, host, scale)
                    self._staged -= 1
                    self.on_landed(unit, None)
            wait = every or (wait and host is None)

    def flush(self) -> None:
        """Every gradient delivered so far is in the store."""
        self._land(wait=True, every=True)

    @property
    def in_flight(self) -> int:
        """Device->host copies not yet landed in the store."""
        return len(self._landing)

    def backward_aborted(self) -> None:
        """A backward ended by an exception (Note [aborted backward] in _backward.py): what it
        delivered lands, and the gradients are PARTIAL until ``discard``."""
        self.flush()
        self.received = Received.PARTIAL

    def discard(self) -> None:
        """``zero_grad``: the copies still landing are waited for and dropped (one landing in
        place would write its range after the store dropped it), the flags of which parameters
        got a gradient cleared; the gradients to come are WHOLE again."""
        while self._landing:
            acc.wait_copy_to_host(self._landing.popleft()[2])
        self._staged = 0
        self.got_grad.zero_()
        self.received = Received.WHOLE

    def consumers_done(self) -> None:
        """The reducer is about to rewrite a bucket: device work from here on runs after the
        copies reading it (a stream wait on the newest, which follows the others on its
        stream), and the store's own writes of gradients have landed."""
        if self._landing:
            acc.stream_waits(self._landing[-1][2])
        self._store.wait_grad_writes()


class Landed(Protocol):
    """Told each time a unit's gradients are in the store (``event``: a copy straight into its
    range, still in flight). Provider: ``SpeculativeUpdate.landed``; Note [injected
    operations] in _seams.py."""

    def __call__(self, unit: "FetchUnit", event: Optional[object]) -> None: ...


def _nobody(unit: "FetchUnit", event: Optional[object]) -> None:
    pass


def _first_param_index(units) -> List[int]:
    """Per unit: the index (unit order) of its first parameter, where its gradient flags start."""
    out, n = [], 0
    for unit in units:
        out.append(n)
        n += len(unit.params)
    return out
