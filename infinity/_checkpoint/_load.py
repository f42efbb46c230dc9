"""``infinity.load_checkpoint``: verify, then re-cut the saved shards into this run's stores.

Every file a rank will read is verified (size and CRC-32 against the manifest) before any
state changes, so a corrupt or incomplete checkpoint is refused, naming the file, and leaves
the model and optimizer as they were. Then each rank computes, per parameter, which saved
ranks hold the elements of its own chunk (Note [checkpoint layout] in _format.py) and copies
them straight into its stores: into memory in place, into swap files through the bounded
buffers of ``_io.Mover``.
"""
from __future__ import annotations

import os
import random
from typing import Dict, List

import numpy as np
import torch

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._zero._param import raw_data
from ..errors import StorageError, UsageError
from ._clone import Cloner, entries_of
from ._format import STATE_ARRAYS, CheckpointReader, itemsize, merged, pieces, rank_file, resolve
from ._io import Mover, copy_into
from ._model import agree, check_compatible, engine_and_optimizer, failure
from ._save import EXTRA, RNG, finish_pending


def load_checkpoint(directory, model, optimizer, tag=None, *, clone: bool = True):
    """Load the checkpoint ``<directory>/<tag>`` (tag None: the latest complete one) into
    ``model`` and ``optimizer`` from ``infinity.initialize``, whatever the world size and the
    placement it was saved with; return the ``client_state`` it was saved with ({} if none).
    Collective. ``clone``: swap files are cloned from the checkpoint where the filesystem
    shares extents (Note [cloned checkpoints] in _clone.py), else copied. The checkpoint's
    ``extra.pt`` is a pickle: load checkpoints you trust."""
    engine, opt = engine_and_optimizer(model, optimizer, "load_checkpoint")
    finish_pending(engine, "load_checkpoint")  # a save in flight reads the stores this load rewrites
    engine.settle_writes(rewriting=True)  # a failed step's states are about to be replaced: Note [failed step] in _step_gate.py
    path = agree(_resolve(directory, tag) if comm.rank() == 0 else None, "load_checkpoint")[0]
    reader = CheckpointReader(path, Mover(engine.cfg.aio))
    try:
        manifest = reader.manifest
        check_compatible(engine, opt, manifest, path)
        plan = _plan(engine, opt, reader)
        clones = _clones(engine, opt, reader, plan, Cloner(clone))
        agree(_verify(reader, plan, engine.rank, clones), "load_checkpoint")
        for dest, items in plan:
            if dest is None:
                continue
            rel = items[0][0] if items else None
            if rel in clones:
                clones[rel].clone_back(reader.file(rel), dest, reader.manifest["files"][rel]["bytes"],
                                       entries_of(reader.blocks[rel], reader.manifest["files"][rel]["bytes"]))
                continue
            copy_into(reader.mover, [(reader.file(rel), off, n) for rel, off, _, n in items], dest,
                      [at for _, _, at, _ in items])
    finally:
        reader.close()
    saved = torch.load(os.path.join(path, EXTRA), weights_only=False)
    _restore_optimizer(engine, opt, manifest)
    _restore_buffers(engine.model, saved["buffers"])
    if manifest["world_size"] == engine.world_size:  # at another world size the ranks' streams differ anyway
        _set_rng(torch.load(os.path.join(path, f"rank{engine.rank}", RNG), weights_only=False))
    comm.barrier()
    return saved["extra"]


def _resolve(directory, tag):
    try:
        return resolve(directory, tag)
    except (UsageError, StorageError, OSError) as e:
        return failure(e)


def _plan(engine, opt, reader: CheckpointReader) -> List[tuple]:
    """(destination, [(file, source byte offset, destination byte offset, bytes)]) of every
    copy this rank makes."""
    saved, world = reader.params, reader.world
    fp32: List[tuple] = []  # the optimizer's arrays share their offsets
    params: List[tuple] = []
    whole: List[tuple] = []  # stages 1-2: (parameter, its pieces)
    size = itemsize(engine.dtype)
    for unit in engine.units:
        for p, info in zip(unit.params, unit.infos):
            s = saved[info.name]
            if unit.trainable:
                fp32 += pieces(s, world, s["opt_offset"], info.chunk, engine.rank, unit.opt_offset + info.shard_offset, 4)
            if opt.param_store is not None:
                params += pieces(s, world, s["param_offset"], info.chunk, engine.rank,
                                 unit.param_offset + info.shard_offset, size)
            else:
                whole.append((raw_data(p), pieces(s, world, s["param_offset"], 0, None, 0, size)))
    plan = []
    sources = opt.store.checkpoint_sources()
    for name in STATE_ARRAYS:
        plan.append((sources[name], _named(merged(fp32), name)))
    if opt.param_store is not None:
        # the master weights hold the trainable units' parameters (Note [parameters from the master] in
        # _placement.py): their pieces are verified (None: not loaded), so a damaged file is still refused
        own = opt.param_store.own_part()
        first = size * (own[1] if own is not None else opt.layout.param_total)
        master_held = [x for x in params if x[2] < first]
        if master_held:
            plan.append((None, _named(merged(master_held), "params")))
        if own is not None:
            kept = [(k, src, dst - first, n) for k, src, dst, n in params if dst >= first]
            plan.append((own[0], _named(merged(kept), "params")))
    plan += [(t, _named(items, "params")) for t, items in whole]
    return plan


def _clones(engine, opt, reader: CheckpointReader, plan, cloner: Cloner) -> Dict[str, Cloner]:
    """{checkpoint file: cloner} of the swap files this rank fills by a clone of a whole
    checkpoint file: saved at this world size and layout, so the file is the swap file's first
    bytes, at the same offsets (Note [cloned checkpoints] in _clone.py)."""
    m = reader.manifest
    if (m["world_size"], m["param_total"], m["opt_total"]) != (engine.world_size, opt.layout.param_total,
                                                               opt.layout.opt_total):
        return {}
    out = {}
    for dest, items in plan:
        rels = {rel for rel, *_ in items}
        if not isinstance(dest, str) or len(rels) != 1 or any(src != dst for _, src, dst, _ in items):
            continue
        rel = rels.pop()
        if rel == rank_file(engine.rank, os.path.basename(rel)[: -len(".bin")]) and \
                cloner.can_back(reader.file(rel), dest):
            out[rel] = cloner
    return out


def _named(items, array: str) -> List[tuple]:
    return [(rank_file(k, array), src, dst, n) for k, src, dst, n in items]


def _verify(reader: CheckpointReader, plan, rank: int, clones=()):
    try:
        reader.verify({rel for _, items in plan for rel, *_ in items} | {EXTRA} |
                      ({f"rank{rank}/{RNG}"} if reader.world == comm.world_size() else set()), blocks_of=clones)
    except (StorageError, OSError) as e:
        return failure(e)
    return None


def _restore_optimizer(engine, opt, manifest: dict) -> None:
    """Step counts, the step number, the loss scaler and the groups' hyperparameters; the
    stores are told their contents changed."""
    saved = {p["name"]: p for p in manifest["params"]}
    names = [info.name for unit in engine.units for info in unit.infos]
    for k, slot in enumerate(opt.steps.slots):
        opt.steps.counts[k] = saved[names[slot.index]]["step"]
    opt._step = manifest["step"]
    if opt.scaler is not None and manifest["scaler"] is not None:
        opt.scaler.load_state_dict(manifest["scaler"])
    for group, values in zip(opt.param_groups, manifest["groups"]):
        group.update({k: tuple(v) if k == "betas" else v for k, v in values.items()})
    opt.store.checkpoint_loaded()
    opt.gate.clear()  # every state rewritten: Note [failed step] in _step_gate.py
    if opt.param_store is not None:
        opt.param_store.checkpoint_loaded()
    engine.after_step()  # persistent units' gathered copies are stale
    opt.zero_grad()


def _restore_buffers(model, buffers: Dict[str, torch.Tensor]) -> None:
    own = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            if name in own:
                own[name].copy_(value)


def _own_device_state(state):
    """This rank's device generator from a checkpoint: since this version one state, that of
    the rank's own device; earlier checkpoints saved every visible GPU's (take this rank's)."""
    if isinstance(state, (list, tuple)):
        index = acc.device().index or 0
        return state[index] if index < len(state) else None
    return state


def _set_rng(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    acc.set_rng_state(_own_device_state(states.get("cuda")))
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
