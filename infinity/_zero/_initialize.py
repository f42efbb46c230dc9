"""``infinity.initialize``: the composition root that builds the engine and its optimizer.

Note [build order]: everything is built in one direction, each object receiving the few
services it uses when it is constructed, and nobody assigns another object's attributes
afterwards:

    unit specs (grouping, shard sizes) -> placement plan (tiers, flat layout) -> preflight
    -> the master file both stores share, if they do -> stores -> shared services (counters,
    gather ledger, step gate, call stack, prefetcher, recycler) -> fetch units -> master weights
    -> gradient sink -> reducer -> engine -> optimizer -> cast and partition -> hooks

The preflight sees only the plan, so it runs before the first byte is allocated. The fetch
units never see the engine or the optimizer: the step publishes its progress through the
step gate (Note [step gate] in _step_gate.py), which the units consult before reading a shard.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import nn

from .._offload._layout import ParamSource
from .._offload._memory_plan import (
    BLOCK_MIN,
    GATHERED,
    MMAP_THRESHOLD,
    RELEASE_CACHE_CAP,
    huge_page_hint,
    release_freed_blocks,
    stop_block_cache,
    use_block_cache,
)
from .._offload._nvme_optimizer_store import NvmeOptimizerStore
from .._offload._nvme_param_store import NvmeParamStore
from .._offload._optimizer_store import MemoryOptimizerStore, OptimizerStore, chunk_elems
from .._offload._ordered_writes import MasterFile
from .._offload._param_store import MemoryParamStore, ParamStore
from .._offload._placement import PARAM_CACHE_SHARE, Placement
from .._offload._preflight import preflight, staging_buffers
from .._offload._swap import SwapDirs
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._log import logger
from .._runtime._recycle import Recycler
from .._runtime._telemetry_counters import Counters
from .._runtime._tiers import StagePolicy, Tier
from .._runtime._topology import place
from ..aio import aligned_empty
from ..config import Config
from ..errors import EngineError, UsageError, UsageTypeError
from ._activation_offload import ActivationOffloader
from ._engine import Engine, EngineParts, engine_of, forget_engine
from ._grad_sink import GradSink
from ._ledger import GatherLedger
from ._loss_scale import LossScaler
from ._param_groups import resolve_groups
from ._phase import Calls
from ._prefetch import Prefetcher
from ._reduce import GradReducer
from ._same_gathers import check_same_model_on_all_ranks
from ._step_gate import StepGate
from ._swap_labels import label_swap_files
from ._tiling import check_working_memory, retarget_groups, tile_model
from ._unit import FetchUnit, UnitContext
from ._unit_plan import DTYPES, placement_of
from ._zero_optimizer import EngineOps, ZeroOptimizer


def initialize(model: nn.Module, config=None, param_groups=None) -> Tuple[nn.Module, ZeroOptimizer]:
    """Return ``(model, optimizer)``: the same module with hooks installed and a partitioned
    optimizer, so ``loss.backward()``, ``optimizer.step()`` and ``optimizer.zero_grad()``
    work unchanged. ``config`` is a Config, a dict, a path (YAML/JSON/DeepSpeed JSON) or None.
    ``param_groups``: torch-style groups (``[{"params": [...], "weight_decay": 0.0}, ...]``)
    over the model's parameters, every trainable parameter in exactly one; keys a group
    leaves out (lr, betas, eps, weight_decay) come from the config's ``optimizer``. None:
    one group of every trainable parameter."""
    if not isinstance(model, nn.Module):
        raise UsageTypeError(f"infinity.initialize expects an nn.Module, got {type(model).__name__}")
    if engine_of(model) is not None:
        raise EngineError("this model was already passed to infinity.initialize; call it once per model")
    cfg = Config.coerce(config)
    comm.configure(cfg)  # Note [comm timeout] in _comm.py
    comm.ensure_initialized()
    place(cfg.zero.numa, cfg.zero.cpu_threads)  # before any buffer: Note [rank placement] in _topology.py
    tiling = cfg.zero.tiling
    replaced = tile_model(model, tiling.enabled, tiling.min_params, tiling.max_tile_params)
    groups = resolve_groups(list(model.named_parameters()), retarget_groups(param_groups, replaced))  # refused early
    check_same_model_on_all_ranks(model)
    engine, sink, gate = _build_engine(model, cfg)
    try:
        optimizer = ZeroOptimizer(engine, _engine_ops(engine), cfg, groups, sink=sink, gate=gate)
        if optimizer.speculation is not None:  # Note [speculative update] in _speculative_update.py
            sink.on_landed = optimizer.speculation.landed
            gate.attach_speculation(optimizer.speculation)
        label_swap_files(optimizer)  # what corrupt bytes would have held (Note [swap checksums] in aio/_checksum.py)
    except BaseException:
        forget_engine(model)  # refused (bad groups): the model may be passed again
        raise
    engine.cast_and_partition()
    engine.install_hooks()
    logger.info("ZeRO stage %d on %d rank(s): %d fetch units, %.1fM parameters, %s",
                cfg.zero.stage, engine.world_size, len(engine.units),
                sum(u.shard_numel for u in engine.units) * engine.world_size / 1e6, cfg.precision.dtype)
    _warn_slow_bf16(cfg.precision.dtype)
    return model, optimizer


def _warn_slow_bf16(dtype: str) -> None:
    """bf16 asked for by name where it runs far slower than fp32 (``auto`` never picks it
    there: Note [CPU feature level] in _cpu_isa.py)."""
    if dtype != "bf16":
        return
    fast, why = acc.native_bf16()
    if not fast:
        logger.warning("precision.dtype bf16 is slow here: %s; precision.dtype auto (or fp32) trains faster on "
                       "this machine", why)


def close(model: nn.Module) -> None:
    """``infinity.close(model)``: free the engine's buffers and swap files now, remove its
    hooks, and wait for an overlapped step or an asynchronous save in flight (Note [closed
    engines] in _engine.py). Letting go of the model and its optimizer does the same later;
    closing twice is harmless."""
    _engine_of_model(model, "close").close()


def telemetry(model: nn.Module, reset: bool = False) -> dict:
    """``infinity.telemetry(model)``: the engine's counters since they were last reset (or
    since ``initialize``): seconds each transfer stage stalled the step, bytes per stage, the
    stores' NVMe reads and writes, collective bytes, prefetch hits and trace divergences, the
    peak of gathered elements and the process's host-memory account. ``reset=True`` starts
    the counters afresh after reading them."""
    return _engine_of_model(model, "telemetry").telemetry(reset=reset)


def _engine_of_model(model: nn.Module, what: str) -> Engine:
    if not isinstance(model, nn.Module):
        raise UsageTypeError(f"infinity.{what} expects the model returned by infinity.initialize, "
                             f"got {type(model).__name__}")
    engine = engine_of(model)
    if engine is None:
        raise UsageError(f"infinity.{what}: this model has no engine; pass the model returned by "
                         "infinity.initialize")
    return engine


def _build_engine(model: nn.Module, cfg):
    """Note [build order], up to the engine."""
    world, rank = comm.world_size(), comm.rank()
    dtype = DTYPES[cfg.precision.dtype]
    placement, specs, uses = placement_of(model, cfg, world)
    policy = placement.policy
    if policy.partition_params:  # Note [operator working memory] in _tiling.py: refused before anything is allocated
        check_working_memory([(s.module_name, s.shard_numel * world, s.persistent) for s in specs],
                             placement.itemsize, cfg)
    memory_plan = preflight(placement, cfg)  # Note [one memory model] in _memory_plan.py
    swap_dirs = SwapDirs.of(cfg, rank)  # Note [many drives] in _drives.py
    block_cache = _start_host_allocator(cfg.zero.host_allocator)
    try:
        # Note [parameters from the master] in _placement.py: shared, built first
        master = MasterFile(swap_dirs.under(cfg.zero.offload_optimizer.nvme_path), placement.layout.opt_total, cfg.aio) \
            if placement.param_source is ParamSource.MASTER_FILE else None
        opt_store = _optimizer_store(placement, cfg, swap_dirs, policy, master)
        param_store = _param_store(placement, cfg, swap_dirs, opt_store, master) if policy.partition_params else None
        counters = Counters()
        ledger: GatherLedger[FetchUnit] = GatherLedger(world, cfg.device_memory_limit)  # this engine's device budget
        gate = StepGate(rank, counters.blocked)
        calls = Calls()  # Note [phases] in _phase.py
        prefetcher = Prefetcher(cfg.zero.prefetch, policy=policy, calls=calls,
                                ledger=ledger, counters=counters)
        recycler = Recycler(placement.gathered_reuse_bytes, functools.partial(aligned_empty, what=GATHERED)) \
            if policy.partition_params and not acc.has_accelerator() else None  # Note [recycled host memory] in _recycle.py
        ctx = UnitContext(
            world_size=world, rank=rank, dtype=dtype, itemsize=placement.itemsize,
            policy=policy,
            counters=counters, ledger=ledger, gathered_buffers=recycler, param_store=param_store,
            param_source=placement.param_source,
            step_gate=gate, make_room=prefetcher.make_room, on_unavailable=calls.on_unavailable)
        layout = placement.layout
        units = [FetchUnit(ctx, spec, layout.param_ranges[spec.index][0], layout.opt_offsets[spec.index])
                 for spec in specs]
        for unit in units:  # fp32 master weights, taken before the cast to the compute dtype
            if unit.trainable:
                opt_store.load_master(unit.opt_offset, unit.local_shard(torch.float32))
        sink = GradSink(opt_store, units, 1.0 / (world * cfg.gradient_accumulation_steps), counters)
        reducer = GradReducer(units, world, cfg.zero.reduce_bucket_size, sink.accumulate,
                              drop_full_grads=policy.reduce_in_backward, consumers_done=sink.consumers_done,
                              on_add=sink.note)
        scaler = _loss_scaler(cfg.precision) if dtype == torch.float16 else None
        offload = ActivationOffloader(ledger.budget) if cfg.activation_checkpointing.offload == "cpu" else None
        parts = EngineParts(placement, ctx, calls, units, uses, opt_store, prefetcher, reducer, sink, scaler,
                            swap_dirs, memory_plan, offload, block_cache)
        return Engine(model, cfg, parts), sink, gate
    except BaseException:
        swap_dirs.remove()
        if block_cache:
            stop_block_cache()
        raise


def _engine_ops(engine: Engine) -> EngineOps:
    """What the optimizer asks of the engine (Note [the optimizer's engine] in _zero_optimizer.py)."""
    reducer, fence = engine.reducer, engine.save_fence
    return EngineOps(
        units=engine.units, dtype=engine.dtype, rank=engine.rank, world_size=engine.world_size,
        policy=engine.policy, placement=engine.placement, store=engine.opt_store,
        param_store=engine.param_store, scaler=engine.scaler, counters=engine.counters,
        wait_for_saves=lambda: fence.wait_writes(comm.timeout_s()),
        reduce_rest=(lambda: None) if engine.policy.reduce_in_backward else reducer.reduce_all,
        after_step=engine.after_step, end_aborted_backward=engine.end_aborted_backward)


def _start_host_allocator(policy: str) -> bool:
    """Where torch's large CPU blocks come from (``zero.host_allocator``): the block cache
    (Note [block cache] in native/host_alloc/host_alloc.cpp) keeping every freed block
    (``cache``) or at most RELEASE_CACHE_CAP bytes of them (``release``); glibc's heap
    (``keep``, or where the block cache was not built, with release's fixed mmap threshold:
    Note [allocator retained pages] in _memory_plan.py). True when the block cache serves."""
    if policy == "keep":
        return False
    cap = RELEASE_CACHE_CAP if policy == "release" else None
    if use_block_cache(cap):
        logger.info("host allocator: torch's CPU blocks of %d KiB or more come from the block cache, which keeps %s "
                    "(zero.host_allocator: %s)", BLOCK_MIN >> 10,
                    "every freed block for reuse" if cap is None else f"at most {cap >> 20} MiB of freed blocks",
                    policy)
        return True
    missing = ("host allocator: the block cache is not built (torch was not importable when infinity was built: "
               "pip install --no-build-isolation -e .); ")
    if policy == "release" and release_freed_blocks():
        logger.info(missing + "glibc maps blocks of %d KiB or more on their own and returns them when freed%s",
                    MMAP_THRESHOLD >> 10, huge_page_hint())
    else:
        logger.info(missing + "torch's blocks come from glibc's heap")
    return False


def _optimizer_store(placement: Placement, cfg, swap_dirs: SwapDirs, policy: StagePolicy,
                     master: Optional[MasterFile]) -> OptimizerStore:
    z = cfg.zero
    total, ranges = placement.layout.opt_total, list(placement.layout.opt_ranges)
    if placement.opt_tier is Tier.NVME:
        return NvmeOptimizerStore(total, ranges, swap_dirs.under(z.offload_optimizer.nvme_path), cfg.aio,
                                  z.offload_optimizer.chunk_size, cfg.gradient_accumulation_steps,
                                  z.offload_optimizer.host_cache, placement.grads_in_memory,
                                  moments=z.offload_optimizer.moments,
                                  release_cache=z.host_allocator == "release", phased=z.offload_optimizer.swap_io == "phased",
                                  master=master, host_upto=placement.opt_host_upto)
    return MemoryOptimizerStore(placement.opt_tier, total, lazy_grad=not policy.reduce_in_backward,
                                overlapped=placement.overlap, ranges=ranges, chunk=z.offload_optimizer.chunk_size,
                                undo_dtype=placement.dtype if placement.speculate else None,
                                # Note [second state set] in _optimizer_store.py: not where the parameters are the master
                                second_set=placement.param_source is not ParamSource.MASTER)


def _param_store(placement: Placement, cfg, swap_dirs: SwapDirs, opt_store: OptimizerStore,
                 master: Optional[MasterFile]) -> ParamStore:
    """Stage 3's compute-dtype shards; the fp32 master itself where the two coincide."""
    z = cfg.zero
    source = placement.param_source  # Note [parameters from the master] in _placement.py
    master_tensor = source is ParamSource.MASTER
    if placement.param_tier is Tier.NVME and not master_tensor:  # Note [parameter cache] in _nvme_param_store.py
        cache, total = placement.param_cache_elems, placement.layout.param_total
        logger.info("parameter cache: %d of %d shard elements (%.0f MiB, %s) stay in host memory for backward's "
                    "re-reads", cache, total, cache * placement.itemsize / 2**20,
                    "zero.offload_param.max_in_cpu" if z.offload_param.max_in_cpu is not None else
                    f"automatic: at most 1/{PARAM_CACHE_SHARE} of the available host memory")
    if placement.param_tier is Tier.NVME and source.from_master:
        logger.info("fp32 parameters on NVMe are read from the master weights (%s): no params.swp, no parameter "
                    "writes in the step", "host memory" if master_tensor else "master.swp")
    if master_tensor or placement.param_tier.resident:  # Note [parameter store protocol] in _param_store.py
        return MemoryParamStore(placement.opt_tier if master_tensor else placement.param_tier, placement.dtype,
                                placement.layout.param_total, alias=opt_store.master_view() if master_tensor else None)
    return NvmeParamStore(placement.dtype, placement.layout.param_total, swap=swap_dirs.under(z.offload_param.nvme_path),
                          aio_cfg=cfg.aio, master=master, cache_elems=placement.param_cache_elems,
                          host_upto=placement.param_host_upto, max_unit=placement.layout.max_shard,
                          direct_reads=placement.direct_reads,
                          update_chunk=chunk_elems(z.offload_optimizer.chunk_size, placement.layout.opt_total),
                          buffer_size=z.offload_param.buffer_size, buffer_count=staging_buffers(z),
                          slots=placement.layout.param_slots())


def _loss_scaler(p) -> LossScaler:
    return LossScaler(static_scale=p.loss_scale, initial_scale_power=p.initial_scale_power,
                      window=p.loss_scale_window, hysteresis=p.hysteresis, min_scale=p.min_loss_scale)
