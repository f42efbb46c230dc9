"""The compute-dtype parameter shards of stage 3 on their tier.

Flat, unit after unit at ``unit.param_offset`` (Note [shard layout] in _unit.py, Note [frozen
parameters] in _layout.py). ``MemoryParamStore`` holds them in device or host memory
(``none``/``cpu``); the NVMe tier is ``NvmeParamStore`` in _nvme_param_store.py. Both take the
optimizer's fused low-precision output piece by piece (``step_outputs``), so the step writes
each shard once, without another pass.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol

import torch

from .._runtime import _accelerator as acc
from .._runtime._telemetry_counters import seconds_into
from .._runtime._tiers import Tier
from ..aio import aligned_empty
from ..errors import InvariantError
from ._host_pool import ShardsUnderCopy
from ._layout import ParamSource
from ._memory_plan import PARAM_SHARDS, totals
from ._nvme_param_store import NvmeParamStore


class ParamStore(Protocol):
    """Note [parameter store protocol]: what the units, the optimizer step, the parameter
    edits and the checkpoints ask of stage 3's shards, in memory (``MemoryParamStore``) or on
    NVMe (``NvmeParamStore``). Offsets and lengths are elements of this rank's flat parameter
    space (``unit.param_offset``). A fetch from NVMe asks the NVMe store for more (its host
    share, cache, hand-off and reads: ``FetchUnit._stage_from_nvme``); every other reader asks
    only this, and ``tier`` (``Tier.resident``) where it must tell the two apart."""

    tier: Tier  # where the shards live: the device, host memory or NVMe
    dtype: torch.dtype
    total: int
    source: ParamSource  # Note [parameters from the master] in _placement.py
    own_from: int  # below: the master's elements (MASTER, MASTER_FILE) or a split's host share
    host_upto: int  # a split's host share (Note [split tiers] in _split.py); 0 on a resident tier
    cache_elems: int  # Note [parameter cache] in _nvme_param_store.py; 0 on a resident tier
    bytes_read: int
    tier_seconds: Dict[str, float]  # fetches' seconds per tier: Note [engine telemetry keys] in _telemetry.py

    @property
    def bytes_written(self) -> int: ...  # to this store's own file

    @property
    def itemsize(self) -> int: ...

    @property
    def own_path(self) -> Optional[str]: ...  # params.swp, where there is one

    @property
    def memory_elems(self) -> int: ...  # the first elements held in memory (all, or a split's host share)

    def resident_tensors(self) -> List[torch.Tensor]: ...  # the memory tensors holding every shard

    def write(self, offset: int, values: torch.Tensor, *, keep: bool = False) -> None: ...

    def read(self, offset: int, numel: int) -> torch.Tensor: ...  # a copy, once its writes landed

    def flush(self, offset: int = 0, numel: Optional[int] = None, *, block: bool = True) -> bool: ...

    # Note [buffers under a copy] in _host_pool.py: host views a copy to the device may still read
    def keep_until_copied(self, shard: torch.Tensor, event) -> None: ...

    def wait_copies(self) -> None: ...

    # the optimizer step's fresh values: where to put them, and that they are there
    def step_outputs(self, offset: int, numel: int) -> List[tuple]: ...

    def step_outputs_done(self, offset: int, numel: int, changed: bool = True) -> int: ...

    # memory: what sits idle through the activation peak (Note [released pages] in aio/_memory.py)
    def release_idle(self) -> None: ...

    # checkpoints, accounting, shutdown (Note [checkpoint layout] in _checkpoint/_format.py)
    def checkpoint_parts(self) -> List[tuple]: ...

    def own_part(self) -> Optional[tuple]: ...

    def checkpoint_loaded(self) -> None: ...

    def checksums(self) -> dict: ...

    def nbytes(self) -> dict: ...

    def close(self) -> None: ...


class MemoryParamStore:
    """Stage 3's shards as flat tensors in device or host memory. Under MASTER (``alias``, the
    optimizer's fp32 master tensor: Note [parameters from the master] in _placement.py) the
    trainable units' shards are the master itself and the frozen units' follow in a tensor of
    their own. The step writes its fresh values in place (``step_outputs`` are views)."""

    host_upto = 0
    cache_elems = 0

    def __init__(self, tier: Tier, dtype: torch.dtype, total: int, *, alias: Optional[torch.Tensor] = None):
        tier = Tier.of(tier)
        if not tier.resident:
            raise InvariantError(f"MemoryParamStore holds the device or host tier, not {tier}: use NvmeParamStore")
        self.tier, self.dtype, self.total = tier, dtype, total
        self.source = ParamSource.MASTER if alias is not None else ParamSource.OWN
        self.bytes_read = 0
        self.tier_seconds = {tier.value: 0.0}  # a fetch's view (``fetched``: Note [engine telemetry keys] in _telemetry.py)
        self._under_copy = ShardsUnderCopy()
        self._frozen: Optional[torch.Tensor] = None  # under MASTER: the frozen units' shards
        if alias is not None:
            self.flat, self.own_from = alias, alias.numel()
            self._frozen = self._memory(total - self.own_from) if total > self.own_from else None
        else:
            self.flat, self.own_from = self._memory(total), 0

    def _memory(self, numel: int) -> torch.Tensor:
        if self.tier is Tier.CPU:
            return aligned_empty(numel, self.dtype, what=PARAM_SHARDS)
        return torch.empty(numel, dtype=self.dtype, device=acc.device())

    def _tensor_at(self, offset: int) -> tuple:
        """The memory tensor holding element ``offset``, and its offset there: under MASTER the
        master tensor, or the frozen units' own after it."""
        if self._frozen is not None and offset >= self.own_from:
            return self._frozen, offset - self.own_from
        return self.flat, offset

    bytes_written = 0
    own_path = None

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def memory_elems(self) -> int:
        return self.total

    def resident_tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.flat, self._frozen) if t is not None]

    def view(self, offset: int, numel: int) -> torch.Tensor:
        flat, at = self._tensor_at(offset)
        return flat[at : at + numel]

    def fetched(self, offset: int, numel: int) -> torch.Tensor:
        """The view a fetch stages (``FetchUnit.shard``); its seconds are this tier's."""
        with seconds_into(self.tier_seconds, self.tier.value):
            return self.view(offset, numel)

    def write(self, offset: int, values: torch.Tensor, *, keep: bool = False) -> None:
        """Store ``values`` (any float dtype; cast by the copy) at ``offset``."""
        self.view(offset, values.numel()).copy_(values)

    def read(self, offset: int, numel: int) -> torch.Tensor:
        return self.view(offset, numel).clone()

    def flush(self, offset: int = 0, numel: Optional[int] = None, *, block: bool = True) -> bool:
        return True  # nothing in flight

    def keep_until_copied(self, shard: torch.Tensor, event) -> None:
        """A fetch is done with ``shard`` (a view of this store) but its copy to the device may
        still read it: ``wait_copies`` before the step rewrites it in place (Note [buffers
        under a copy] in _host_pool.py)."""
        self._under_copy.keep(shard, event)

    def wait_copies(self) -> None:
        self._under_copy.wait()

    def step_outputs(self, offset: int, numel: int) -> List[tuple]:
        """The step writes [offset, offset + numel) in place."""
        return [(offset, self.view(offset, numel))]

    def step_outputs_done(self, offset: int, numel: int, changed: bool = True) -> int:
        return offset + numel  # written where it lives: nothing still filling

    def release_idle(self) -> None:
        pass  # the shards are the state itself

    def checkpoint_parts(self) -> List[tuple]:
        """(tensor, elements) in order: the flat tensor (under MASTER the master tensor, then
        the frozen units' own)."""
        frozen = [(self._frozen, self.total - self.own_from)] if self._frozen is not None else []
        return [(self.flat, self.own_from or self.total)] + frozen

    def own_part(self) -> Optional[tuple]:
        """(destination, first element) of the shards this store keeps itself; None where the
        master tensor holds them all."""
        if self.source is ParamSource.MASTER:
            return None if self._frozen is None else (self._frozen, self.own_from)
        return self.flat, 0

    def checkpoint_loaded(self) -> None:
        pass  # nothing derived from the shards is kept

    def checksums(self) -> dict:
        return {}

    def nbytes(self) -> dict:
        return totals(self.plan(self.tier, self.total, self.itemsize, self.source, frozen=self.total - self.own_from))

    def close(self) -> None:
        pass

    @staticmethod
    def plan(tier: Tier, total: int, itemsize: int, source: ParamSource = ParamSource.OWN, frozen: int = 0) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory_plan.py): the shards on their
        tier; under MASTER only the ``frozen`` elements are this store's, on the master's
        ``tier`` (the master's bytes are the optimizer's)."""
        own = frozen if source is ParamSource.MASTER else total
        return {tier.memory: {PARAM_SHARDS: own * itemsize}}


def plan(tier: Tier, total: int, itemsize: int, buffer_numel: int, buffer_count: int, chunk: int = 0,
         source: ParamSource = ParamSource.OWN, cache: int = 0, frozen: int = 0, host_upto: int = 0) -> dict:
    """The bytes of the store that will hold ``total`` shard elements on ``tier`` (under MASTER,
    the master's tier): ``NvmeParamStore.plan`` or ``MemoryParamStore.plan``."""
    if tier is Tier.NVME and source is not ParamSource.MASTER:
        return NvmeParamStore.plan(total, itemsize, buffer_numel, buffer_count, chunk, source, cache=cache,
                                   frozen=frozen, host_upto=host_upto)
    return MemoryParamStore.plan(tier, total, itemsize, source, frozen)
