"""Stages 1-2: the updated parameter shards all-gathered into the whole parameters, in buckets."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm

if TYPE_CHECKING:
    from ._unit import FetchUnit


def gather_into_whole_params(units: Sequence["FetchUnit"], world: int, dtype: torch.dtype, flat: torch.Tensor,
                             bucket_elems: int) -> None:
    """Stages 1-2: all-gather the updated shards in buckets and copy into the whole params."""
    group: list = []
    cols = 0
    for unit in [u for u in units if u.trainable] + [None]:  # frozen units keep their values
        if unit is not None:
            group.append(unit)
            cols += unit.shard_numel
        if group and (unit is None or cols * world >= bucket_elems):
            first, last = group[0], group[-1]
            span = flat[first.opt_offset : last.opt_offset + last.shard_numel].to(acc.device(), dtype)
            full = torch.empty(world * span.numel(), dtype=dtype, device=acc.device())
            comm.all_gather_into_tensor(full, span, async_op=False, what="all-gather of updated parameters")
            rows = full.view(world, span.numel())
            for u in group:
                start = u.opt_offset - first.opt_offset
                u.load_full_into_params(rows[:, start : start + u.shard_numel])
            group, cols = [], 0
