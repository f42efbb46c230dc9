"""The partitioned optimizer returned by ``infinity.initialize``.

Each rank owns a flat fp32 space laid out unit after unit in the shard layout (Note [shard
layout] in _unit.py): master weights, gradient shards and Adam moments for its chunks only.
``step()`` unscales (fp16), skips on overflow, clips by the global norm across ranks, runs
Adam on the flat shards (the native CPU Adam when the shards are CPU-resident, else the same
math in torch) over the parameters that got a gradient, each with its group's
hyperparameters and its own step count (Note [update plan] in _param_groups.py), and writes
the updated low-precision values back to the parameters.
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, List, Optional

import torch

from . import _accelerator as acc
from . import _comm as comm
from ._layout import Layout
from ._log import logger
from ._loss_scale import LossScaler
from ._param_groups import Plan, StepCounts, check_group_hyper, gaps, named_parameters, runs_in, slots_of
from ._preflight import direct_reads, gradients_in_host, preflight, staging_buffers
from ._reduce import GradReducer
from ._stores import (
    ALIGN_ELEMS,
    Chunk,
    MemoryOptimizerStore,
    NvmeOptimizerStore,
    ParamStore,
    chunk_elems,
)
from ._swap import SwapDir
from ._tiers import Tier
from .errors import EngineError, NotSupportedError, UsageError, WaitTimeout

if TYPE_CHECKING:
    from ._engine import Engine
    from ._unit import FetchUnit


def _native_adam():
    try:
        from .optim import adam_step
    except ImportError as e:  # the native library was not built
        logger.warning("native CPU Adam unavailable (%s); using torch's Adam math", e)
        return None
    return adam_step


def torch_adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay, adamw):
    """torch.optim.Adam/AdamW's single-tensor math, elementwise identical."""
    beta1, beta2 = betas
    if adamw:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch Optimizer over this rank's flat fp32 shards; LR schedulers work on it.

    The shards live in an optimizer store on the tier ``zero.offload_optimizer.device``
    chooses; stage 3's compute-dtype parameter shards live in a ParamStore on the tier of
    ``zero.offload_param.device``. Both are laid out unit after unit (``unit.opt_offset``,
    ``unit.param_offset``); frozen units have no optimizer state (Note [frozen parameters]
    in _layout.py).
    """

    def __init__(self, engine: "Engine", cfg, groups: List[dict]):
        self.engine = engine
        self.cfg = cfg
        oc = cfg.optimizer
        z = cfg.zero
        self.opt_tier = Tier.of(z.offload_optimizer.device)
        self.param_tier = Tier.of(z.offload_param.device) if engine.policy.partition_params else Tier.DEVICE
        align = ALIGN_ELEMS if Tier.NVME in (self.opt_tier, self.param_tier) else 1
        self.layout = Layout.assign(engine.units, align)
        self.total = total = self.layout.opt_total
        self.unit_ranges = list(self.layout.opt_ranges)  # each trainable unit's flat shard range
        # Note [overlapped step]: stage 3 with the optimizer states, or the parameters with the
        # optimizer states in host memory, on NVMe steps in the background.
        states_in_host = self.opt_tier is Tier.CPU or (self.opt_tier is Tier.DEVICE and acc.device().type == "cpu")
        self.overlap = engine.policy.partition_params and (
            self.opt_tier is Tier.NVME or (self.param_tier is Tier.NVME and states_in_host))
        self.grads_in_memory = self.opt_tier is Tier.NVME and gradients_in_host(
            engine.cfg.zero.offload_optimizer.gradients, total)  # Note [gradients in host memory] in _stores.py
        self.memory_plan = preflight(engine, self)  # Note [one memory model] in _memory.py
        engine.swap_dirs = {}
        self.store = self._make_store(total)
        for unit in engine.units:
            if unit.trainable:
                self.store.load_master(unit.opt_offset, unit.local_shard(torch.float32))
        named = named_parameters(engine.units)  # groups: torch-style, resolved against the model by initialize
        defaults = dict(lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)
        self._building = True  # torch's __init__ adds the groups; add_param_group refuses afterwards
        super().__init__(groups, defaults)
        self._building = False
        self.adamw = oc.type == "adamw"
        check_group_hyper(self.param_groups, self.adamw)
        self.steps = StepCounts(slots_of(engine.units, self.param_groups), len(named))
        self._got_grad = torch.zeros(len(named), dtype=torch.float64)  # Note [update plan]
        self._unit_first = _first_param_index(engine.units)
        self._index_of = {id(p): i for i, (_, p) in enumerate(named)}
        self.param_store = self._make_param_store() if engine.policy.partition_params else None
        self._adam = _native_adam() if acc.device().type == "cpu" or self.opt_tier is not Tier.DEVICE else None
        self.scaler = LossScaler(static_scale=cfg.precision.loss_scale, initial_scale_power=cfg.precision.initial_scale_power,
                                 window=cfg.precision.loss_scale_window, hysteresis=cfg.precision.hysteresis,
                                 min_scale=cfg.precision.min_loss_scale) if engine.dtype == torch.float16 else None
        self.grad_scale = 1.0 / (engine.world_size * cfg.gradient_accumulation_steps)
        engine.reducer = GradReducer(engine.units, engine.world_size, z.reduce_bucket_size, self._accumulate,
                                     drop_full_grads=engine.policy.reduce_in_backward,
                                     consumers_done=self.store.wait_grad_writes, on_add=self._note_grads)
        self.last_grad_norm: Optional[float] = None
        self.skipped = False
        self._step = 0
        self._bg: Optional[threading.Thread] = None
        self._bg_error: Optional[BaseException] = None
        self._updated_upto = math.inf
        self._cond = threading.Condition()

    def _swap_dir(self, nvme_path: str) -> SwapDir:
        dirs = self.engine.swap_dirs
        if nvme_path not in dirs:
            dirs[nvme_path] = SwapDir(nvme_path, self.engine.rank)
        return dirs[nvme_path]

    def _make_store(self, total: int):
        z = self.cfg.zero
        if self.opt_tier is Tier.NVME:
            return NvmeOptimizerStore(total, self.unit_ranges, self._swap_dir(z.offload_optimizer.nvme_path), self.cfg.aio,
                                      z.offload_optimizer.chunk_size, self.cfg.gradient_accumulation_steps,
                                      z.offload_optimizer.host_cache, self.grads_in_memory)
        return MemoryOptimizerStore(self.opt_tier, total, lazy_grad=not self.engine.policy.reduce_in_backward,
                                    overlapped=self.overlap, ranges=self.unit_ranges, chunk=z.offload_optimizer.chunk_size)

    def _make_param_store(self) -> ParamStore:
        z = self.cfg.zero
        alias = self.store.master if self.params_are_master else None
        return ParamStore(self.param_tier, self.engine.dtype, self.layout.param_total,
                          swap=self._swap_dir(z.offload_param.nvme_path) if self.param_tier is Tier.NVME else None,
                          aio_cfg=self.cfg.aio, alias=alias,
                          max_unit=max((u.shard_numel for u in self.engine.units), default=0),
                          buffer_size=z.offload_param.buffer_size,
                          buffer_count=staging_buffers(z),
                          slots=self.layout.param_slots(), direct_reads=direct_reads(self.engine),
                          update_chunk=chunk_elems(z.offload_optimizer.chunk_size, self.total))

    @property
    def params_are_master(self) -> bool:
        """fp32 with parameters and optimizer states on one resident tier: the master
        weights are the parameter shards (no second copy)."""
        return (self.engine.dtype == torch.float32 and self.param_tier is self.opt_tier and self.opt_tier.resident
                and self.layout.same_spaces)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_building", False):
            return super().add_param_group(param_group)
        raise EngineError("infinity's optimizer lays out its states for the parameter groups it was built with; "
                           "pass every group to infinity.initialize(model, config=cfg, param_groups=[...]) instead "
                           "of calling add_param_group afterwards")

    @property
    def aliased(self) -> bool:
        return self.param_store is not None and self.param_store.flat is not None and \
            self.param_store.flat is getattr(self.store, "master", None)

    # ------------------------------------------------------------ gradients

    def _note_grads(self, unit: "FetchUnit") -> None:
        """The reducer takes ``unit``'s gradients: flag the parameters that have one."""
        first = self._unit_first[unit.index]
        for j, p in enumerate(unit.params):
            if p.grad is not None:
                self._got_grad[first + j] = 1.0

    def _accumulate(self, unit: "FetchUnit", shard_grad: torch.Tensor) -> None:
        with self.engine.counters.blocked("grad_offload"):
            self.store.accumulate(unit.opt_offset, shard_grad, self.grad_scale)
        self.engine.counters.bytes["grad_offload"] += shard_grad.numel() * 4

    def scale_outputs(self, output) -> None:
        """fp16: scale the gradient entering the graph at the model's outputs."""
        from ._engine import _tensors

        outs = [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
        scale = self.scaler.scale
        for t in _terminal(outs):
            t.register_hook(lambda g, s=scale: g * s)

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        engine = self.engine
        self.wait_step()
        if not engine.policy.reduce_in_backward:  # stages 2-3 reduced at the end of each backward
            for unit in engine.units:
                engine.reducer.add(unit)
            engine.reducer.finish()
        with engine.counters.blocked("grad_offload"):
            self.store.finalize_grads()
        sq, finite = self.store.grad_stats()
        stats = torch.cat([torch.tensor([sq, 0.0 if finite else 1.0], dtype=torch.float64), self._got_grad])
        comm.all_reduce(stats, "sum")  # the norm, overflow and which parameters got a gradient, in one collective
        self._got_grad.zero_()  # the step consumes this backward's gradients (the store's are sealed below)
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            overflow = bool(stats[1].item() > 0)
            self.scaler.update(overflow)
            if overflow:
                self.skipped = True
                self._finish_step()
                return loss
        self.skipped = False
        self.last_grad_norm = math.sqrt(stats[0].item()) * inv_scale
        coef = inv_scale
        clip = self.cfg.gradient_clipping
        if clip > 0:
            clip_coef = clip / (self.last_grad_norm + 1e-6)
            if clip_coef < 1.0:
                coef *= clip_coef
        if coef != 1.0:
            self.store.scale_grads(coef)
        self._step += 1
        plan = self.steps.advance(stats[2:], self.param_groups, self.adamw)  # Note [update plan]
        out_flat = None  # stages 1-2: the updated compute-dtype shards, gathered after the update
        if not engine.policy.partition_params:
            in_memory_fp32 = engine.dtype == torch.float32 and isinstance(self.store, MemoryOptimizerStore)
            out_flat = self.store.master if in_memory_fp32 else torch.empty(self.total, dtype=engine.dtype,
                                                                           device=acc.device())
        self.store.seal_grads()
        if self.overlap:
            self._launch_step(plan)
            return loss
        self.store.update(lambda chunk: self._update_chunk(chunk, plan, out_flat))
        if self.param_store is not None:
            self.param_store.flush()
            engine.after_step()
        else:
            gather_into_whole_params(engine, out_flat)
        self._finish_step()
        return loss

    # ------------------------------------------------------------ overlapped step

    def _launch_step(self, plan: Plan) -> None:
        """Note [overlapped step]: with the optimizer states on NVMe, or the parameters on NVMe
        and the optimizer states in host memory, the step is bound by its reads and writes
        rather than by its arithmetic, so it runs on a background thread, chunk by chunk in
        flat (= unit) order, while the next forward and backward run. ``_updated_upto`` is the flat offset below which every
        shard is updated (its write to the parameter tier may still be in flight: a fetch
        that reads the tier waits for the writes first); a unit is fetched only once its range is below it
        (``wait_updated``), so no computation ever sees a stale parameter. The next backward
        needs no wait either: it writes the gradients of a unit only after computing with
        that unit, which was fetched, hence updated, hence its gradient range (whole chunks)
        already read by the step. A second step, GatheredParameters edits, reading master
        weights and close wait for the whole step (``wait_step``). Time the main thread
        spends waiting on the step is telemetry's ``optimizer_io`` stall."""
        self.engine.after_step()  # persistent units' gathered copies are about to be stale
        with self._cond:
            self._updated_upto = 0
        # The cached head (Note [host cache] in _stores.py) is what the next forward needs first:
        # update it here, on every core, from memory; the background thread streams the rest.
        self.store.update_head(lambda chunk: self._update_chunk(chunk, plan, None, publish=True))
        # Not a daemon: an interpreter that exits right after step() first lets the update land.
        self._bg = threading.Thread(target=self._run_step, args=(plan,), name="infinity-optimizer-step", daemon=False)
        self._bg.start()

    def _run_step(self, plan: Plan) -> None:
        try:
            # One thread for the math: the next forward computes on the other cores meanwhile.
            if self._adam is not None:
                plan = plan.with_hyper(num_threads=1)
            self.store.update_tail(lambda chunk: self._update_chunk(chunk, plan, None, publish=True))
            self.param_store.flush()
            with self._cond:
                self._updated_upto = math.inf
                self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at the next wait
            with self._cond:
                self._bg_error = e
                self._cond.notify_all()

    def _publish(self, upto: int) -> None:
        with self._cond:
            self._updated_upto = upto
            self._cond.notify_all()

    def wait_updated(self, end: int, *, block: bool = True, what: str = "") -> bool:
        """True once the flat range below ``end`` holds this step's values (see the Note)."""
        if self._updated_upto >= end and self._bg_error is None:
            return True
        with self._cond:
            if not block and self._bg_error is None:
                return self._updated_upto >= end
            with self.engine.counters.blocked("optimizer_io"):
                ok = self._cond.wait_for(lambda: self._updated_upto >= end or self._bg_error is not None,
                                         timeout=comm.DEFAULT_TIMEOUT_S)
            if self._bg_error is not None:
                raise self._bg_error
            if not ok:
                raise WaitTimeout(f"rank {self.engine.rank}: waited {comm.DEFAULT_TIMEOUT_S:.0f}s for the optimizer "
                                   f"step to update {what or 'a parameter shard'}")
        return True

    def wait_step(self) -> None:
        """Join an in-flight overlapped step; re-raise its error, if any."""
        if self._bg is not None:
            with self.engine.counters.blocked("optimizer_io"):
                self._bg.join()
            self._bg = None
        if self._bg_error is not None:
            raise self._bg_error

    def _update_chunk(self, chunk: Chunk, plan: Plan, out_flat: Optional[torch.Tensor],
                      publish: bool = False) -> None:
        """Adam on the parts of one chunk the plan covers (Note [update plan]); the chunk's
        fresh compute-dtype values go where they belong (fused into Adam's pass where the
        native Adam can write them)."""
        n = chunk.master.numel()
        end = chunk.offset + n
        ps = self.param_store
        targets = self._step_targets(chunk.offset, n, out_flat)  # (start, view) for the fresh values
        fused = self._adam is not None and self.engine.dtype != torch.float32 and bool(targets)
        done = []  # ranges whose fresh values a fused Adam wrote
        for lo, hi, hyper in runs_in(plan, chunk.offset, end):
            sl = slice(lo - chunk.offset, hi - chunk.offset)
            args = (chunk.master[sl], chunk.grad[sl], chunk.exp_avg[sl], chunk.exp_avg_sq[sl])
            if self._adam is None:
                torch_adam_step(*args, **hyper)
            elif not fused:
                self._adam(*args, **hyper)
            else:  # one native call per target piece, each writing its own output
                for a, b, out in _pieces(lo, hi, targets):
                    s = slice(a - chunk.offset, b - chunk.offset)
                    self._adam(chunk.master[s], chunk.grad[s], chunk.exp_avg[s], chunk.exp_avg_sq[s], params_out=out,
                               **hyper)
                done.append((lo, hi))
        for lo, hi in gaps(chunk.offset, end, done):  # what Adam did not write
            for a, b, out in _pieces(lo, hi, targets):
                out.copy_(chunk.master[a - chunk.offset : b - chunk.offset])
        upto = chunk.offset + n
        if ps is not None and not ps.resident:  # NVMe: write (async) and hand off what is complete
            upto = self._outputs_done(chunk.offset, end)
        if publish:  # its parameter writes may still be in flight: ParamStore.start_read waits for them
            self._publish(upto)

    def _outputs_done(self, lo: int, hi: int) -> int:
        """Report [lo, hi) of the optimizer's space written to the NVMe parameter tier's step
        outputs; the optimizer-space offset below which everything the step produced is
        written (the start of the first unit still filling, else ``hi``)."""
        upto = hi
        for a, b, p in self.layout.param_pieces(lo, hi):
            done = self.param_store.step_outputs_done(p, b - a)
            if done < p + (b - a) and upto == hi:
                upto = self.layout.to_opt(done)
        return upto

    def _step_targets(self, offset: int, n: int, out_flat: Optional[torch.Tensor]) -> list:
        """(start, view) pieces of [offset, offset + n) that receive the updated compute-dtype
        values: the gathered flat of stages 1-2, the resident parameter shards, the NVMe
        parameter tier's output tensors; none where the master weights are the parameters."""
        if out_flat is not None:
            same = out_flat.dtype == torch.float32 and out_flat is getattr(self.store, "master", None)
            return [] if same else [(offset, out_flat[offset : offset + n])]
        ps = self.param_store
        if ps is None or self.aliased:
            return []
        out = []
        for a, b, p in self.layout.param_pieces(offset, offset + n):  # Note [frozen parameters] in _layout.py
            if ps.resident:
                out.append((a, ps.view(p, b - a)))
            else:
                out += [(a + (start - p), view) for start, view in ps.step_outputs(p, b - a)]
        return out

    def _finish_step(self) -> None:
        self.store.zero_grads()
        for unit in self.engine.units:
            unit.drop_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.store.zero_grads()  # the accumulating gradients; an overlapped step reads sealed ones
        for unit in self.engine.units:
            unit.drop_grads()

    def master_slice(self, unit: "FetchUnit") -> torch.Tensor:
        """The fp32 master weights of one unit (a view in memory, a copy read from NVMe)."""
        self.wait_step()
        return self.store.read_master(unit.opt_offset, unit.shard_numel)

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
        if not isinstance(self.store, MemoryOptimizerStore):
            return {"optimizer": 0, "grads": 0}
        n = self.store.total * 4
        return {"optimizer": 2 * n + (0 if self.aliased else n), "grads": self.store.grad_bytes()}


_NO_STATE_DICT = (
    "infinity's optimizer keeps its states (fp32 master weights, Adam moments, step counts) sharded across ranks and "
    "tiers, which a torch state_dict cannot hold; save and resume them with infinity.save_checkpoint(dir, model, "
    "optimizer) and infinity.load_checkpoint(dir, model, optimizer), and export the weights with "
    "`python -m infinity.export CHECKPOINT OUT_DIR`.")


def _first_param_index(units) -> List[int]:
    """Per unit: the index (unit order) of its first parameter, where its gradient flags start."""
    out, n = [], 0
    for unit in units:
        out.append(n)
        n += len(unit.params)
    return out


def _pieces(lo: int, hi: int, targets: list):
    """(start, end, view) of the parts of [lo, hi) that the ``(start, view)`` targets cover."""
    for start, view in targets:
        a, b = max(lo, start), min(hi, start + view.numel())
        if a < b:
            yield a, b, view[a - start : b - start]


def gather_into_whole_params(engine: "Engine", flat: torch.Tensor) -> None:
    """Stages 1-2: all-gather the updated shards in buckets and copy into the whole params."""
    budget = engine.cfg.zero.reduce_bucket_size
    group, cols = [], 0
    for unit in [u for u in engine.units if u.trainable] + [None]:  # frozen units keep their values
        if unit is not None:
            group.append(unit)
            cols += unit.shard_numel
        if group and (unit is None or cols * engine.world_size >= budget):
            first, last = group[0], group[-1]
            span = flat[first.opt_offset : last.opt_offset + last.shard_numel].to(engine.dtype)
            full = torch.empty(engine.world_size * span.numel(), dtype=engine.dtype, device=acc.device())
            comm.all_gather_into_tensor(full, span, async_op=False, what="all-gather of updated parameters")
            rows = full.view(engine.world_size, span.numel())
            for u in group:
                start = u.opt_offset - first.opt_offset
                u.load_full_into_params(rows[:, start : start + u.shard_numel])
            group, cols = [], 0


def _terminal(outs):
    """Outputs that no other output depends on: scaling only these scales each path once."""
    if len(outs) <= 1:
        return outs
    nodes = {t.grad_fn: t for t in outs}
    reachable = set()
    for t in outs:
        seen, todo = set(), [t.grad_fn]
        while todo:
            fn = todo.pop()
            for nxt, _ in getattr(fn, "next_functions", ()):
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reachable |= seen & nodes.keys()
    return [t for t in outs if t.grad_fn not in reachable]
