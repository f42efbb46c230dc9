"""The engine behind ``infinity.initialize``: fetch units, hooks, gradient reduction.

One ``Engine`` per model. It builds a ``FetchUnit`` per module that owns parameters,
installs the hooks (in one place, handles kept), reduce-scatters gradients and hands the
optimizer a flat fp32 view of this rank's shards. What differs between ZeRO stages is one
small frozen policy (``StagePolicy``), not checks scattered through the code.

Note [hook protocol] (stage 3):
- pre-forward of module M: acquire (gather) the units M uses: the one it owns and the units
  owning external parameters it touches; post-forward: release them and, when autograd
  will come back through M, hook M's outputs so its units are re-acquired before M's
  backward (pre-backward).
- a parameter used while RELEASED inside a managed forward is gathered on demand, held until
  the running module's post-forward, and recorded as an external dependency of that
  module, so later iterations (and its backward) fetch it up front.
- post-accumulate-grad hook of each parameter: when all parameters of a unit have their
  gradient, the unit's gradients go to the reducer (stages 2 and 3) and every module whose
  backward was waiting for that unit drops its hold.
- end of backward (autograd callback): reduce what is left (parameters without a gradient
  on this rank, as zeros: Note [bucket plan] in _reduce.py), wait for every reduce-scatter,
  release every remaining hold. After backward no unit is gathered.

Note [hold until the input gradients]: a module's units stay gathered through its backward
until the gradients of its trainable parameters have arrived; a module with a frozen unit
(LoRA's base layers, BitFit's weights) has nothing to wait for there, yet its weights are
needed to compute the gradients of its inputs. So each call of such a module routes the
inputs that need a gradient through an identity autograd function (``_InputGrads``, as
FSDP2 does for its post-backward) tagged with a token of that call; the output hook of the
same call passes the token to the pre-backward, and the hold also waits until the
identity's backward has run, i.e. until backward has computed this call's input gradients.
Tokens are per call, so a module called twice waits for both calls, a forward without a
backward leaves nothing behind, and a non-reentrant recomputation (whose outputs backward
never reaches) waits for nothing; with reentrant checkpointing the recomputation inside
backward is the call whose graph backward runs.

Note [used again in one backward]: within one run of the autograd graph, a parameter's
gradient is accumulated once, after every use of it has been differentiated, so a module's
hold ends with its units' gradients. Reentrant activation checkpointing runs one inner
backward per checkpoint: a module shared by two checkpointed blocks (or a parameter used in
both) is differentiated, and its gradient accumulated, once per inner backward. So a module
whose hold already ended is acquired again when backward reaches it again, its units wait for
another accumulation; gradients that arrive after the unit's were handed to the reducer
stay in ``.grad`` and are reduced at the end of backward (Note [bucket plan] in _reduce.py),
as are those of a unit only some of whose parameters got one.

Note [fetch unit grouping]: a fetch unit is what one all-gather brings and one reduce-scatter
takes. By default (``zero.fetch_units.group: block``) each repeated block (every child of an
``nn.ModuleList``, as FSDP2 is applied per transformer block, and every module of a class
named in ``zero.fetch_units.classes``) is one unit holding all its parameters, nested blocks
apart (experts in a list inside a block are units of their own); modules outside blocks
(embeddings, the final norm, the head) keep a unit each. The block's own pre-forward hook
acquires its units, so the gather happens at the block boundary; its submodules acquire the
same units again, which only counts a reference. In backward every submodule holds the
block's units until all the block's gradients are in, then the unit is reduced at once.
GPT-2 124M: 15 all-gathers per forward instead of about 75. Working memory is bounded by the
largest unit (a block, or a tile where tiling applies). ``group: module`` gives one unit per
module. Stages 1-2 group the same way: their units set the reduce-scatter granularity and the
flat layout of the optimizer's space, so every stage sums the global gradient norm in the same
order and clips with the same bits.

Note [same gathers on every rank]: an all-gather is a collective, so in stage 3 every rank
must gather the same units in the same order. When ranks run different modules (an expert
routed on one rank only) the gathers pair up wrongly: with units of different sizes the
collective fails, but with units of the same size (identical experts) it succeeds and mixes
shards of different modules, silently. So the engine keeps the sequence of units it
gathers and, at the end of each forward and of each backward, compares a hash of it across
ranks (one small all-reduce); on a mismatch it raises, naming the first unit that differs,
before anything computed from the mixed values reaches the optimizer.

Note [aborted forward]: a module's forward can end by an exception, and not only on error:
non-reentrant activation checkpointing stops its recomputation inside backward by raising
(``_StopRecomputationError``) as soon as the tensors it needs are recomputed, i.e. in the
middle of the block's last submodule. The post-forward hook is therefore registered with
``always_call=True``: every frame pushed by a pre-forward hook is popped and its units
released, whatever way the forward ended. Before this, the aborted frames kept their units
gathered with a reference nobody dropped, so the optimizer step could not refresh them and
later forwards and reads saw the values from before the step.
"""
from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from .._offload._memory_plan import host_account, stop_block_cache
from .._offload._optimizer_store import state_bytes
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._save_fence import SaveFence
from ..errors import EngineError
from . import _function_params
from ._ledger import Hold
from ._loss_scale import scale_outputs
from ._param import info_of, make_partitioned, raw_data, set_data
from ._phase import Calls, Frame, ModuleState, Phase, tensors_in
from ._unit import FetchUnit, UnitContext
from ._unit_plan import DTYPES, StagePolicy, block_modules, plan_units  # noqa: F401 - the engine's planning, re-exported

if TYPE_CHECKING:
    from .._offload._optimizer_store import OptimizerStore
    from .._offload._placement import Placement
    from .._offload._swap import SwapDirs
    from ._activation_offload import ActivationOffloader
    from ._loss_scale import LossScaler
    from ._prefetch import Prefetcher
    from ._reduce import GradReducer

# external parameters registered before initialize (e.g. inside a model's __init__)
_pending_external: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()

_PARTITION_WRITES_IN_FLIGHT = 128 << 20  # bytes of shards written by cast_and_partition before it waits


class _InputGrads(torch.autograd.Function):
    """Identity on a module call's inputs; its backward runs once backward has computed the
    gradients of those inputs, i.e. once the call's own backward is done."""

    @staticmethod
    def forward(ctx, engine, token, *tensors):
        ctx.engine, ctx.token = engine, token
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._inputs_done(ctx.token)
        return (None, None) + grads


@dataclass(frozen=True)
class EngineParts:
    """What ``initialize`` built before the engine, in build order (Note [build order] in
    _initialize.py)."""

    placement: "Placement"
    ctx: UnitContext  # the services the units share: counters, ledger, stores, step gate
    calls: Calls  # the phase and the stack of module calls (Note [phases] in _phase.py)
    units: List[FetchUnit]
    uses: List[Tuple[str, nn.Module, List[int]]]  # per module: the units whose parameters it holds
    opt_store: "OptimizerStore"  # Note [optimizer store protocol] in _optimizer_store.py
    prefetcher: "Prefetcher"
    reducer: "GradReducer"
    scaler: Optional["LossScaler"]  # fp16 only
    swap_dirs: "SwapDirs"
    memory_plan: dict  # the preflight's plan, by tier and category (Note [one memory model] in _memory_plan.py)
    activation_offload: Optional["ActivationOffloader"] = None  # activation_checkpointing.offload: cpu
    block_cache: bool = False  # torch's large CPU blocks come from the block cache (Note [block cache])


class Engine:
    def __init__(self, model: nn.Module, cfg, parts: EngineParts):
        ctx = parts.ctx
        self.model = model
        self.cfg = cfg
        self.policy = StagePolicy.of(cfg.zero.stage)
        self.placement = parts.placement
        self.ctx = ctx
        self.world_size = ctx.world_size
        self.rank = ctx.rank
        self.dtype = ctx.dtype
        self.itemsize = ctx.itemsize
        self.units: List[FetchUnit] = parts.units
        self.states: Dict[nn.Module, ModuleState] = {}
        for name, module, indices in parts.uses:
            state = self.states[module] = ModuleState(module, name)
            for i in indices:
                state.add_unit(self.units[i])
        self.calls = parts.calls  # Note [phases] in _phase.py
        self.counters = ctx.counters
        self.ledger = ctx.ledger
        self.gathered = ctx.gathered
        self.gate = ctx.step_gate
        self.save_fence = SaveFence()  # Note [save fence] in _save_fence.py
        self.param_store = ctx.param_store
        self.opt_store = parts.opt_store
        self.prefetcher = parts.prefetcher
        self.reducer = parts.reducer
        self.scaler = parts.scaler
        self.swap_dirs = parts.swap_dirs
        self.memory_plan = parts.memory_plan
        self.block_cache = parts.block_cache
        # the engine's hold on the block cache ends at close, or when the engine is collected unclosed
        self._block_cache_done = weakref.finalize(self, stop_block_cache) if parts.block_cache else None
        self.activation_offload = parts.activation_offload  # Note [which tensors are offloaded] in _activation_offload.py
        self._bwd_waiting: Dict[ModuleState, set] = {}  # a held module's backward: the units and input tokens it waits for
        self._bwd_done: Set[ModuleState] = set()  # modules whose backward hold ended in this backward
        self._tokens = itertools.count()  # one per module call whose input gradients a hold may wait for
        self._inputs_seen: set = set()  # tokens whose input gradients backward has computed
        self._handles: list = []
        self._telemetry_totals: dict = {}  # running totals at the last telemetry() call
        for module, params in list(_pending_external.items()):
            if module in self.states:
                for p in params:
                    self.register_external(module, p)
        model.__dict__[_HOLD] = _EngineHold(self)
        _live.add(self)

    @property
    def live_elems(self) -> int:
        """Elements of gathered (full) parameters alive now."""
        return self.ledger.live

    @property
    def peak_live_elems(self) -> int:
        return self.ledger.peak

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        info = info_of(param)
        if info is None or getattr(info.unit, "ctx", None) is not self.ctx:
            raise EngineError("register_external_parameter: the parameter is not part of this model")
        if module not in self.states:
            raise EngineError(f"register_external_parameter: {type(module).__name__} is not a submodule of this model")
        self.states[module].add_unit(info.unit)

    def cast_and_partition(self) -> None:
        """Cast parameters to the compute dtype; in stage 3 keep only this rank's shards.
        Parameters built under infinity.Init are adopted: whole again for stages 1-2."""
        inits = {id(iu.init): iu.init for unit in self.units for iu in unit._init_units if iu is not None}
        if not self.policy.partition_params:
            for unit in self.units:
                unit.materialize_init_params()
        move = not self.policy.partition_params  # stages 1-2: whole parameters live on the device
        for unit in self.units:
            for p in unit.params:
                data = raw_data(p)
                dtype = self.dtype if data.is_floating_point() else data.dtype
                device = acc.device() if move else data.device  # stage 3: partitioned from where they are
                if data.dtype != dtype or data.device != device:
                    set_data(p, data.to(device=device, dtype=dtype))  # one copy for the cast and the move
        for module in self.model.modules():  # buffers on the device, cast to the compute dtype (as Module.to)
            for name, b in list(module._buffers.items()):
                if b is None:
                    continue
                cast = b.is_floating_point() and b.dtype != self.dtype and self.dtype != torch.float32
                if cast or not acc.on_device(b):
                    module._buffers[name] = b.to(device=acc.device(), dtype=self.dtype if cast else b.dtype)
        if self.policy.partition_params:
            store, in_flight = self.param_store, 0
            for unit in self.units:
                unit.partition()
                for p in unit.params:
                    make_partitioned(p)
                in_flight += unit.shard_numel * self.itemsize
                if in_flight > _PARTITION_WRITES_IN_FLIGHT:  # the shards written are held until they land
                    store.flush()
                    in_flight = 0
            store.flush()  # shards must be on their tier before the first fetch
        for unit in self.units:
            unit.forget_init()
        for init in inits.values():
            init.close()  # its chunks now live in this engine's stores

    # ------------------------------------------------------------ hooks

    def install_hooks(self) -> None:
        if self.policy.partition_params:
            _function_params.install()  # Note [parameters read by autograd Functions] in _function_params.py
            for module in self.states:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
                # always_call: Note [aborted forward]
                self._handles.append(module.register_forward_hook(self._post_forward, with_kwargs=True,
                                                                  always_call=True))
        elif self.dtype == torch.float16:
            self._handles.append(self.model.register_forward_pre_hook(self._pre_forward_root))
            self._handles.append(self.model.register_forward_hook(self._post_forward_root))
        if self.policy.reduce_in_backward:
            for unit in self.units:
                for p in unit.params:
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(_held_weakly(self._on_grad_accumulated)))
        if self.activation_offload is not None:
            self._handles.extend(self.activation_offload.install(self.model))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_forward_root(self, module, args):
        self.calls.begin_forward()

    def _post_forward_root(self, module, args, output):
        self.calls.end_forward()
        if torch.is_grad_enabled():
            self.release_idle()  # the activation peak comes next, in the loss's backward
        if self.dtype == torch.float16 and torch.is_grad_enabled():
            scale_outputs(self.scaler, output)

    def _pre_forward(self, module, args, kwargs):
        if module is self.model:
            self.calls.begin_forward()
            self.prefetcher.begin(Phase.FORWARD)
        if torch.is_grad_enabled():
            self.opt_store.release_idle(block=False)  # as early as it can: HF models peak in the loss, inside forward
        state = self.states[module]
        frame = Frame(state, [], handling=sys.exc_info()[1])
        self.calls.push(frame)  # first: an acquire that raises still has its frame popped
        for unit in state.units:
            unit.acquire(Hold.CALL)
            frame.held.append(unit)
        if state.units:
            self.prefetcher.on_module(state)
        if torch.is_grad_enabled() and any(not u.trainable for u in state.units):
            return self._watch_inputs(frame, args, kwargs)
        return None

    def _watch_inputs(self, frame: Frame, args, kwargs):
        """Note [hold until the input gradients]: route this call's inputs that need a
        gradient through ``_InputGrads``; None when there are none."""
        slots = [(i, None) for i, a in enumerate(args) if _needs_grad(a)]
        slots += [(None, k) for k, v in kwargs.items() if _needs_grad(v)]
        if not slots:
            return None
        frame.token = next(self._tokens)
        tensors = [args[i] if k is None else kwargs[k] for i, k in slots]
        outs = _InputGrads.apply(self, frame.token, *tensors)
        args, kwargs = list(args), dict(kwargs)
        for (i, k), t in zip(slots, outs):
            if k is None:
                args[i] = t
            else:
                kwargs[k] = t
        return tuple(args), kwargs

    def _inputs_done(self, token: int) -> None:
        self._inputs_seen.add(token)
        self._arrived(token)

    def _arrived(self, awaited) -> None:
        """A unit's gradients or a call's input gradients are in: end the holds that waited
        only for them."""
        for state in [s for s, waiting in self._bwd_waiting.items() if awaited in waiting]:
            waiting = self._bwd_waiting[state]
            waiting.discard(awaited)
            if not waiting:
                self._drop_hold(state)

    def _post_forward(self, module, args, kwargs, output):
        raised = sys.exc_info()[1]  # torch calls this hook inside its `except` when forward raised
        top = self.calls.top()
        if top is None or top.state.module is not module:
            if raised is not None:
                return  # the forward raised before this module's pre-forward hook pushed a frame
            raise EngineError(f"forward hooks out of order at {type(module).__name__}; was a forward interrupted?")
        frame = self.calls.pop()
        for unit in frame.held:
            unit.release(Hold.CALL)
        if raised is not None and raised is not frame.handling:
            return  # aborted (a forward called inside an `except` block sees that block's exception)
        if torch.is_grad_enabled() and frame.state.units:
            outs = [t for t in tensors_in(output) if t.requires_grad and t.grad_fn is not None]
            if outs:
                state, token = frame.state, frame.token
                register_multi_grad_hook(outs, lambda _grad: self._pre_backward(state, token), mode="any")
        if module is self.model:
            self.prefetcher.end()
            self.check_same_gathers("forward")
            self._post_forward_root(module, args, output)

    # ------------------------------------------------------------ backward

    def _begin_backward(self) -> None:
        if not self.calls.begin_backward():  # an overlapped step may still run: Note [step gate]
            return
        for unit in self.units:
            unit.grads_pending = sum(1 for p in unit.params if p.requires_grad)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.prefetcher.begin(Phase.BACKWARD)

    def release_idle(self) -> None:
        """Note [released pages] in aio/_memory.py: recycled buffers nobody uses now give their
        pages back until they are taken again."""
        if self.gathered is not None:
            self.gathered.release_idle()
        if self.param_store is not None:
            self.param_store.release_idle()
        self.opt_store.release_idle()

    def _pre_backward(self, state: ModuleState, token: Optional[int] = None) -> None:
        self._begin_backward()
        inputs = {token} if token is not None and token not in self._inputs_seen else set()
        if state in self._bwd_waiting:
            self._bwd_waiting[state] |= inputs  # already held: a module called twice in forward
            return
        again = state in self._bwd_done
        self._bwd_done.discard(state)
        waiting = set(inputs)
        for unit in state.units:
            unit.acquire(Hold.BACKWARD)
            if again and unit.grads_pending <= 0:  # Note [used again in one backward]
                unit.grads_pending = sum(1 for p in unit.params if p.requires_grad)
            if unit.grads_pending > 0:
                waiting.add(unit)
        self._bwd_waiting[state] = waiting
        self.prefetcher.on_module(state)
        if not waiting:
            self._drop_hold(state)

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        self._begin_backward()
        unit = info_of(param).unit
        unit.grads_pending -= 1
        if unit.grads_pending < 0:  # a late accumulation nothing announced: Note [used again in one backward]
            unit.grads_pending = 0
        if unit.grads_pending == 0:
            self._unit_grads_done(unit)

    def _unit_grads_done(self, unit: FetchUnit) -> None:
        if self.policy.reduce_in_backward:
            self.reducer.add(unit)
        self._arrived(unit)

    def _drop_hold(self, state: ModuleState) -> None:
        for unit in state.units:
            unit.release(Hold.BACKWARD)
        del self._bwd_waiting[state]
        self._bwd_done.add(state)  # a later trigger in this backward acquires again: Note [used again in one backward]

    def _end_backward(self) -> None:
        if self.policy.reduce_in_backward:
            for unit in self.units:  # gradients no hook handed over: a unit used in part, late accumulations
                if any(p.grad is not None for p in unit.params):
                    unit.grads_pending = 0
                    self.reducer.add(unit)
            with self.counters.blocked("reduce_scatter"):
                self.reducer.finish()  # units without gradients join as zeros: Note [bucket plan] in _reduce.py
        for state in list(self._bwd_waiting):
            self._drop_hold(state)
        self._bwd_done.clear()
        self.ledger.check_none(Hold.BACKWARD, where="backward")
        self._inputs_seen.clear()
        self.calls.end_backward()
        self.prefetcher.end()
        self.check_same_gathers("backward")

    def check_same_gathers(self, where: str) -> None:
        """Note [same gathers on every rank]: raise if the ranks gathered different units
        since the last check."""
        seq = self.ledger.take_sequence()
        if self.world_size == 1 or not self.policy.partition_params:
            return
        h = 0
        for index in seq:
            h = (h * 1_000_003 + index + 1) % (1 << 61)
        mine = torch.tensor([h, -h, len(seq), -len(seq)], dtype=torch.int64)
        both = comm.all_reduce(mine.clone(), "max")
        if torch.equal(both, mine):
            return
        seqs = comm.all_gather_object(seq)
        r = next(r for r, other in enumerate(seqs) if other != seq)
        k = next((i for i, (a, b) in enumerate(zip(seq, seqs[r])) if a != b), min(len(seq), len(seqs[r])))
        name = {u.index: u.module_name or "<root>" for u in self.units}
        mine_at = name.get(seq[k], "nothing") if k < len(seq) else "nothing"
        theirs_at = name.get(seqs[r][k], "nothing") if k < len(seqs[r]) else "nothing"
        raise EngineError(
            f"ranks gathered different parameters in this {where}: all-gather {k + 1} was of {mine_at!r} on rank "
            f"{self.rank} and of {theirs_at!r} on rank {r}, so the gathered values mix shards of different modules "
            f"and cannot be trained on. In ZeRO stage 3 every rank must run the same modules in the same order; a "
            f"module that runs on some ranks only (e.g. an expert chosen by routing) must have its parameters "
            f"fetched by a parent that runs on all: infinity.register_external_parameter(parent, p) for each of "
            f"its parameters p")

    def repartition(self, unit: FetchUnit) -> None:
        """The gathered values of ``unit`` were edited: refresh its shard and master weights."""
        full = [acc.to_host(raw_data(p)) for p in unit.params]  # shards built on the host, as at initialize:
        self.gate.join()  # every store takes host values (the NVMe ones write them with aio)
        self.save_fence.wait_writes(comm.timeout_s())  # an asynchronous save may still copy the stores
        if unit.trainable:
            self.opt_store.load_master(unit.opt_offset, unit.shard_of(full, torch.float32))
        if self.policy.partition_params and not self.placement.params_are_master:
            self.param_store.write(unit.param_offset, unit.shard_of(full, self.dtype))
            self.param_store.flush()

    def restore(self, unit: FetchUnit, saved: Optional[List[torch.Tensor]] = None) -> None:
        """Undo edits of ``unit``'s gathered values: copy back ``saved``, or else rebuild them
        from the stored shards (collective): stage 3's parameter store, stages 1-2's master
        weights. Note [edits without modifier_rank] in _gathered.py."""
        if saved is not None:
            with torch.no_grad():
                for p, t in zip(unit.params, saved):
                    raw_data(p).copy_(t)
            return
        self.gate.join()
        if self.policy.partition_params:
            shard = self.param_store.read(unit.param_offset, unit.shard_numel)
        else:
            shard = self.opt_store.read_master(unit.opt_offset, unit.shard_numel)
        shard = shard.to(device=acc.device(), dtype=self.dtype)
        full = torch.empty(self.world_size * unit.shard_numel, dtype=self.dtype, device=acc.device())
        comm.all_gather_into_tensor(full, shard, async_op=False, what=f"restoring {unit.module_name or '<root>'}")
        unit.load_full_into_params(full.view(self.world_size, unit.shard_numel))

    def settle_writes(self) -> None:
        """Wait for the overlapped step and every parameter-shard write in flight."""
        self.gate.join()
        if self.param_store is not None:
            self.param_store.flush()

    def needs_copy_to_restore(self, unit: FetchUnit) -> bool:
        """An edit of ``unit``'s gathered values would also edit the only stored copy: stage
        3 parameters that are views of a resident store (one rank), stage 1-2 frozen
        parameters (whole, and without master weights)."""
        if not self.policy.partition_params:
            return not unit.trainable
        stores = [getattr(self.opt_store, "master", None), self.param_store.flat]
        bases = {t.untyped_storage().data_ptr() for t in stores if t is not None and t.numel()}
        return any(raw_data(p).untyped_storage().data_ptr() in bases for p in unit.params)

    # ------------------------------------------------------------ accounting

    def after_step(self) -> None:
        """Gathered copies of persistent units are stale once the shards were updated."""
        self.prefetcher.release_held()
        for unit in self.units:
            unit.refresh()

    def telemetry(self, reset: bool = True) -> dict:
        """Counters since the last call: stall seconds and bytes per stage, prefetch hit
        rate, trace divergences, NVMe traffic of the stores and collective bytes (deltas,
        like everything else here), and the peak of gathered elements."""
        out = self.counters.snapshot()
        totals = {}
        for name, store in (("optimizer", self.opt_store), ("params", self.param_store)):
            if store is not None and hasattr(store, "bytes_read"):
                totals[f"nvme_{name}_read_bytes"] = store.bytes_read
                totals[f"nvme_{name}_write_bytes"] = store.bytes_written
        for kind, n in comm.counters.snapshot()["bytes"].items():
            totals[f"comm_{kind}_bytes"] = n
        last = self._telemetry_totals
        out.update({k: v - last.get(k, 0) for k, v in totals.items()})
        out["peak_live_parameters"] = self.peak_live_elems
        out["host_memory"] = host_account(self.memory_plan.get("categories"))  # Note [one memory model]
        if reset:
            self.counters.reset()
            self._telemetry_totals = totals
        return out

    @property
    def device_budget(self) -> "acc.DeviceBudget":
        """This engine's device budget (``device_memory_limit``): what its gathered parameters
        and fetched activation checkpoints hold on the device now, and their peak."""
        return self.ledger.budget

    def tier_bytes(self) -> dict:
        """Bytes this rank keeps on each tier (device, host, nvme), pools included."""
        out = {"device": 0, "host": 0, "nvme": 0}
        stores = [self.opt_store] + ([self.param_store] if self.param_store else [])
        for store in stores:
            if store is self.param_store and self.placement.params_are_master:
                continue
            for tier, n in store.nbytes().items():
                out[tier] += n
        if self.gathered is not None:
            out["device"] += self.gathered.capacity  # returned gathered buffers, kept for reuse
        return out

    def close(self) -> None:
        """Remove hooks and this run's swap files (also when the step's error is re-raised:
        a failed run leaves no swap files behind).

        Note [closed engines]: a model holds its engine (``_EngineHold``), closed or not, so
        a user who keeps the model after ``close`` would keep every buffer the engine made.
        ``close`` therefore lets go of them itself: recycled gathered buffers, the parameter
        cache, hand-off and staging buffers, the optimizer's buffer sets, host cache, moments
        and gradients (the master weights in host memory stay: they may be the parameters'
        own shards). Letting go of the model and the optimizer frees the rest (Note
        [parameter side objects] in _param.py)."""
        try:
            try:
                self.save_fence.finish(comm.timeout_s())  # an asynchronous save commits first; its error is raised
            finally:
                self.gate.join()
        finally:
            self.prefetcher.release_held()
            for unit in self.units:
                unit.refresh()  # gathered copies (persistent units) freed: their device bytes leave the budget
            self.remove_hooks()
            for store in (self.opt_store, self.param_store):
                if store is not None:
                    store.close()  # Note [closing handles] in aio/_handle.py
            if self.gathered is not None:
                self.gathered.clear()
            self.swap_dirs.remove()
            if self._block_cache_done is not None:
                self._block_cache_done()  # once: a finalizer runs at most once

    def model_state_bytes(self) -> dict:
        """Bytes of model states this rank holds now: parameters, gradients, optimizer."""
        params = 0
        grads = 0
        for unit in self.units:
            if self.policy.partition_params:
                params += unit.shard_numel * self.itemsize
            else:
                params += sum(raw_data(p).numel() * raw_data(p).element_size() for p in unit.params)
            grads += sum(p.grad.numel() * p.grad.element_size() for p in unit.params if p.grad is not None)
        opt = state_bytes(self.opt_store, self.placement.params_are_master)
        return {"params": params, "grads": grads + opt.get("grads", 0), "optimizer": opt.get("optimizer", 0)}


def _held_weakly(method):
    """A parameter hook that holds its engine weakly. Note [hooks the collector cannot see]:
    torch keeps a parameter's post-accumulate-grad hooks where Python's collector does not
    look, so a hook holding the engine (which holds the model, which holds the parameter)
    would keep all of them alive after the user let go; the model holds its engine instead
    (``_EngineHold``), where the collector sees it."""
    ref = weakref.WeakMethod(method)

    def hook(param):
        bound = ref()
        if bound is not None:
            bound(param)
    return hook


def check_same_model_on_all_ranks(model: nn.Module) -> None:
    sig = [(n, tuple(p.shape), str(p.dtype), "trainable" if p.requires_grad else "frozen")
           for n, p in model.named_parameters()]
    sigs = comm.all_gather_object(sig)
    for r, other in enumerate(sigs):
        if other != sig:
            diff = next(((a, b) for a, b in zip(sig, other) if a != b),
                        (f"{len(sig)} parameters", f"{len(other)} parameters"))
            raise EngineError(
                f"rank {comm.rank()} and rank {r} built different models (first difference: {diff[0]} vs "
                f"{diff[1]}); every data-parallel rank must construct the same model")


def _needs_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()





class _EngineHold:
    """A model's hold on its engine, in the model's ``__dict__`` (Note [hooks the collector
    cannot see]): the model owns its engine at every stage, as a cycle the collector frees
    with both. A copy or a pickle of the model holds no engine."""

    __slots__ = ("engine",)

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def __reduce__(self):
        return type(None), ()


_HOLD = "_infinity_engine"
_live: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # every engine not yet collected, for lookups by unit


def engine_of(model: nn.Module) -> Optional[Engine]:
    hold = model.__dict__.get(_HOLD)
    return hold.engine if hold is not None else None


def live_engines() -> List[Engine]:
    return list(_live)


def engine_of_unit(unit) -> Optional[Engine]:
    """The engine whose units include ``unit`` (None for a unit of infinity.Init)."""
    ctx = getattr(unit, "ctx", None)
    return next((e for e in live_engines() if e.ctx is ctx), None) if ctx is not None else None


def forget_engine(model: nn.Module) -> None:
    """``initialize`` failed after the engine was built: the model is not managed."""
    hold = model.__dict__.pop(_HOLD, None)
    engine = hold.engine if hold is not None else None
    if engine is not None:
        _live.discard(engine)
        engine.swap_dirs.remove()
