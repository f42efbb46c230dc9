"""Learning-rate schedules of the ``scheduler`` section: DeepSpeed's WarmupLR, WarmupDecayLR
and WarmupCosineLR with their parameter names, defaults and formulas.

Note [DeepSpeed schedule steps]: DeepSpeed builds its scheduler with
``last_batch_iteration = -1`` and steps it after every optimizer step, so optimizer step k
(1-based) runs with the lr of iteration ``k - 2``; iteration -1 gives ``warmup_min_lr``
(WarmupLR, WarmupDecayLR) or ratio 0 (WarmupCosineLR), and with the default log warm-up
iteration 0 gives the same (log 1 = 0): the first two steps run at the minimum. Here the
schedule is a torch ``LRScheduler``, whose ``last_epoch`` counts the optimizer steps taken
(0 at construction), so iteration = ``last_epoch - 1``. ``warmup_num_steps`` counts at least
2, as in DeepSpeed. Two deviations, both where DeepSpeed fails or half-applies: a cosine with
``total_num_steps == warmup_num_steps`` divides by 1 instead of 0, and iteration -1 of
WarmupCosineLR sets every group's lr to 0 (DeepSpeed's ``[0.0]`` reaches the first group
only).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ..errors import UsageError


def resolve(sched, optimizer_lr: float, run_steps: Optional[int], run_warmup: Optional[int]):
    """``sched`` (a SchedulerConfig) with its nulls ("the run's") filled in."""
    updates = {}
    if sched.warmup_max_lr is None:
        updates["warmup_max_lr"] = optimizer_lr
    if sched.warmup_num_steps is None:
        updates["warmup_num_steps"] = max(1, run_warmup or 0)  # as transformers fills it
    if sched.total_num_steps is None and sched.type in ("WarmupDecayLR", "WarmupCosineLR"):
        if run_steps is None:
            raise UsageError(f"scheduler.total_num_steps is null (the run's) but the number of steps is not known "
                             f"here; give scheduler.total_num_steps for {sched.type}")
        updates["total_num_steps"] = run_steps
    return replace(sched, **updates) if updates else sched


def _warmup_fraction(sched, it: int, warm: int) -> float:
    if sched.warmup_type == "log":
        return math.log(it + 1) / math.log(warm)
    return it / warm


def lr_ratio(sched, it: int) -> float:
    """WarmupCosineLR: the factor on each group's initial lr at iteration ``it``."""
    if it < 0:
        return 0.0
    warm = max(2, sched.warmup_num_steps)
    if it < warm:
        return sched.warmup_min_ratio + (1.0 - sched.warmup_min_ratio) * _warmup_fraction(sched, it, warm)
    done, span = it - warm + 1, max(1, sched.total_num_steps - warm)
    cosine = (1 + math.cos(math.pi * done / span)) / 2
    return max(0.0, sched.cos_min_ratio + (1.0 - sched.cos_min_ratio) * cosine)


def lr_absolute(sched, it: int) -> float:
    """WarmupLR / WarmupDecayLR: the lr of every group at iteration ``it``."""
    low, delta = sched.warmup_min_lr, sched.warmup_max_lr - sched.warmup_min_lr
    if it < 0:
        return low
    warm = max(2, sched.warmup_num_steps)
    if it < warm:
        return low + delta * _warmup_fraction(sched, it, warm)
    if sched.type == "WarmupLR":
        return low + delta
    return low + delta * max(0.0, (sched.total_num_steps - it) / max(1.0, sched.total_num_steps - warm))


class DeepSpeedSchedule(LRScheduler):
    """One of DeepSpeed's schedules on a torch optimizer: Note [DeepSpeed schedule steps]."""

    def __init__(self, optimizer, sched, last_epoch: int = -1):
        self.sched = sched
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        it = self.last_epoch - 1
        if self.sched.type == "WarmupCosineLR":
            return [base * lr_ratio(self.sched, it) for base in self.base_lrs]
        return [lr_absolute(self.sched, it) for _ in self.base_lrs]


def make_scheduler(optimizer, cfg, run_steps: Optional[int], run_warmup: Optional[int] = None) -> LRScheduler:
    """The schedule ``cfg.scheduler`` asks for; with ``type: none``, a linear warm-up over
    ``run_warmup`` steps (the train job's ``train.lr_warmup_steps``) to a constant lr."""
    sched = cfg.scheduler
    if sched.type == "none":
        steps = run_warmup or 0
        return LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / steps) if steps > 0 else 1.0)
    if run_warmup and sched.warmup_num_steps is not None and sched.warmup_num_steps != run_warmup:
        raise UsageError(f"scheduler.warmup_num_steps ({sched.warmup_num_steps}) and the run's warm-up ({run_warmup} "
                         f"steps: train.lr_warmup_steps or TrainingArguments.warmup_steps) disagree; give one of them "
                         f"(scheduler.warmup_num_steps: 'auto' takes the run's)")
    return DeepSpeedSchedule(optimizer, resolve(sched, cfg.optimizer.lr, run_steps, run_warmup))
