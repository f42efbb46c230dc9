"""A fetch unit: the parameters owned directly by one submodule, gathered and released together.

Note [shard layout]: bandwidth-centric partitioning (paper 002 §6.1). Every parameter is
flattened, padded to a multiple of the world size N and split into N equal shards; rank r
holds shard r of every parameter of the unit, concatenated in parameter order, as the unit's
*shard* (``shard_numel`` elements). An all-gather of the shards yields an (N, shard_numel)
buffer whose column block [offset, offset + shard) holds one parameter, rank-major; copying
that block out (a view when N == 1) rebuilds the full parameter. The reduce-scatter of
gradients uses the same layout in reverse, so rank r receives exactly the gradient of its
shards. The parameter store holds every unit's shard at ``FetchUnit.param_offset``; the
optimizer's fp32 master weights, moments and gradient shards of a trainable unit use the
same shard layout at ``FetchUnit.opt_offset`` (a frozen unit has none: Note [frozen
parameters] in _layout.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Protocol

import torch
from torch import nn

from .._offload._layout import ParamSource, padded, shard_rows
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._telemetry_counters import span
from .._runtime._tiers import StagePolicy
from ..aio import aligned_empty
from ..errors import EngineError, InvariantError
from ._init_context import InitUnit
from ._ledger import GatherLedger, Hold
from ._param import ParamInfo, ParamState, info_of, make_plain, raw_data, register, set_data
from ._staging import Staging
from ._unit_plan import UnitSpec

if TYPE_CHECKING:
    from .._offload._param_store import ParamStore
    from .._runtime._recycle import Recycler
    from .._runtime._telemetry_counters import Counters
    from ._step_gate import StepGate


class MakeRoom(Protocol):
    """Release kept units before ``incoming`` is gathered, the one needed last first, until the
    device budget holds it. Provider: ``Prefetcher.make_room`` (_prefetch.py). Note [injected
    operations] in _seams.py."""

    def __call__(self, incoming: "FetchUnit") -> None: ...


class FetchOnDemand(Protocol):
    """A released parameter reached operator ``func``: fetch what ``infos`` describe and run it.
    Provider: ``Calls.on_unavailable`` (Note [phases] in _phase.py)."""

    def __call__(self, func, args, kwargs, infos: List[Any]) -> Any: ...


@dataclass(frozen=True)
class UnitContext:
    """The services a fetch unit uses, built before the units by ``initialize`` (the
    composition root) and shared by all of them; a unit never sees the engine or the
    optimizer."""

    world_size: int
    rank: int
    dtype: torch.dtype  # the compute dtype of the gathered parameters
    itemsize: int
    policy: StagePolicy  # what the stage partitions: at stage 3 parameters live as shards between uses
    counters: "Counters"
    ledger: GatherLedger["FetchUnit"]
    gathered_buffers: Optional["Recycler"]  # gathered buffers recycled (CPU-only runs)
    param_store: Optional["ParamStore"]  # stage 3's shards
    param_source: ParamSource  # Note [parameters from the master] in _placement.py: from the master, nothing to write
    step_gate: "StepGate"  # Note [step gate] in _step_gate.py: has the step updated this range yet
    make_room: MakeRoom  # the prefetcher releases kept units before a gather (Note [injected operations] in _seams.py)
    on_unavailable: FetchOnDemand  # a released parameter touched inside a module call is fetched on demand (an
    # operation, so the unit never names the call stack: Note [phases] in _phase.py)


@dataclass(eq=False)
class _Gathered:
    """The payload of GATHERING and AVAILABLE: the full parameters' buffer."""

    recycled: Optional[torch.Tensor] = None  # from the recycler: given back when freed (None: in place, or CUDA)
    charged: int = 0  # device bytes charged to the budget for it
    out: Optional[torch.Tensor] = None  # GATHERING: the all-gather's output
    handle: Optional[comm.CommHandle] = None  # GATHERING: the all-gather in flight


# Note [unit payloads]: a unit's data beyond its shard lives in the payload of its state, and
# ``_expect`` checks the payload with the state on every transition:
#   RELEASED   no payload (the shard is in the parameter store)
#   HOST       Staging of one kind (Note [staging kinds] in _staging.py), not yet on the device
#   DEVICE     Staging with the device shard and its copy event (the read has landed)
#   GATHERING  _Gathered with the all-gather's output and handle, and the Staging it reads from
#   AVAILABLE  _Gathered (or None before the first partition and for stages 1-2: the model's own tensors)
_PAYLOAD = {ParamState.RELEASED: (None, None), ParamState.HOST: ("host", None), ParamState.DEVICE: ("device", None),
            ParamState.GATHERING: ("device", True), ParamState.AVAILABLE: (None, "maybe")}
_STEP = {state: i for i, state in enumerate(ParamState)}  # ParamState's members are in the order a fetch takes


class Prefetched(enum.Enum):
    """What ``FetchUnit.prefetch`` did. SHORT: the unit stays where it got to, because its
    read had no room or was not allowed, no staging buffer was free, its read was still in
    flight, or the step had not yet updated its range."""

    ALREADY = "already"  # the unit was at the stage asked for, or past it: nothing to do
    NOW = "now"  # this call took it there
    SHORT = "short"  # it stopped before


class FetchUnit:
    """The directly-owned parameters of one module and their shard on this rank."""

    def __init__(self, ctx: UnitContext, spec: UnitSpec, param_offset: int, opt_offset: int):
        self.ctx = ctx
        self.index = spec.index  # position in the engine's unit list: the order of collectives
        self.module_name = spec.module_name
        self.world_size = ctx.world_size
        self.rank = ctx.rank
        self.partitioned = ctx.policy.partition_params
        self.params: List[nn.Parameter] = []
        self.infos: List[ParamInfo] = []
        offset = 0
        params = list(spec.params)
        self._init_units = [_init_unit_of(p) for _, p in params]  # built under infinity.Init
        for init_unit, (name, _) in zip(self._init_units, params):
            if init_unit is not None and init_unit.world_size != self.world_size:
                raise EngineError(f"{name} was partitioned by infinity.Init over {init_unit.world_size} rank(s) but "
                                  f"this job has {self.world_size}: build the model under Init in the same job (same "
                                  f"world size) that calls infinity.initialize")
        for name, p in params:
            info = ParamInfo(name, p.shape, p.numel(), padded(p.numel(), self.world_size), offset, self)
            register(p, info)
            self.params.append(p)
            self.infos.append(info)
            offset += info.shard_numel
        self.shard_numel = offset
        self.trainable = spec.trainable  # the engine never mixes the two in a unit
        self._persistent = spec.persistent  # Note [persistent parameters] in _unit_plan.py
        self.param_offset = param_offset  # start of this unit's shard in the parameter store's flat space
        self.opt_offset = opt_offset  # start of its range in the optimizer's flat fp32 space (trainable units)
        self._state = ParamState.AVAILABLE  # the model's own full tensors until partition()
        self._staging: Optional[Staging] = None  # HOST, DEVICE: Note [unit payloads]
        self._gathered: Optional[_Gathered] = None  # GATHERING, AVAILABLE (None: nothing of ours to free)
        self._grads_pending = 0  # params whose gradient has not arrived in this backward

    def on_unavailable(self, func, args, kwargs, infos):
        """A parameter of this unit reached an operator while released (Note [partitioned parameter] in _param.py)."""
        return self.ctx.on_unavailable(func, args, kwargs, infos)

    # ------------------------------------------------------------ state

    @property
    def state(self) -> ParamState:
        return self._state

    def _expect(self, state: ParamState, transition: str) -> None:
        """The precondition of a transition, checked always (not an ``assert``: ``python -O``
        would drop it and a wrong state would corrupt a gather silently), payload included
        (Note [unit payloads])."""
        if self._state is not state:
            raise InvariantError(f"{transition}: {self!r} is {self._state.name}, expected {state.name}")
        staging, gathered = _PAYLOAD[state]
        on_device = self._staging is not None and self._staging.device is not None
        if (self._staging is not None) != bool(staging) or (staging and on_device != (staging == "device")) \
                or (gathered is None and self._gathered is not None) or (gathered is True and self._gathered is None):
            raise InvariantError(f"{transition}: {self!r} has the payload of another state (staging "
                                 f"{self._staging is not None}, on the device {on_device}, gathered "
                                 f"{self._gathered is not None})")

    @property
    def full_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def full_nbytes(self) -> int:
        """Bytes of the gathered parameters."""
        return self.full_numel * self.ctx.itemsize

    @property
    def dtype(self) -> torch.dtype:
        return self.ctx.dtype

    def __repr__(self) -> str:
        return f"FetchUnit({self.module_name or '<root>'}, {len(self.params)} params, {self.state.name})"

    # ------------------------------------------------------------ gradients in backward

    @property
    def grads_pending(self) -> int:
        """Trainable parameters whose gradient has not been accumulated in this backward."""
        return self._grads_pending

    def expect_grads(self) -> None:
        """A backward begins: the gradient of every trainable parameter is awaited."""
        self._grads_pending = sum(1 for p in self.params if p.requires_grad)

    def expect_grads_again(self) -> None:
        """Backward reached a module of this unit again after the unit's gradients were in:
        another accumulation of each is awaited (Note [used again in one backward] in
        _backward.py)."""
        if self._grads_pending <= 0:
            self.expect_grads()

    def grad_arrived(self) -> bool:
        """One parameter's gradient was accumulated; True when none is awaited any more,
        also for a late accumulation nothing announced (the reducer keeps it for the end of
        backward: Note [bucket plan] in _reduce.py)."""
        self._grads_pending = max(self._grads_pending - 1, 0)
        return self._grads_pending == 0

    def grads_handed_over(self) -> None:
        """The end of backward gave the reducer whatever gradients the unit has."""
        self._grads_pending = 0

    # ------------------------------------------------------------ shard <-> full

    def local_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard, from the full parameters or from shards made by infinity.Init."""
        if not any(self._init_units):
            return self.shard_of([raw_data(p) for p in self.params], dtype)
        out = aligned_empty(self.shard_numel, dtype)  # mapped, not heap: a build shard by shard leaves no heap behind
        for info, p, iu in zip(self.infos, self.params, self._init_units):
            src = iu.shard() if iu is not None else shard_rows(raw_data(p), self.world_size)[self.rank]
            out[info.shard_offset : info.shard_offset + info.shard_numel].copy_(src)
        return out

    def materialize_init_params(self) -> None:
        """Stages 1-2 keep parameters whole: gather what Init partitioned."""
        for p, iu in zip(self.params, self._init_units):
            if iu is not None:
                set_data(p, iu.materialize())
                make_plain(p)
        self._init_units = [None] * len(self.params)

    def forget_init(self) -> None:
        self._init_units = [None] * len(self.params)

    def shard_of(self, tensors: List[torch.Tensor], dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's shard of full tensors laid out like the unit's parameters, where the
        tensors are (host tensors before ``initialize`` moved anything: the shard goes to its
        store's tier from there)."""
        where = tensors[0].device if tensors else acc.device()
        out = torch.empty(self.shard_numel, dtype=dtype, device=where) if out is None else out
        with torch.no_grad():
            for info, t in zip(self.infos, tensors):
                out[info.shard_offset : info.shard_offset + info.shard_numel].copy_(shard_rows(t, self.world_size)[self.rank])
        return out

    @property
    def store(self):
        return self.ctx.param_store

    def partition(self) -> None:
        """AVAILABLE -> RELEASED for the first time: keep only this rank's shard (stage 3),
        written to the parameter store (unless a trainable unit's parameters are the master's:
        Note [parameters from the master] in _placement.py)."""
        self._expect(ParamState.AVAILABLE, "partition")
        if not self.partitioned:
            raise InvariantError(f"partition: {self!r} is not partitioned (stages 1-2 keep parameters whole)")
        if not (self.trainable and self.ctx.param_source.from_master):
            self.store.write(self.param_offset, self.local_shard(self.dtype))
        self._to_placeholders()

    def shard(self) -> torch.Tensor:
        """This rank's compute-dtype shard where it is resident (device or cpu tier), for a fetch."""
        return self.store.fetched(self.param_offset, self.shard_numel)

    def _placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=acc.device())

    def _to_placeholders(self) -> None:
        for p in self.params:
            set_data(p, self._placeholder())
        self._state = ParamState.RELEASED

    # ------------------------------------------------------------ fetch / release
    # Note [unit verbs]: a unit's verbs come in pairs, FSDP2's names for the gather:
    #   acquire(why) / release(why)     a hold (Note [hold ledger] in _ledger.py); acquire
    #                                   unshards if needed, the last release reshards
    #   prefetch(to) / cancel_prefetch  part of the way toward a gather, ahead of use, or undone
    #   unshard / wait_for_unshard      the all-gather launched / landed (GATHERING, AVAILABLE)
    #   reshard                         AVAILABLE -> RELEASED, unheld: the full tensors dropped
    # ``partition`` is the first RELEASED (the shard written to its store); ``reshard_stale``
    # reshards what the step made stale.

    @property
    def refs(self) -> int:
        """How many holds the unit has (Note [hold ledger] in _ledger.py)."""
        return self.ctx.ledger.count(self)

    @property
    def persistent(self) -> bool:
        """A unit of parameters below zero.prefetch.persistence_threshold stays gathered between
        uses (Note [persistent parameters] in _unit_plan.py)."""
        return self.partitioned and self._persistent

    def acquire(self, why: Hold) -> None:
        """Hold the unit for ``why``; gather it if needed (waiting for what the prefetcher
        started). Pairs with ``release(why)``. A gather that raised (out of device memory)
        leaves no hold: the caller pairs only an acquire that returned (Note [aborted forward]
        in _engine.py)."""
        self.ctx.ledger.take(self, why)
        counters = self.ctx.counters
        if self._state is ParamState.AVAILABLE:
            if self.partitioned:
                counters.hits += 1
            return
        if self._state is ParamState.RELEASED:
            counters.misses += 1
        else:
            counters.hits += 1
        try:
            if self._state is not ParamState.GATHERING:
                self.ctx.make_room(self)
                self.unshard()
            self.wait_for_unshard()
        except BaseException:
            self.ctx.ledger.drop(self, why)
            raise

    def hold(self, why: Hold, until: Optional[int] = None) -> None:
        """Hold a gathered unit for ``why`` (no fetch); pairs with ``release(why)``."""
        self._expect(ParamState.AVAILABLE, "hold")
        self.ctx.ledger.take(self, why, until)

    def keep(self, why: Hold, until: Optional[int] = None) -> bool:
        """Hold the unit for ``why`` if it is gathered and its last release would free it
        (partitioned, not persistent), so that it stays gathered until ``release(why)``;
        False, and no hold, otherwise."""
        if self._state is not ParamState.AVAILABLE or not self.partitioned or self.persistent:
            return False
        self.hold(why, until)
        return True

    def release(self, why: Hold) -> None:
        """Drop the hold for ``why``; free the full tensors when it was the last (unless persistent)."""
        left = self.ctx.ledger.drop(self, why)
        if left == 0 and self.partitioned and self._state is ParamState.AVAILABLE and not self.persistent:
            self.reshard()

    def reshard(self) -> None:
        """AVAILABLE -> RELEASED, unheld: drop the full tensors and give their buffer back."""
        self._expect(ParamState.AVAILABLE, "reshard")
        if self.refs or not self.partitioned:
            raise InvariantError(f"reshard: {self!r} is " + (f"still held for {self.ctx.ledger.describe(self)}"
                                                              if self.refs else "not partitioned"))
        gathered, self._gathered = self._gathered, None
        self._to_placeholders()
        if gathered is not None:
            if gathered.recycled is not None:  # reused once nothing else (say, autograd) still holds a view of it
                self.ctx.gathered_buffers.give(gathered.recycled)
            self.ctx.ledger.budget.release(gathered.charged)
            self.ctx.ledger.freed(self)

    def cancel_prefetch(self) -> None:
        """Undo a prefetch nobody used, from whatever stage it reached: back to RELEASED,
        buffers returned (refs must be 0); a persistent unit stays gathered, as after any use."""
        if self.refs:
            raise InvariantError(f"cancel_prefetch: {self!r} is still held for {self.ctx.ledger.describe(self)}")
        if self._state is ParamState.GATHERING:
            self.wait_for_unshard()  # collectives stay matched across ranks
        if self._state is ParamState.AVAILABLE:
            if self.partitioned and not self.persistent:
                self.reshard()
            return
        if self._state is ParamState.HOST:  # no copy to the device, which may not fit (out of memory)
            staging, self._staging = self._staging, None
            if staging.in_flight:  # the read lands before its buffer is reused
                staging = staging.landed(self.store.finish_read(staging.read, what=self._what()))
            staging.give_back_unused(self.store)
            if staging.recycled is not None:  # read straight into a gathered buffer
                self.ctx.gathered_buffers.give(staging.recycled)
            self._state = ParamState.RELEASED
            return
        if self._state is ParamState.DEVICE:
            staging = self._drop_staging()
            if staging.recycled is not None:  # read straight into a gathered buffer
                self.ctx.gathered_buffers.give(staging.recycled)
            self._state = ParamState.RELEASED

    # ------------------------------------------------------------ prefetch (Note [trace and prefetch] in _prefetch.py)

    def prefetch(self, to: ParamState, *, block: bool = False, room: Optional[int] = None,
                 read: bool = True) -> Prefetched:
        """Take a partitioned unit toward ``to`` along the path ``acquire`` takes, one
        transition at a time: HOST, its shard's read submitted (or its resident, cached or
        handed-off shard staged); DEVICE, its copy to the device started; GATHERING, its
        all-gather launched. A released unit starts its read only with ``read`` on and its
        shard within ``room`` elements (None: any size). Without ``block`` a transition
        that would wait is not taken. ``cancel_prefetch`` undoes what this did."""
        if not self.partitioned or _STEP[self._state] >= _STEP[to]:
            return Prefetched.ALREADY
        if self._state is ParamState.RELEASED and (not read or room is not None and self.shard_numel > room):
            return Prefetched.SHORT
        while _STEP[self._state] < _STEP[to]:
            if self._state is ParamState.RELEASED:
                moved = self.stage_to_host(block=block)
            elif self._state is ParamState.HOST:
                moved = self.stage_to_device(block=block)
            else:
                self.unshard()
                moved = True
            if not moved:
                return Prefetched.SHORT
        return Prefetched.NOW

    @property
    def staged_numel(self) -> int:
        """Elements of the shard on their way to a gather (its read submitted or landed, its
        copy started); 0 otherwise. The prefetcher's ``bucket_size`` counts them."""
        return self.shard_numel if self._state in (ParamState.HOST, ParamState.DEVICE) else 0

    @property
    def idle(self) -> bool:
        """Released and unheld: nothing of it is gathered or on its way."""
        return self._state is ParamState.RELEASED and not self.refs

    def stage_to_host(self, *, block: bool = True) -> bool:
        """RELEASED -> HOST: submit the read of the shard from NVMe into a pool buffer
        (resident tiers have nothing to read). False when ``block`` is off and no buffer is free."""
        self._expect(ParamState.RELEASED, "stage_to_host")
        if self.trainable and not self.ctx.step_gate.wait(self.opt_offset + self.shard_numel, start=self.opt_offset,
                                                          block=block, what=self._what(), unit=self.label):
            return False  # a frozen unit's shard is never rewritten
        staging = Staging.resident() if self.store.tier.resident else self._stage_from_nvme(block)
        if staging is None:
            return False
        self._staging = staging
        self._state = ParamState.HOST
        return True

    def _stage_from_nvme(self, block: bool) -> Optional[Staging]:
        """The NVMe tier's staging: the parameter cache's copy, else the step's hand-off, else
        a read submitted (None when ``block`` is off and no buffer is free)."""
        nbytes = self.shard_numel * self.store.itemsize
        host = self.store.host_share(self.param_offset, self.shard_numel)  # Note [split tiers] in _offload/_split.py
        if host is not None:
            self.ctx.counters.bytes["param_host"] += nbytes
            return Staging.cached(host)
        cached = self.store.cached(self.param_offset, self.shard_numel)  # Note [parameter cache] in _nvme_param_store.py
        if cached is not None:
            self.ctx.counters.bytes["param_cache"] += nbytes
            return Staging.cached(cached)
        handoff = self.store.take_handoff(self.param_offset, self.shard_numel)  # Note [hand-off] in _nvme_param_store.py
        if handoff is not None:
            self.ctx.counters.bytes["param_handoff"] += nbytes
            return Staging.handed_off(handoff)
        into = self._direct_read_buffer()
        with span("infinity::read", self.label), self.ctx.counters.blocked("nvme_read", self.label):  # waits for
            # the range's writes, a free buffer
            read = self.store.start_read(self.param_offset, self.shard_numel, block=block, into=into)
        if read is None:
            if into is not None:
                self.ctx.gathered_buffers.give(into)
            return None
        self.ctx.counters.bytes["nvme_read"] += nbytes
        return Staging.pool_read(read) if into is None else Staging.direct_read(read, into)

    def _direct_read_buffer(self) -> Optional[torch.Tensor]:
        """One rank without an accelerator: the gathered parameters would be a copy of the
        shard as read, so the read goes straight into a recycled gathered buffer (the
        parameters become views of it) instead of a staging buffer; None elsewhere."""
        if self.world_size != 1 or self.ctx.gathered_buffers is None:
            return None
        return self.ctx.gathered_buffers.take(self.full_numel, self.dtype)

    def stage_to_device(self, *, block: bool = True) -> bool:
        """HOST -> DEVICE: once the shard's read has landed (waiting for it when ``block``),
        start its copy to the device on the host->device stream (without an accelerator the
        host buffer is the device shard). False when ``block`` is off and the read is still
        in flight."""
        self._expect(ParamState.HOST, "stage_to_device")
        staging = self._staging
        if staging.in_flight:
            if not block and not self.store.read_done(staging.read):
                return False
            with self.ctx.counters.blocked("nvme_read", self.label):
                staging = staging.landed(self.store.finish_read(staging.read, what=self._what()))
            self._staging = staging  # landed: a failure below leaves the buffer where cancel_prefetch finds it
        src = staging.host_shard(self.shard_numel)
        if src is None:
            src = self.shard()
        if staging.to_cache:
            self.store.remember(self.param_offset, src)  # Note [parameter cache] in _nvme_param_store.py
        with span("infinity::copy_to_device", self.label):
            staging = staging.on_device(*acc.start_copy_to_device(src), src)
        if staging.device.copied:
            self.ctx.counters.bytes["host_to_device"] += src.numel() * src.element_size()
        self._staging = staging
        self._state = ParamState.DEVICE
        return True

    def _drop_staging(self) -> Staging:
        """The device shard was consumed (gathered, or abandoned): the staging gives its host
        source back (``Staging.give_back``)."""
        staging, self._staging = self._staging, None
        staging.give_back(self.store)
        return staging

    label = property(lambda self: self.module_name or "<root>", doc="its name in profiler ranges: its module's")

    def _what(self) -> str:
        return f"the shard of {self.module_name or '<root>'} ({len(self.params)} params, first " \
               f"{self.infos[0].name}) on rank {self.rank}"

    def unshard(self) -> None:
        """RELEASED/HOST/DEVICE -> GATHERING: launch the all-gather of this unit's shards."""
        if self._state is ParamState.RELEASED:
            self.stage_to_host()
        if self._state is ParamState.HOST:
            self.stage_to_device()
        self._expect(ParamState.DEVICE, "unshard")
        st = self._staging
        on = st.device
        shard = acc.finish_copy_to_device(on.shard, on.h2d)
        nbytes = self.full_nbytes
        gathered = _Gathered(recycled=st.recycled)
        in_place = st.gathers_in_place(self.world_size)
        if st.new_memory(self.world_size):
            self.ctx.ledger.budget.charge(nbytes, f"gathered parameters of {self.module_name or '<root>'}")
            gathered.charged = nbytes
        try:  # the budget first, then the memory; either out of memory leaves the unit as it was (DEVICE)
            if in_place:
                gathered.out = shard
            elif self.ctx.gathered_buffers is not None:  # a buffer to give back to the recycler when freed
                gathered.out = gathered.recycled = self.ctx.gathered_buffers.take(self.full_numel, self.dtype)
            else:  # CUDA: the caching allocator reuses the memory
                gathered.out = torch.empty(self.full_numel, dtype=self.dtype, device=acc.device())
        except BaseException:
            self.ctx.ledger.budget.release(gathered.charged)
            raise
        self.ctx.ledger.gathered(self)
        self.ctx.counters.bytes["all_gather"] += nbytes
        with span("infinity::all_gather", self.label):
            gathered.handle = comm.all_gather_into_tensor(
                gathered.out, shard, async_op=True,
                what=f"all-gather of {self.module_name or '<root>'} ({len(self.params)} params, first {self.infos[0].name})")
        self._gathered = gathered
        self._state = ParamState.GATHERING

    def wait_for_unshard(self) -> None:
        """GATHERING -> AVAILABLE: wait, then point every parameter at its full tensor."""
        self._expect(ParamState.GATHERING, "wait_for_unshard")
        gathered = self._gathered
        with self.ctx.counters.blocked("all_gather", self.label):
            gathered.handle.wait()
        rows = gathered.out.view(self.world_size, self.shard_numel)
        for p, info in zip(self.params, self.infos):
            block = rows[:, info.shard_offset : info.shard_offset + info.shard_numel]
            set_data(p, block.reshape(-1)[: info.numel].view(info.shape))
        gathered.out = gathered.handle = None
        self._drop_staging()  # the shard was read by the all-gather: its staging buffer is free again
        self._state = ParamState.AVAILABLE

    def reshard_stale(self) -> None:
        """After the optimizer step: a gathered copy nobody holds (a persistent unit's) is
        stale; reshard it."""
        if self._state is ParamState.AVAILABLE and self.partitioned and not self.refs:
            self.reshard()

    # ------------------------------------------------------------ gradients

    def grads_into(self, rows: torch.Tensor) -> None:
        """Copy the full gradients into an (N, shard_numel) block (zeros where absent)."""
        with torch.no_grad():
            for p, info in zip(self.params, self.infos):
                block = rows[:, info.shard_offset : info.shard_offset + info.shard_numel]
                if p.grad is None:
                    block.zero_()
                else:
                    block.copy_(shard_rows(p.grad, self.world_size))

    def own_shard_grad(self) -> Optional[torch.Tensor]:
        """On one rank, a unit of one unpadded fp32 parameter: its gradient, flat, is already
        its shard gradient (a view, no copy); None otherwise."""
        if self.world_size != 1 or len(self.params) != 1:
            return None
        g = self.params[0].grad
        if g is None or g.dtype != torch.float32 or not g.is_contiguous() or g.numel() != self.shard_numel:
            return None
        return g.view(-1)

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def load_full_into_params(self, rows: torch.Tensor) -> None:
        """Stage 1/2: copy gathered (N, shard_numel) values into the whole parameters."""
        with torch.no_grad():
            for p, info in zip(self.params, self.infos):
                block = rows[:, info.shard_offset : info.shard_offset + info.shard_numel]
                raw_data(p).copy_(block.reshape(-1)[: info.numel].view(info.shape))


def _init_unit_of(param) -> Optional[InitUnit]:
    info = info_of(param)
    return info.unit if info is not None and isinstance(info.unit, InitUnit) else None
