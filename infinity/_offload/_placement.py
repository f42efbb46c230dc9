"""The placement plan: which tier holds which state, and the flat layout on those tiers.

Computed by ``initialize`` from the config and the unit specs before anything is allocated;
the preflight checks it, the stores are built from it, and the optimizer and engine read it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .._runtime import _accelerator as acc
from .._runtime._comm import ranks_here
from .._runtime._host_memory import available as host_available
from .._runtime._log import logger
from .._runtime._tiers import StagePolicy, Tier
from ._layout import ALIGN_ELEMS, Layout, ParamSource, states_in_host
from ._optimizer_store import chunk_elems
from ._split import host_fraction, opt_host_upto, param_host_upto, plan_auto

GATHERED_REUSE = 2  # the largest unit's full size, times this: gathered buffers kept for reuse on CPU-only runs


@dataclass(frozen=True)
class Machine:
    """What a placement reads of the node it is for: whether the ranks compute on an
    accelerator, the host memory available to the node's ranks, and how many ranks share it.
    ``here()`` for a run; ``infinity.estimate --plan`` describes another node, so that the
    engine's own rules plan it without running there."""

    accelerator: bool
    host_available: int  # bytes
    ranks_on_node: int

    @classmethod
    def here(cls) -> "Machine":
        return cls(acc.has_accelerator(), host_available()[0], ranks_here())


@dataclass(frozen=True)
class Placement:
    """Note [parameters from the master]: in fp32 the compute-dtype parameter shards and the
    master weights hold the same values, so the parameter tier keeps no copy of its own of a
    trainable unit's shard where the master can serve it. One enum says which case a
    placement is in, ``param_source`` (``ParamSource`` in _layout.py, decided by
    ``ParamSource.of`` for the engine, the planner and the run model alike), and every reader
    consults it. OWN, in every other case (another dtype, stages 1-2, tiers that differ
    otherwise): the parameter store keeps its own shards, ``params.swp`` on NVMe. MASTER:
    with the master weights in memory the parameter store *is* the master tensor for the
    trainable units, whatever ``offload_param.device`` says: a fetch reads it once the step
    gate has published its range, and an NVMe parameter tier would only write 4 bytes per
    parameter per step that nobody needs. MASTER_FILE: with both on NVMe the parameter store reads and
    writes the trainable units' shards in ``master.swp``: the step hands its fresh master
    values to the parameter store (Note [hand-off] in _nvme_param_store.py), which writes them, so
    the optimizer store writes only the moments, and Note [write ordering] in
    _ordered_writes.py orders a fetch's read after the master write of its range exactly as
    it did for ``params.swp``. Frozen units have no master weights: under MASTER_FILE their
    shards are the rest of the parameter store's space (Note [frozen parameters] in
    _layout.py puts them after the trainable ones), kept apart: under MASTER_FILE in a
    ``params.swp`` of their own, under MASTER in a tensor of their own beside the master on
    its tier, so a partly frozen model holds its trainable states plus its frozen shards and
    nothing twice. Only where the parameter tier is NVMe and the master in memory do frozen
    units turn MASTER off (OWN): their shards belong on the NVMe tier, and one store is
    either resident or not. With MASTER and MASTER_FILE no trainable shard is in ``params.swp``
    (the disk holds 16 bytes per trainable parameter instead of 20, and the step writes 4
    fewer) and a trainable unit writes nothing at partition. The shared file and its ordered
    writes are one ``MasterFile`` (_ordered_writes.py), built before both stores and given to
    each: neither store refers to the other."""

    opt_tier: Tier  # fp32 master weights, gradient shards, Adam moments
    param_tier: Tier  # stage 3's compute-dtype shards (DEVICE in stages 1-2: parameters stay whole)
    policy: StagePolicy  # what the stage partitions: ask it, never a copy of it
    dtype: torch.dtype  # the compute dtype
    layout: Layout
    overlap: bool  # Note [overlapped step] in _zero_optimizer.py
    grads_in_memory: bool  # Note [gradients in host memory] in _nvme_optimizer_store.py
    param_source: ParamSource  # where the parameter shards are kept (Note [parameters from the master])
    param_cache_elems: int  # Note [parameter cache] in _nvme_param_store.py
    gathered_reuse_bytes: int  # recycled gathered buffers (Note [recycled host memory] in _recycle.py)
    direct_reads: bool  # one rank, no accelerator: shards are read straight into gathered buffers, no staging
    opt_host_upto: int = 0  # an NVMe optimizer tier's host share: Note [split tiers] in _split.py
    param_host_upto: int = 0  # an NVMe parameter tier's host share, whole units
    speculate: bool = False  # Note [speculative update] in _zero/_speculative_update.py

    @classmethod
    def of(cls, cfg, policy: StagePolicy, dtype: torch.dtype, specs, world_size: int,
           machine: Optional[Machine] = None) -> "Placement":
        """The placement on ``world_size`` ranks of ``machine`` (None: this one, read when needed);
        a section's ``device: auto`` planned (Note [planned split] in _split.py)."""
        z, partition_params = cfg.zero, policy.partition_params
        opt_auto, param_auto = z.offload_optimizer.device == "auto", partition_params and z.offload_param.device == "auto"
        opt = (Tier.CPU, None) if opt_auto else (Tier.of(z.offload_optimizer.device), host_fraction(z.offload_optimizer))
        param = (Tier.CPU, None) if param_auto else \
            (Tier.of(z.offload_param.device) if partition_params else Tier.DEVICE, host_fraction(z.offload_param))
        build = functools.partial(cls.build, cfg, policy, dtype, specs, world_size, machine)
        if not (opt_auto or param_auto):
            return build(opt, param)
        return plan_auto(build, cfg, opt_auto, param_auto, opt, param, machine or Machine.here())

    @classmethod
    def build(cls, cfg, policy: StagePolicy, dtype: torch.dtype, specs, world_size: int,
              machine: Optional[Machine], opt: tuple, param: tuple, grads_in_memory: Optional[bool] = None
              ) -> "Placement":
        """The placement with the optimizer states and the parameters on the (tier, host
        fraction) given (Note [split tiers] in _split.py)."""
        z, partition_params = cfg.zero, policy.partition_params
        opt_tier, param_tier = opt[0], param[0]
        align = ALIGN_ELEMS if Tier.NVME in (opt_tier, param_tier) else 1
        layout = Layout.assign(specs, align)
        accelerator = acc.has_accelerator() if machine is None else machine.accelerator
        overlap = overlap_step(z.offload_optimizer.overlap_step, partition_params, opt_tier, param_tier,
                               states_in_host(opt_tier, not accelerator), accelerator)
        if grads_in_memory is None:
            grads_in_memory = opt_tier is Tier.NVME and gradients_in_host(z.offload_optimizer.gradients,
                                                                          layout.opt_total, machine)
        opt_upto = opt_host_upto(opt[1] or 0.0, layout.opt_total, chunk_elems(z.offload_optimizer.chunk_size,
                                                                              layout.opt_total)) \
            if opt_tier is Tier.NVME else 0
        param_upto = param_host_upto(param[1] or 0.0, layout.param_ranges, layout.param_total) \
            if param_tier is Tier.NVME else 0
        source = ParamSource.of(partitioned=partition_params, fp32=dtype == torch.float32,
                                same_spaces=layout.same_spaces, opt_tier=opt_tier, param_tier=param_tier,
                                device_is_host=not accelerator)
        if source is ParamSource.MASTER_FILE and (opt_upto or param_upto):
            source = ParamSource.OWN  # master.swp would have to hold a host share too (Note [split tiers] in _split.py)
        param_upto = param_upto if source is ParamSource.OWN else 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        reuse = GATHERED_REUSE * layout.max_shard * world_size * itemsize \
            if partition_params and not accelerator else 0  # a device caching allocator already reuses memory
        direct = partition_params and world_size == 1 and not accelerator  # Note [one rank] in _runtime/_comm.py
        cache = param_cache_elems(z.offload_param.max_in_cpu, layout.param_total - param_upto, itemsize,
                                  *((machine.host_available, machine.ranks_on_node) if machine else ())) \
            if param_tier is Tier.NVME and source is not ParamSource.MASTER else 0
        speculate = speculate_update(z.offload_optimizer.speculate, overlap, opt_tier, param_tier)
        return cls(opt_tier, param_tier, policy, dtype, layout, overlap, grads_in_memory, source, cache,
                   reuse, direct, opt_upto, param_upto, speculate)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        """Where each state is, in the config's words."""
        def one(tier: Tier, upto: int, total: int) -> str:
            if tier is Tier.NVME and upto:
                return f"split cpu {upto / total:.2f}, nvme {1 - upto / total:.2f}"
            return {Tier.DEVICE: "none", Tier.CPU: "cpu", Tier.NVME: "nvme"}[tier]
        out = f"optimizer {one(self.opt_tier, self.opt_host_upto, max(self.layout.opt_total, 1))}"
        if self.policy.partition_params:
            out += f", parameters {one(self.param_tier, self.param_host_upto, max(self.layout.param_total, 1))}"
        return out


def overlap_step(choice: str, partition_params: bool, opt_tier: Tier, param_tier: Tier, states_in_host: bool,
                 accelerator: Optional[bool] = None) -> bool:
    """Whether the update runs beside the next forward (``zero.offload_optimizer.overlap_step``;
    Note [overlapped step] in _zero_optimizer.py). Only at stage 3 with the states off the
    device (on the host or NVMe) can it. ``auto``: with an accelerator, always (the device
    computes while the host updates); on the CPU alone, where the forward needs the cores,
    only when the step is bound by its I/O (an NVMe tier)."""
    can = partition_params and (opt_tier is Tier.NVME or states_in_host)
    if choice != "auto":
        return can and choice == "on"
    io_bound = opt_tier is Tier.NVME or (param_tier is Tier.NVME and states_in_host)
    accelerator = acc.has_accelerator() if accelerator is None else accelerator
    return can and (io_bound or (accelerator and opt_tier is not Tier.DEVICE))


def speculate_update(choice: str, overlap: bool, opt_tier: Tier, param_tier: Tier) -> bool:
    """Whether each unit is updated while backward goes on (``zero.offload_optimizer.speculate``;
    Note [speculative update] in _zero/_speculative_update.py). Only the overlapped step with
    every state in host memory can: the undo log covers the memory stores alone. Off unless
    asked for (on, always); the preflight then counts the undo log with everything else."""
    if choice == "off":
        return False
    can = overlap and opt_tier is Tier.CPU and param_tier is not Tier.NVME
    if not can:
        logger.warning("zero.offload_optimizer.speculate: %s has no effect here: it needs the overlapped step with "
                       "the optimizer states and parameters in host memory (the step is %soverlapped, the optimizer on "
                       "%s, the parameters on %s); set overlap_step: on, or speculate: off", choice,
                       "" if overlap else "not ", opt_tier.value, param_tier.value)
    return can


def gradients_in_host(choice: str, total: int, machine: Optional[Machine] = None) -> bool:
    """``zero.offload_optimizer.gradients`` for an NVMe optimizer tier (Note [gradients in host
    memory] in _nvme_optimizer_store.py): ``auto`` keeps the gradient shards in host memory when those of
    every rank on the node (this one, unless given) take at most a quarter of the available host memory."""
    if choice != "auto":
        return choice == "cpu"
    machine = machine or Machine.here()
    need, avail = 4 * total * machine.ranks_on_node, machine.host_available
    logger.info("zero.offload_optimizer.gradients auto: %s (%.2f GiB of gradient shards on this node, %.2f GiB of "
                "host memory available; host memory when at most a quarter)", "host memory" if need <= avail // 4
                else "swap file", need / 2**30, avail / 2**30)
    return need <= avail // 4


PARAM_CACHE_SHARE = 8  # the automatic parameter cache takes at most 1/8 of the available host memory


def param_cache_elems(choice, total: int, itemsize: int, available: Optional[int] = None,
                      ranks: Optional[int] = None) -> int:
    """Elements of the parameter cache (``zero.offload_param.max_in_cpu``; Note [parameter
    cache] in _nvme_param_store.py): the cap given, or automatically what fits in an eighth of the
    host memory available (now, unless given) shared by the ranks on the node (this node's,
    unless given); never more than the shards."""
    if choice is None:
        available = host_available()[0] if available is None else available
        choice = available // PARAM_CACHE_SHARE // (ranks or ranks_here()) // itemsize
    return min(int(choice), total)
