"""A fetch unit's shard on its way to the device: the payload of its HOST and DEVICE states
(Note [unit payloads] in _unit.py), one tagged type (Note [staging kinds])."""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch

from .._offload._nvme_param_store import NvmeParamStore
from ..errors import InvariantError

if TYPE_CHECKING:
    from .._offload._param_store import ParamStore


class Source(enum.Enum):
    """Where a staged shard's bytes come from: the kind of a ``Staging``."""

    RESIDENT = "resident"  # the parameter store's own tensor (device or cpu tier): nothing to read
    CACHED = "cached"  # the parameter cache's copy (Note [parameter cache] in _nvme_param_store.py)
    HANDED_OFF = "handed_off"  # the shard the step handed off (Note [hand-off] in _nvme_param_store.py)
    POOL_READ = "pool_read"  # NVMe: read into a buffer of the store's staging pool, given back after the copy
    DIRECT_READ = "direct_read"  # NVMe, one rank, no accelerator: read straight into a recycled gathered buffer


READS = (Source.POOL_READ, Source.DIRECT_READ)
HOLDS_HOST = (Source.CACHED, Source.HANDED_OFF, Source.DIRECT_READ)  # ``host`` set from the start


@dataclass(frozen=True, eq=False)
class OnDevice:
    """The device half of a staging: the shard on the device and the event of its copy."""

    shard: torch.Tensor
    h2d: object  # the event of its host->device copy
    source: Optional[torch.Tensor]  # the host tensor the copy reads (None: no copy, the host tensor is the shard)

    @property
    def copied(self) -> bool:
        return self.source is not None


@dataclass(frozen=True, eq=False)
class Staging:
    """The payload of HOST and DEVICE: this rank's shard on its way to the device.

    Note [staging kinds]: one tagged type. ``kind`` says where the bytes come from, and
    ``__post_init__`` refuses a field the kind does not have, so no combination of fields
    stands for a kind. It is built by one constructor per kind and moves on only through
    ``landed`` (the read is done) and ``on_device`` (the copy started), each a new payload,
    checked again. Every rule that depends on the kind is answered here (what the copy
    reads, whether the parameter cache takes it, whether the gathered parameters may be
    views of it and are new device memory, what goes back where once it is consumed), so
    the fetch unit never tests ``kind`` and a new kind changes this module and the place
    that builds it."""

    kind: Source
    host: Optional[torch.Tensor] = None  # CACHED, HANDED_OFF: the shard; DIRECT_READ: the gathered buffer
    # read into; POOL_READ: the pool buffer, once the read has landed; RESIDENT: none
    read: object = None  # POOL_READ, DIRECT_READ: the read in flight (None once it has landed)
    device: Optional[OnDevice] = None  # DEVICE (and GATHERING): the copy started

    def __post_init__(self) -> None:
        wrong = None
        if self.read is not None and self.kind not in READS:
            wrong = "a read in flight"
        elif (self.host is None) == (self.kind in HOLDS_HOST) and self.kind is not Source.POOL_READ:
            wrong = "a host tensor" if self.host is not None else "no host tensor"
        elif self.kind is Source.POOL_READ and (self.read is None) == (self.host is None):
            wrong = "both a read in flight and its buffer" if self.read is not None else "neither a read nor a buffer"
        elif self.device is not None and self.read is not None:
            wrong = "a device shard while its read is in flight"
        if wrong:
            raise InvariantError(f"a {self.kind.name} staging with {wrong}")

    @classmethod
    def resident(cls) -> "Staging":
        return cls(Source.RESIDENT)

    @classmethod
    def cached(cls, shard: torch.Tensor) -> "Staging":
        return cls(Source.CACHED, host=shard)

    @classmethod
    def handed_off(cls, shard: torch.Tensor) -> "Staging":
        return cls(Source.HANDED_OFF, host=shard)

    @classmethod
    def pool_read(cls, read: object) -> "Staging":
        return cls(Source.POOL_READ, read=read)

    @classmethod
    def direct_read(cls, read: object, into: torch.Tensor) -> "Staging":
        return cls(Source.DIRECT_READ, host=into, read=read)

    @property
    def in_flight(self) -> bool:
        return self.read is not None

    def landed(self, buffer: torch.Tensor) -> "Staging":
        """The read is done; ``buffer`` is what the store's read returned (the pool buffer it
        filled; a direct read's buffer is ``host`` already)."""
        return replace(self, read=None, host=buffer if self.kind is Source.POOL_READ else self.host)

    def host_shard(self, numel: int) -> Optional[torch.Tensor]:
        """The host tensor the device copy reads (None for RESIDENT: the store's own shard)."""
        if self.host is None or self.kind not in READS:
            return self.host
        return self.host[:numel]  # a read's buffer may be longer than the shard

    def on_device(self, shard: torch.Tensor, h2d: object, source: torch.Tensor) -> "Staging":
        """The copy of ``source`` to the device started (``shard`` is ``source`` without one)."""
        return replace(self, device=OnDevice(shard, h2d, source if shard is not source else None))

    @property
    def to_cache(self) -> bool:
        """Offered to the parameter cache once on its way (not resident, not the cache's own copy)."""
        return self.kind not in (Source.RESIDENT, Source.CACHED)

    @property
    def recycled(self) -> Optional[torch.Tensor]:
        """A DIRECT_READ's gathered buffer, given back to the recycler when unused or freed."""
        return self.host if self.kind is Source.DIRECT_READ else None

    def _on(self, what: str) -> OnDevice:
        if self.device is None:
            raise InvariantError(f"{what}: a {self.kind.name} staging whose copy to the device has not started")
        return self.device

    def gathers_in_place(self, world_size: int) -> bool:
        """Whether the gathered parameters are views of the device shard: on one rank, unless
        the shard is a staging buffer that goes back to its pool (no accelerator, NVMe tier)."""
        copied = self._on("gathers_in_place").copied
        return world_size == 1 and (self.kind is not Source.POOL_READ or copied)  # Note [one rank] in _runtime/_comm.py

    def new_memory(self, world_size: int) -> bool:
        """Whether the gathered parameters are memory of their own, charged to the device
        budget: a buffer of the all-gather, a copy, the cache's copy, the step's hand-off, or
        the gathered buffer a direct read filled (not the parameter store's own tensor)."""
        copied = self._on("new_memory").copied
        return not self.gathers_in_place(world_size) or copied or self.kind in HOLDS_HOST

    def give_back_unused(self, store: "ParamStore") -> None:
        """A landed HOST staging abandoned before any copy to the device (which may not fit:
        out of device memory): a pool buffer goes back to the pool at once, nothing reads it."""
        if self.in_flight or self.device is not None:
            raise InvariantError("give_back_unused: a staging whose read is in flight or whose copy started")
        if self.kind is Source.POOL_READ:
            self._to_pool(store)

    def _to_pool(self, store: "ParamStore", after=None) -> None:
        """A POOL_READ's buffer goes back to the NVMe store's staging pool (``after``: the copy's event)."""
        if not isinstance(store, NvmeParamStore) or self.host is None:
            raise InvariantError(f"a POOL_READ staging without its buffer, or a {type(store).__name__} (no pool)")
        store.pool.put(self.host, after=after)

    def give_back(self, store: "ParamStore") -> None:
        """The device shard was consumed (gathered, or abandoned): its host source goes back
        with the copy's event, reused only once the copy has landed (Note [buffers under a
        copy] in _offload/_host_pool.py); no CPU wait here. A pool buffer returns to the store's
        pool; any other host tensor a copy read is kept alive until the copy is done."""
        on = self._on("give_back")
        if self.kind is Source.POOL_READ:
            self._to_pool(store, after=on.h2d)
        elif on.source is not None:  # copied
            store.keep_until_copied(on.source, on.h2d)
