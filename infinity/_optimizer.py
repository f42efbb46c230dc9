"""The partitioned optimizer returned by ``infinity.initialize``.

Each rank owns a flat fp32 space laid out unit after unit in the shard layout (Note [shard
layout] in _unit.py): master weights, gradient shards and Adam moments for its chunks only.
``step()`` unscales (fp16), skips on overflow, clips by the global norm across ranks, runs
Adam on the flat shards (the native CPU Adam when the shards are CPU-resident, else the same
math in torch) and writes the updated low-precision values back to the parameters.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from . import _accelerator as acc
from . import _comm as comm
from ._log import logger
from ._loss_scale import LossScaler
from ._param import raw_data
from ._reduce import GradReducer

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
    """A torch Optimizer over this rank's flat fp32 master shard; LR schedulers work on it."""

    def __init__(self, engine: "Engine", cfg):
        self.engine = engine
        self.cfg = cfg
        oc = cfg.optimizer
        total = 0
        for unit in engine.units:
            unit.opt_offset = total
            total += unit.shard_numel
        master = torch.empty(total, dtype=torch.float32, device=acc.device())
        for unit in engine.units:
            unit.shard_of([raw_data(p) for p in unit.params], torch.float32, out=self.master_slice(master, unit))
        self.master = nn.Parameter(master, requires_grad=False)
        self.grad = torch.zeros(total, dtype=torch.float32, device=acc.device()) if engine.policy.reduce_in_backward else None
        defaults = dict(lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay,
                        adamw=oc.type == "adamw")
        super().__init__([self.master], defaults)
        self._adam = _native_adam() if self.master.device.type == "cpu" else None
        self.scaler = LossScaler(static_scale=cfg.precision.loss_scale, initial_scale_power=cfg.precision.initial_scale_power,
                                 window=cfg.precision.loss_scale_window, hysteresis=cfg.precision.hysteresis,
                                 min_scale=cfg.precision.min_loss_scale) if engine.dtype == torch.float16 else None
        self.grad_scale = 1.0 / (engine.world_size * cfg.gradient_accumulation_steps)
        engine.reducer = GradReducer(engine.world_size, cfg.zero.reduce_bucket_size, self._accumulate,
                                     drop_full_grads=engine.policy.reduce_in_backward)
        self.last_grad_norm: Optional[float] = None
        self.skipped = False

    @staticmethod
    def master_slice(flat: torch.Tensor, unit: "FetchUnit") -> torch.Tensor:
        return flat[unit.opt_offset : unit.opt_offset + unit.shard_numel]

    # ------------------------------------------------------------ gradients

    def _accumulate(self, unit: "FetchUnit", shard_grad: torch.Tensor) -> None:
        self.master_slice(self._grad_buffer(), unit).add_(shard_grad, alpha=self.grad_scale)

    def _grad_buffer(self) -> torch.Tensor:
        if self.grad is None:  # stage 1: only during the step
            self.grad = torch.zeros_like(self.master.data)
        return self.grad

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
        if not engine.policy.reduce_in_backward:
            for unit in engine.units:
                engine.reducer.add(unit)
        engine.reducer.finish()
        grad = self._grad_buffer()
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            overflow = torch.tensor([0.0 if bool(torch.isfinite(grad).all()) else 1.0])
            comm.all_reduce(overflow, "max")
            self.scaler.update(bool(overflow.item()))
            if overflow.item():
                self.skipped = True
                self._drop_step_grads()
                return loss
        self.skipped = False
        coef = inv_scale
        clip = self.cfg.gradient_clipping
        sq = torch.tensor([float(torch.linalg.vector_norm(grad, dtype=torch.float64)) ** 2])
        comm.all_reduce(sq, "sum")  # the norm is reported even when clipping is off
        self.last_grad_norm = math.sqrt(sq.item()) * inv_scale
        if clip > 0:
            clip_coef = clip / (self.last_grad_norm + 1e-6)
            if clip_coef < 1.0:
                coef *= clip_coef
        if coef != 1.0:
            grad.mul_(coef)
        self._adam_update(grad)
        engine_after_step(engine, self)
        self._drop_step_grads()
        return loss

    def _adam_update(self, grad: torch.Tensor) -> None:
        group = self.param_groups[0]
        state = self.state[self.master]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(self.master.data)
            state["exp_avg_sq"] = torch.zeros_like(self.master.data)
        state["step"] += 1
        kwargs = dict(step=int(state["step"].item()), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], adamw=group["adamw"])
        if self._adam is not None:
            self._adam(self.master.data, grad, state["exp_avg"], state["exp_avg_sq"], **kwargs)
        else:
            torch_adam_step(self.master.data, grad, state["exp_avg"], state["exp_avg_sq"], **kwargs)

    def _drop_step_grads(self) -> None:
        if not self.engine.policy.reduce_in_backward:
            self.grad = None  # stage 1 keeps no gradient shard between steps
            for unit in self.engine.units:
                unit.drop_grads()
        else:
            self.grad.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.grad is not None:
            self.grad.zero_()
        for unit in self.engine.units:
            unit.drop_grads()

    # ------------------------------------------------------------ accounting

    def state_bytes(self) -> dict:
        """Optimizer states (fp32 master unless it is the parameter shard, Adam moments) and
        gradient shards this rank holds."""
        n = self.master.numel() * 4
        master_is_param = self.engine.policy.partition_params and self.engine.dtype == torch.float32
        moments = 2 * n
        return {"optimizer": moments + (0 if master_is_param else n),
                "grads": self.grad.numel() * 4 if self.grad is not None else 0}


def engine_after_step(engine: "Engine", opt: ZeroOptimizer) -> None:
    """Write the updated master weights back to what the model computes with."""
    master = opt.master.data
    if engine.policy.partition_params:
        if engine.dtype != torch.float32:
            for unit in engine.units:
                unit.shard.copy_(opt.master_slice(master, unit))
        return
    # Stages 1-2: all-gather the updated shards in buckets and copy into the whole params.
    budget = engine.cfg.zero.reduce_bucket_size
    group, cols = [], 0
    for unit in engine.units + [None]:
        if unit is not None:
            group.append(unit)
            cols += unit.shard_numel
        if group and (unit is None or cols * engine.world_size >= budget):
            first, last = group[0], group[-1]
            span = master[first.opt_offset : last.opt_offset + last.shard_numel].to(engine.dtype)
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
