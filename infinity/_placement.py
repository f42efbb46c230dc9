"""The placement plan: which tier holds which state, and the flat layout on those tiers.

Computed by ``initialize`` from the config and the unit specs before anything is allocated;
the preflight checks it, the stores are built from it, and the optimizer and engine read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from . import _accelerator as acc
from ._layout import ALIGN_ELEMS, Layout
from ._log import logger
from ._preflight import ranks_here
from ._tiers import Tier

GATHERED_REUSE = 2  # the largest unit's full size, times this: gathered buffers kept for reuse on CPU-only runs


@dataclass(frozen=True)
class Placement:
    opt_tier: Tier  # fp32 master weights, gradient shards, Adam moments
    param_tier: Tier  # stage 3's compute-dtype shards (DEVICE in stages 1-2: parameters stay whole)
    partition_params: bool
    dtype: torch.dtype  # the compute dtype
    layout: Layout
    overlap: bool  # Note [overlapped step] in _optimizer.py
    grads_in_memory: bool  # Note [gradients in host memory] in _optimizer_swapper.py
    params_are_master: bool  # fp32 on one resident tier: the master weights are the parameter shards
    gathered_reuse_bytes: int  # recycled gathered buffers (Note [recycled host memory] in _recycle.py)
    direct_reads: bool  # one rank, no accelerator: shards are read straight into gathered buffers, no staging

    @classmethod
    def of(cls, cfg, partition_params: bool, dtype: torch.dtype, specs, world_size: int) -> "Placement":
        z = cfg.zero
        opt_tier = Tier.of(z.offload_optimizer.device)
        param_tier = Tier.of(z.offload_param.device) if partition_params else Tier.DEVICE
        align = ALIGN_ELEMS if Tier.NVME in (opt_tier, param_tier) else 1
        layout = Layout.assign(specs, align)
        states_in_host = opt_tier is Tier.CPU or (opt_tier is Tier.DEVICE and acc.device().type == "cpu")
        overlap = partition_params and (opt_tier is Tier.NVME or (param_tier is Tier.NVME and states_in_host))
        grads_in_memory = opt_tier is Tier.NVME and gradients_in_host(z.offload_optimizer.gradients, layout.opt_total)
        params_are_master = (partition_params and dtype == torch.float32 and param_tier is opt_tier
                             and opt_tier.resident and layout.same_spaces)
        itemsize = torch.empty((), dtype=dtype).element_size()
        reuse = GATHERED_REUSE * layout.max_shard * world_size * itemsize \
            if partition_params and not acc.has_cuda() else 0  # a CUDA caching allocator already reuses memory
        direct = partition_params and world_size == 1 and not acc.has_cuda()  # FetchUnit._direct_read_buffer
        return cls(opt_tier, param_tier, partition_params, dtype, layout, overlap, grads_in_memory, params_are_master,
                   reuse, direct)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def gradients_in_host(choice: str, total: int) -> bool:
    """``zero.offload_optimizer.gradients`` for an NVMe optimizer tier (Note [gradients in host
    memory] in _optimizer_swapper.py): ``auto`` keeps the gradient shards in host memory when those of
    every rank on this node take at most a quarter of the available host memory."""
    if choice != "auto":
        return choice == "cpu"
    need, avail = 4 * total * ranks_here(), psutil.virtual_memory().available
    logger.info("zero.offload_optimizer.gradients auto: %s (%.2f GiB of gradient shards on this node, %.2f GiB of "
                "host memory available; host memory when at most a quarter)", "host memory" if need <= avail // 4
                else "swap file", need / 2**30, avail / 2**30)
    return need <= avail // 4
