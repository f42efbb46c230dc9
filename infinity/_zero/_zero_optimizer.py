"""The partitioned optimizer returned by ``infinity.initialize``.

Each rank owns a flat fp32 space laid out unit after unit in the shard layout (Note [shard
layout] in _unit.py): master weights, gradient shards and Adam moments for its chunks only.
``step()`` unscales (fp16), skips on overflow, clips by the global norm across ranks, runs
Adam on the flat shards (the native CPU Adam when the shards are CPU-resident, else the same
math in torch) over the parameters that got a gradient, each with its group's
hyperparameters and its own step count (Note [update plan] in _param_groups.py), and writes
the updated low-precision values back to the parameters.

Note [non-finite steps]: no step trains on inf/NaN. The check costs nothing extra: the
stores fold finiteness into the squared norm they compute anyway for clipping (one pass
over the gradient shards, fused with their accumulation on NVMe), the loss flag
(``note_loss``, a device-side ``isfinite`` with no synchronisation; ``step(closure)`` notes
the closure's loss) rides in the same all-reduce as the norm, so every rank sees the same
verdict and skips or raises together. fp16 keeps its loss scaler: an overflow backs the scale
off and skips the step. In bf16/fp32 ``precision.on_nonfinite`` decides: ``error`` raises
NonFiniteError naming the step (``step()`` calls so far) and, when the gradients are in
memory, the first parameter whose shard is bad; ``skip`` drops the gradients and leaves
parameters, Adam moments and step counts untouched, like GradScaler skipping
``optimizer.step()``: the bias correction of the next applied step is as if the skipped
step had never happened. A non-finite loss whose gradients are finite (a constant inf term)
is caught only through a noted loss.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from .._offload._layout import ParamSource
from .._offload._optimizer_store import Chunk, MemoryOptimizerStore, OptimizerStore
from .._offload._placement import Placement
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._log import logger
from .._runtime._telemetry_counters import span
from .._runtime._tiers import StagePolicy, Tier
from .._runtime._topology import default_threads
from ..aio import AioError, aligned_empty
from ..errors import EngineError, InvariantError, NativeLibraryMissing, NonFiniteError, NotSupportedError, UsageError
from ..optim import adam_step
from ..optim._functional import torch_adam_step
from ..optim._native import lib as native_adam_library
from ._grad_sink import Received
from ._loss_scale import LossScaler
from ._param_groups import (
    StepCounts,
    UpdatePlan,
    check_group_hyper,
    first_nonfinite,
    gaps,
    label_at,
    named_parameters,
    pieces,
    runs_in,
    slots_of,
    unit_labels,
)
from ._seams import Action, EngineSurface
from ._speculative_update import Speculated, SpeculativeUpdate
from ._step_gate import StepGate, StepStopped
from ._whole_params import gather_into_whole_params

if TYPE_CHECKING:
    from .._offload._param_store import ParamStore
    from .._runtime._telemetry_counters import Counters
    from ._engine import Engine
    from ._grad_sink import GradSink
    from ._unit import FetchUnit


def _native_adam():
    """The native CPU Adam, or None (with a warning) where its library was not built."""
    try:
        native_adam_library()
    except NativeLibraryMissing as e:
        logger.warning("native CPU Adam unavailable (%s); using torch's Adam math", e)
        return None
    return adam_step


@dataclass(frozen=True)
class _StepUndo:
    """What a step changes before its update touches a state, as it was (Note [failed step] in
    _step_gate.py)."""

    counts: torch.Tensor  # StepCounts.counts
    step: int
    scale: Optional[dict]  # the loss scaler's state (fp16)


@dataclass(frozen=True)
class EngineOps:
    """Note [the optimizer's engine]: what the optimizer asks of the engine, built by
    ``initialize`` (the composition root) once the engine exists: the parts it shares with
    the engine, a few facts, and three named operations. The optimizer never reads the
    engine's attributes itself, so the engine's insides can change without it."""

    units: Sequence["FetchUnit"]
    dtype: torch.dtype  # the compute dtype
    rank: int
    world_size: int
    policy: StagePolicy  # at stage 3 the step writes the parameter store; at stages 1-2 it gathers whole parameters
    placement: Placement
    store: OptimizerStore
    param_store: Optional["ParamStore"]
    scaler: Optional[LossScaler]  # fp16's
    counters: "Counters"
    # Note [injected operations] in _seams.py: each one's provider is named at ``Action``
    wait_for_saves: Action  # an asynchronous save still copying swap files (Note [save fence] in _save_fence.py)
    reduce_rest: Action  # stage 1: every gradient reduced now (stages 2-3 did it in backward)
    after_step: Action  # the parameters changed: persistent units' gathered copies are stale
    end_aborted_backward: Action  # Note [aborted backward] in _backward.py


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch Optimizer over this rank's flat fp32 shards; LR schedulers work on it.

    The shards live in an optimizer store on the tier ``zero.offload_optimizer.device``
    chooses; stage 3's compute-dtype parameter shards live in a ParamStore on the tier of
    ``zero.offload_param.device``. Both are laid out unit after unit (``unit.opt_offset``,
    ``unit.param_offset``); frozen units have no optimizer state (Note [frozen parameters]
    in _layout.py).
    """

    def __init__(self, engine: "Engine", ops: "EngineOps", cfg, groups: List[dict], *, sink: "GradSink",
                 gate: StepGate):
        self.engine: EngineSurface = engine  # Note [what the optimizer's holders see] in _seams.py; the step uses ``ops``
        self.ops = ops  # Note [the optimizer's engine]
        self.cfg = cfg
        self.placement = placement = ops.placement
        self.opt_tier = placement.opt_tier
        self.param_tier = placement.param_tier
        self.layout = placement.layout
        self.total = self.layout.opt_total
        self.overlap = placement.overlap
        self.grads_in_memory = placement.grads_in_memory
        self.store = ops.store
        self.param_store = ops.param_store
        self.scaler = ops.scaler
        self.sink = sink
        self.gate = gate  # Note [step gate] in _step_gate.py: this step owns it
        oc = cfg.optimizer
        named = named_parameters(ops.units)  # groups: torch-style, resolved against the model by initialize
        defaults = dict(lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)
        self._building = True  # torch's __init__ adds the groups; add_param_group refuses afterwards
        super().__init__(groups, defaults)
        self._building = False
        self.adamw = oc.type == "adamw"
        check_group_hyper(self.param_groups, self.adamw)
        self.steps = StepCounts(slots_of(ops.units, self.param_groups), len(named))
        self._index_of = {id(p): i for i, (_, p) in enumerate(named)}
        self._adam = _native_adam() if acc.device().type == "cpu" or self.opt_tier is not Tier.DEVICE else None
        self.last_grad_norm: Optional[float] = None
        self.skipped = False
        self._step = 0  # steps applied (skipped ones excluded, as GradScaler skips optimizer.step)
        self._calls = 0  # step() calls, skipped ones included: the step named by errors
        self.nonfinite_skipped = 0  # steps skipped for inf/NaN under precision.on_nonfinite: skip
        self._loss_ok: Optional[torch.Tensor] = None  # all losses noted since the last step were finite
        self._chunks_begun = 0  # chunks of this step whose update began (Note [failed step] in _step_gate.py)
        self._labels = unit_labels(ops.units)  # a chunk's first unit, for its profiler range
        self._got_last: Optional[torch.Tensor] = None  # which parameters got a gradient last step, on any rank
        self.speculation = SpeculativeUpdate(  # Note [speculative update] in _speculative_update.py
            self.store, ops.units, cfg.gradient_accumulation_steps, update=self._speculate_chunk,
            outputs=lambda offset, n: self._step_targets(offset, n, None), plan=self._speculative_plan,
            gate=gate, counters=ops.counters) if placement.speculate and isinstance(self.store, MemoryOptimizerStore) \
            and self._adam is not None else None  # the torch math scales the gradients in place: no guess to redo

    @property
    def grad_scale(self) -> float:
        """The factor applied to each gradient as it is accumulated: 1 / (ranks x
        accumulation steps), so the update averages over both. A caller that already divides
        its loss by the accumulation steps (Hugging Face's Trainer) sets 1 / ranks."""
        return self.sink.grad_scale

    @grad_scale.setter
    def grad_scale(self, value: float) -> None:
        self.sink.grad_scale = float(value)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_building", False):
            return super().add_param_group(param_group)
        raise EngineError("infinity's optimizer lays out its states for the parameter groups it was built with; "
                           "pass every group to infinity.initialize(model, config=cfg, param_groups=[...]) instead "
                           "of calling add_param_group afterwards")

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        spec = None
        if self.speculation is not None:  # Note [speculative update] in _speculative_update.py
            self.sink.flush()  # every gradient of this step landed, and counted, before the guess is taken
            spec = self.speculation.take(learn=True)
        try:
            self._ready()
        except BaseException:
            if spec is not None:
                spec.put_back()
            raise
        undo = _StepUndo(self.steps.counts.clone(), self._step, self.scaler.state_dict() if self.scaler else None)
        self._chunks_begun = 0
        try:
            self._update(loss, undo, spec)
        except BaseException as e:  # Note [failed step] in _step_gate.py
            if spec is not None:
                spec.put_back()  # unless it was committed: then its pieces count as begun
            self.gate.fail(e, changed=self._step_failed(e, undo), raised=True)
            raise
        return loss

    def _update(self, loss, undo: "_StepUndo", spec: Optional[Speculated] = None) -> None:
        part = self.ops.counters.step_part
        self._gradients_in()
        self._calls += 1
        if loss is not None:
            self.note_loss(loss)
        with part("norm"):
            stats, finite, bad_loss = self._global_stats()
        self._got_last = stats[3:].clone()
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0  # the scale these gradients carry
        if self._nonfinite(stats, finite, bad_loss):
            if spec is not None:
                spec.put_back()
            self.skipped = True
            self._finish_step()
            return
        self.skipped = False
        coef = self._grad_coef(math.sqrt(stats[0].item()) * inv_scale, inv_scale)
        self._step += 1
        plan = self.steps.advance(stats[3:], self.param_groups, self.adamw)  # Note [update plan] in _param_groups.py
        if coef != 1.0:  # Adam multiplies each gradient as it reads it: no pass of its own over them
            plan = plan.with_hyper(grad_scale=coef)
        ready_from = math.inf
        if spec is not None and self.overlap and spec.stands(plan):
            ready_from = spec.ready_from
            committed = spec.commit()
            self._chunks_begun += committed  # the states changed: Note [failed step] in _step_gate.py
            self.ops.counters.speculation["committed"] += committed
        elif spec is not None:
            spec.put_back()
        out_flat = self._whole_params_out()
        self.store.seal_grads()
        if self.overlap:
            with part("launch"):
                self._launch_step(plan, undo, ready_from)
            return
        with part("update"):
            self.store.update(lambda chunk: self._update_chunk(chunk, plan, out_flat))
        if self.param_store is not None:
            self.param_store.flush()
            self.ops.after_step()
        elif out_flat is not None:  # stages 1-2: the whole parameters take the fresh values
            gather_into_whole_params(self.ops.units, self.ops.world_size, self.ops.dtype, out_flat,
                                     self.cfg.zero.reduce_bucket_size)
        self._finish_step()

    def _ready(self) -> None:
        """Before a step begins, changing nothing: no gradient partial (Note [aborted backward]
        in _backward.py), the previous step joined (its failure raised: Note [failed step] in
        _step_gate.py), no save copying the swap files."""
        self.ops.end_aborted_backward()
        if self.sink.received is Received.PARTIAL:
            raise EngineError(
                f"step {self._calls + 1}: a backward since the last zero_grad() ended by an exception, so the "
                f"gradients accumulated since then are partial (some layers' are in, the rest never came); nothing "
                f"was updated. Call optimizer.zero_grad() to discard them and go on with the next batch")
        with self.ops.counters.step_part("previous_step"):
            self.wait_step()
        self.ops.wait_for_saves()  # Note [save fence] in _save_fence.py

    def _step_failed(self, error: BaseException, undo: "_StepUndo") -> bool:
        """Note [failed step] in _step_gate.py: whether the failed step changed a state (Adam
        began on a chunk, a write failed, a request is still in flight, or another rank's step
        may have gone through); if not, it is undone and its gradients dropped."""
        if isinstance(error, StepStopped):  # on its own thread: its reads and writes end with it
            self.store.abandon_update()
            return True
        if self._chunks_begun or self.ops.world_size > 1 or isinstance(error, TimeoutError) \
                or (isinstance(error, AioError) and error.op == "write"):  # Note [one rank] in _runtime/_comm.py
            return True
        self.steps.counts.copy_(undo.counts)
        self._step = undo.step
        if self.scaler is not None and undo.scale is not None:
            self.scaler.load_state_dict(undo.scale)
        self.sink.discard()
        self.store.abandon_update()
        return False

    def _gradients_in(self) -> None:
        """Before the step reads the gradients: no fetch's copy reading a host shard the step
        rewrites, every gradient reduced and in the store."""
        part = self.ops.counters.step_part
        with part("parameter_copies"):
            if self.param_store is not None:
                self.param_store.wait_copies()  # the step rewrites host shards a fetch's copy may still read
        self.ops.reduce_rest()  # stage 1; stages 2-3 reduced at the end of each backward
        with part("gradients_landing"):
            self.sink.flush()
        with self.ops.counters.blocked("grad_offload"):
            self.store.finalize_grads()

    def _global_stats(self) -> tuple:
        """(the all-reduced [squared norm, non-finite gradients, non-finite losses, which
        parameters got a gradient...], this rank's gradients finite, this rank's losses bad):
        one collective (Note [non-finite steps])."""
        sq, finite = self.store.grad_stats()
        bad_loss = 0.0 if self._loss_ok is None or bool(self._loss_ok) else 1.0
        self._loss_ok = None
        head = torch.tensor([sq, 0.0 if finite else 1.0, bad_loss], dtype=torch.float64)
        stats = torch.cat([head, self.sink.got_grad])
        comm.all_reduce(stats, "sum", what=f"gradient norm of step {self._calls}")
        self.sink.got_grad.zero_()  # the step consumes this backward's gradients (the store's are sealed later)
        return stats, finite, bad_loss

    def _nonfinite(self, stats: torch.Tensor, finite: bool, bad_loss: float) -> bool:
        """Whether any rank saw inf/NaN: fp16 backs its loss scale off (and grows it after a
        clean window), bf16/fp32 raise or count a skip (Note [non-finite steps])."""
        nonfinite = bool(stats[1].item() > 0 or stats[2].item() > 0)
        if self.scaler is not None:
            self.scaler.update(nonfinite)
        elif nonfinite:
            self._on_nonfinite(grads_bad=not finite, loss_bad=bool(bad_loss), any_grad_bad=stats[1].item() > 0)
        return nonfinite

    def _grad_coef(self, norm: float, inv_scale: float) -> float:
        """Unscaling and clipping by the global norm, as one coefficient Adam applies to each
        gradient as it reads it (``grad_scale``)."""
        self.last_grad_norm = norm
        coef = inv_scale
        clip = self.cfg.gradient_clipping
        if clip > 0:
            clip_coef = clip / (norm + 1e-6)
            if clip_coef < 1.0:
                coef *= clip_coef
        return coef

    def _whole_params_out(self) -> Optional[torch.Tensor]:
        """Stages 1-2: where the updated compute-dtype shards go before they are all-gathered
        into the whole parameters: where Adam runs (host memory for a native CPU Adam), or the
        master weights themselves in fp32 in memory. None at stage 3."""
        if self.ops.policy.partition_params:
            return None
        dtype = self.ops.dtype
        master = self.store.master_view()
        if dtype == torch.float32 and master is not None:
            return master
        if self.opt_tier is not Tier.DEVICE:
            return aligned_empty(self.total, dtype, what="step outputs")
        return torch.empty(self.total, dtype=dtype, device=acc.device())

    def note_loss(self, loss: torch.Tensor) -> None:
        """Have the next ``step()`` check ``loss`` (and any other noted since the last step)
        for inf/NaN along with the gradients: Note [non-finite steps]. No synchronisation
        here; ``step`` reads the flag with the norm it reads anyway."""
        ok = torch.isfinite(loss.detach()).all()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok

    def _on_nonfinite(self, *, grads_bad: bool, loss_bad: bool, any_grad_bad: bool) -> None:
        """Note [non-finite steps]: bf16/fp32 (fp16 has its loss scaler) with an inf/NaN loss
        or gradient: raise, or skip the step (the caller leaves parameters and states as they
        are) with a warning and a count."""
        what = " and ".join(w for w, bad in (("the loss", loss_bad), ("the gradients", any_grad_bad)) if bad)
        where = first_nonfinite(self.store.grads_flat(), self.ops.units) if grads_bad else None
        at = (f"; first in this rank's shard of {where}" if where else
              "; in another rank's gradient shard" if any_grad_bad and not grads_bad else "")
        rank = self.ops.rank
        if self.cfg.precision.on_nonfinite == "error":
            raise NonFiniteError(
                f"rank {rank}: step {self._calls}: inf or NaN in {what}{at} ({self.ops.dtype}); nothing was "
                f"updated. Look for bad values in that step's batch or a diverging run (lower optimizer.lr, set "
                f"gradient_clipping), or set precision.on_nonfinite: skip to skip such steps")
        self.nonfinite_skipped += 1
        logger.warning("rank %d: step %d skipped: inf or NaN in %s%s (%d skipped so far; "
                       "precision.on_nonfinite: skip)", rank, self._calls, what, at, self.nonfinite_skipped)

    # ------------------------------------------------------------ overlapped step

    def _launch_step(self, plan: UpdatePlan, undo: "_StepUndo", ready_from: float = math.inf) -> None:
        """Note [overlapped step]: at stage 3 with the optimizer states off the device, the
        update runs on a background thread, chunk by chunk in flat (= unit, = forward) order,
        while the next forward and backward run (``zero.offload_optimizer.overlap_step``;
        ``Placement.of`` decides): with an accelerator always, since the device computes while
        the host updates (the step then takes about the larger of the two, not their sum), on
        all the cores the rank may use; on the CPU alone only when the step is bound by its
        reads and writes (an NVMe tier), since there the forward needs the cores. The step gate's published
        offset (Note [step gate] in _step_gate.py) is the flat offset below which every shard
        is updated (its write to the parameter tier may still be in flight: a fetch that reads
        the tier waits for the writes first); a unit is fetched only once its range is below it
        (``StepGate.wait``), so no computation ever sees a stale parameter. The next backward
        needs no wait either: it writes the gradients of a unit only after computing with
        that unit, which was fetched, hence updated, hence its gradient range (whole chunks)
        already read by the step. A second step, GatheredParameters edits, reading master
        weights and close wait for the whole step (``wait_step``). Time the main thread
        spends waiting on the step is telemetry's ``optimizer_io`` stall."""
        self.ops.after_step()  # persistent units' gathered copies are about to be stale
        self.gate.open(ready_from)  # Note [speculative update] in _speculative_update.py: those are updated
        # The cached head (Note [host cache] in _nvme_optimizer_store.py) is what the next forward needs first:
        # update it here, on every core, from memory; the background thread streams the rest.
        self.store.update_head(lambda chunk: self._update_chunk(chunk, plan, None, publish=True))
        self.gate.run_in_background(lambda: self._run_tail(plan), changed=lambda e: self._step_failed(e, undo))

    def _run_tail(self, plan: UpdatePlan) -> None:
        # With an accelerator the device computes the next forward and the host's cores are
        # free: the update takes all of them. On the CPU alone, one thread for the math while
        # the next forward computes on the other cores; every thread while the forward waits
        # for this step (the large-model regime: the step is then the critical path, and its
        # arithmetic would otherwise run on one core).
        alone = plan.with_hyper(num_threads=1) if self._adam is not None and not acc.has_accelerator() else plan

        def update(chunk: Chunk) -> None:
            self.gate.check_stop()  # Note [interrupted step] in _step_gate.py
            self._update_chunk(chunk, plan if self.gate.waited_on else alone, None, publish=True)

        self.store.update_tail(update)
        self._stage3_params().flush()
        self._stage3_params().release_idle()  # all written: idle until the next step (Note [released pages] in _memory.py)

    def wait_step(self) -> None:
        """Join an in-flight overlapped step; re-raise its error, if any."""
        self.gate.join()

    def _update_chunk(self, chunk: Chunk, plan: UpdatePlan, out_flat: Optional[torch.Tensor],
                      publish: bool = False) -> None:
        """Adam on the parts of one chunk the plan covers (Note [update plan] in _param_groups.py); the chunk's
        fresh compute-dtype values go where they belong (fused into Adam's pass where the
        native Adam can write them). A profiler range (Note [profiler ranges] in _telemetry_counters.py)."""
        with span("infinity::update_chunk", label_at(self._labels, chunk.offset)):
            self._chunks_begun += 1  # the states change from here on: Note [failed step] in _step_gate.py
            self._update_chunk_in_range(chunk, plan, out_flat, publish)

    def _speculate_chunk(self, chunk: Chunk, plan: UpdatePlan) -> None:
        """One piece of a speculative update (Note [speculative update] in _speculative_update.py):
        the same Adam calls as the step's, on the speculation's thread, with its undo log kept."""
        with span("infinity::speculative_update_chunk", label_at(self._labels, chunk.offset)):
            self._update_chunk_in_range(chunk, plan, None, publish=False, speculative=True)

    def _speculative_plan(self) -> Optional[UpdatePlan]:
        """The plan the step will have if nothing clips and every parameter that got a gradient
        last step (all, before the first) gets one now. None under ``speculate: on`` when the
        last step clipped (or came first, with clipping on) or met inf/NaN: the guess would
        likely be put back, which costs a copy of every piece it updated (Note [speculative
        update] in _speculative_update.py)."""
        clip, adaptive = self.cfg.gradient_clipping, self.cfg.zero.offload_optimizer.speculate == "on"
        if adaptive and (self.skipped or (clip > 0 and (self.last_grad_norm is None or self.last_grad_norm >= clip))):
            return None  # speculate: always guesses every step
        got = self._got_last if self._got_last is not None else torch.ones(self.steps.num_params)
        plan = self.steps.peek(got, self.param_groups, self.adamw)
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        return plan.with_hyper(grad_scale=inv_scale) if inv_scale != 1.0 else plan

    def _update_chunk_in_range(self, chunk: Chunk, plan: UpdatePlan, out_flat: Optional[torch.Tensor],
                               publish: bool, speculative: bool = False) -> None:
        began = time.perf_counter()
        n = chunk.master.numel()
        end = chunk.offset + n
        ps = self.param_store
        targets = self._step_targets(chunk.offset, n, out_flat)  # (start, view) for the fresh values
        fused = (self._adam is not None and self.ops.dtype != torch.float32 and bool(targets)
                 and all(out.device.type == "cpu" for _, out in targets))  # the native Adam writes host memory
        done = []  # ranges whose fresh values a fused Adam wrote
        src = chunk.sources  # Note [second state set] in _optimizer_store.py: read there, written to the chunk's
        for lo, hi, hyper in runs_in(plan, chunk.offset, end):
            sl = slice(lo - chunk.offset, hi - chunk.offset)
            args = (chunk.master[sl], chunk.grad[sl], chunk.exp_avg[sl], chunk.exp_avg_sq[sl])
            if self._adam is None:
                torch_adam_step(*args, **hyper)
            elif not fused:
                self._adam(*args, **hyper, **({"sources": tuple(t[sl] for t in src)} if src else {}))
            else:  # one native call per target piece, each writing its own output
                for a, b, out in pieces(lo, hi, targets):
                    s = slice(a - chunk.offset, b - chunk.offset)
                    self._adam(chunk.master[s], chunk.grad[s], chunk.exp_avg[s], chunk.exp_avg_sq[s], params_out=out,
                               **hyper, **({"sources": tuple(t[s] for t in src)} if src else {}))
                done.append((lo, hi))
        if src is not None:  # what no run updates carries over to the second set
            for lo, hi in gaps(chunk.offset, end, [(a, b) for a, b, _ in runs_in(plan, chunk.offset, end)]):
                for dst, t in zip((chunk.master, chunk.exp_avg, chunk.exp_avg_sq), src):
                    dst[lo - chunk.offset : hi - chunk.offset].copy_(t[lo - chunk.offset : hi - chunk.offset])
        for lo, hi in gaps(chunk.offset, end, done):  # what Adam did not write
            for a, b, out in pieces(lo, hi, targets):
                out.copy_(chunk.master[a - chunk.offset : b - chunk.offset])
        chunk.changed = [(lo, hi) for lo, hi, _ in runs_in(plan, chunk.offset, end)]  # Note [unchanged ranges are
        # not written] in _swap_pipeline.py
        upto = chunk.offset + n
        if ps is not None and not speculative:  # on NVMe, each unit complete is written (async) and handed off
            # (Note [hand-off] in _nvme_param_store.py)
            upto = self._outputs_done(chunk.offset, end, chunk.changed)
        if chunk.grad_read is not None:  # before the next backward may add to it
            chunk.grad_read()  # Note [one gradient buffer] in _optimizer_store.py
        self.ops.counters.note_update(time.perf_counter() - began, n, _threads_of(plan, self._adam is not None),
                                      threading.current_thread() is not threading.main_thread())
        if publish:  # its parameter writes may still be in flight: NvmeParamStore.start_read waits for them
            self.gate.publish(upto)

    def _stage3_params(self) -> "ParamStore":
        """The parameter store, which exists at stage 3, the only stage whose step overlaps or
        writes parameter outputs (Note [overlapped step])."""
        if self.param_store is None:
            raise InvariantError("the step reached stage 3's parameter store in a run without one")
        return self.param_store

    def _outputs_done(self, lo: int, hi: int, changed: List[tuple]) -> int:
        """Report [lo, hi) of the optimizer's space written to the NVMe parameter tier's step
        outputs, and whether the step ``changed`` any of each piece; the optimizer-space offset
        below which everything the step produced is written (the start of the first unit
        still filling, else ``hi``)."""
        upto = hi
        for a, b, p in self.layout.param_pieces(lo, hi):
            touched = any(x < b and y > a for x, y in changed)
            done = self._stage3_params().step_outputs_done(p, b - a, touched)
            if done < p + (b - a) and upto == hi:
                upto = self.layout.to_opt(done)
        return upto

    def _step_targets(self, offset: int, n: int, out_flat: Optional[torch.Tensor]) -> list:
        """(start, view) pieces of [offset, offset + n) that receive the updated compute-dtype
        values: the gathered flat of stages 1-2, the resident parameter shards, the NVMe
        parameter tier's output tensors; none where the master weights are the parameters."""
        if out_flat is not None:
            same = out_flat.dtype == torch.float32 and out_flat is self.store.master_view()
            return [] if same else [(offset, out_flat[offset : offset + n])]
        ps = self.param_store
        if ps is None or self.placement.param_source is ParamSource.MASTER:
            return []
        out = []
        for a, b, p in self.layout.param_pieces(offset, offset + n):  # Note [frozen parameters] in _layout.py
            out += [(a + (start - p), view) for start, view in ps.step_outputs(p, b - a)]
        return out

    def _finish_step(self) -> None:
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last step, wherever they are: the
        store's, ``.grad``, copies still landing, which parameters got one, the losses noted;
        a backward that raised is ended first (Note [aborted backward] in _backward.py)."""
        self.ops.end_aborted_backward()
        if self.speculation is not None:  # its guess read the gradients dropped: Note [speculative update] in
            # _speculative_update.py
            self.speculation.abandon()
            self.speculation.take()  # and the next gradients are the next step's
        self.sink.discard()
        self.store.zero_grads()  # the accumulating gradients; an overlapped step reads sealed ones
        for unit in self.ops.units:
            unit.drop_grads()
        self._loss_ok = None

    def state_dict(self):
        raise NotSupportedError(_NO_STATE_DICT)

    def load_state_dict(self, state_dict) -> None:
        raise NotSupportedError(_NO_STATE_DICT)

    def step_count(self, param) -> int:
        """Optimizer steps ``param`` has taken (0 if it never had a gradient): torch's
        ``state[param]["step"]`` (Note [update plan] in _param_groups.py)."""
        index = self._index_of.get(id(param))
        if index is None:
            raise UsageError("step_count: not a parameter of this optimizer's model")
        return self.steps.step_of(index)

    # ------------------------------------------------------------ accounting

    def state_bytes(self) -> dict:
        """Optimizer states (fp32 master unless it is the parameter shard, Adam moments) and
        gradient shards this rank holds in memory."""
        return self.store.state_bytes(self.placement.param_source)


_NO_STATE_DICT = (
    "infinity's optimizer keeps its states (fp32 master weights, Adam moments, step counts) sharded across ranks and "
    "tiers, which a torch state_dict cannot hold; save and resume them with infinity.save_checkpoint(dir, model, "
    "optimizer) and infinity.load_checkpoint(dir, model, optimizer), and export the weights with "
    "`python -m infinity.export CHECKPOINT OUT_DIR`.")


def _threads_of(plan: UpdatePlan, native: bool) -> int:
    """Threads the update of ``plan`` runs on: the native Adam's (its default, the rank's share:
    Note [rank placement] in _topology.py), else torch's."""
    asked = plan.runs[0].hyper.get("num_threads") if native and plan.runs else None
    return asked or (default_threads() if native else torch.get_num_threads())
