"""``infinity.load_checkpoint``: verify, then re-cut the saved shards into this run's stores.

Every file a rank will read is verified (its kind, its size and CRC-32 against the manifest)
before any state changes and before any byte of it is parsed, so a corrupt, incomplete or
tampered checkpoint is refused, naming the file, and leaves the model and optimizer as they
were; nothing in a checkpoint is code (Note [data, never code] in _files.py). Then each rank
computes, per parameter, which saved ranks hold the elements of its own shard (Note
[checkpoint layout] in _format.py) and copies them straight into its stores: into memory in
place, into swap files through the bounded buffers of ``_io.Mover``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .._runtime import _comm as comm
from .._zero._param import raw_data
from ..errors import StorageError, UsageError, UsageTypeError
from ._clone import Cloner, entries_of
from ._files import BUFFERS, CLIENT_JSON, CLIENT_TENSORS, RNG, decode_client_state, rng_states, set_rng
from ._format import STATE_ARRAYS, CheckpointReader, itemsize, merged, over_parts, pieces, rank_file, resolve
from ._io import Mover, copy_into
from ._legacy import EXTRA, OLD_RNG, is_legacy, load_pickle, refuse
from ._model import agree, check_compatible, engine_and_optimizer, failure
from ._save import finish_pending


def load_checkpoint(directory, model, optimizer, tag=None, *, clone: bool = True, trust_pickle: bool = False):
    """Load the checkpoint ``<directory>/<tag>`` (tag None: the latest complete one) into
    ``model`` and ``optimizer`` from ``infinity.initialize``, whatever the world size and the
    placement it was saved with; return the ``client_state`` it was saved with ({} if none).
    Collective. ``clone``: swap files are cloned from the checkpoint where the filesystem
    shares extents (Note [cloned checkpoints] in _clone.py), else copied. A checkpoint holds
    no code (Note [data, never code] in _files.py); one of format version 1 or 2 holds pickles,
    read only with ``trust_pickle=True``: it runs whatever code they hold, so pass it only for
    a checkpoint whose every writer you trust (or convert it once: ``python -m infinity.export
    --convert-old DIR --trust-pickle``)."""
    if not isinstance(trust_pickle, bool) or not isinstance(clone, bool):
        raise UsageTypeError(f"load_checkpoint: clone and trust_pickle are True or False, got {clone!r}, "
                             f"{trust_pickle!r}")
    engine, opt = engine_and_optimizer(model, optimizer, "load_checkpoint")
    finish_pending(engine, "load_checkpoint")  # a save in flight reads the stores this load rewrites
    engine.settle_writes(rewriting=True)  # a failed step's states are about to be replaced: Note [failed step] in _step_gate.py
    path = agree(_resolve(directory, tag) if comm.rank() == 0 else None, "load_checkpoint")[0]
    reader = CheckpointReader(path, Mover(engine.cfg.aio))
    try:
        manifest = reader.manifest
        if is_legacy(manifest) and not trust_pickle:  # every rank reads the same manifest
            raise refuse(path, manifest, "load_checkpoint")
        check_compatible(engine, opt, manifest, path)
        plan = _plan(engine, opt, reader)
        clones = _clones(engine, opt, reader, plan, Cloner(clone))
        agree(_verify(reader, plan, engine.rank, clones), "load_checkpoint")
        small = _small(reader, engine.rank, trust_pickle)
        agree(small if not isinstance(small, _Small) else None, "load_checkpoint")
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
    if not isinstance(small, _Small):  # agreed above: unreachable, for the type checker
        raise StorageError(f"load_checkpoint: {small[2]}")
    _restore_optimizer(engine, opt, manifest)
    _restore_buffers(engine.model, small.buffers)
    if small.rng is not None:  # at another world size the ranks' streams differ anyway
        set_rng(small.rng)
    comm.barrier()
    return small.client_state


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
                fp32 += pieces(s, world, s["opt_offset"], info.shard_numel, engine.rank, unit.opt_offset + info.shard_offset, 4)
            if opt.param_store is not None:
                params += pieces(s, world, s["param_offset"], info.shard_numel, engine.rank,
                                 unit.param_offset + info.shard_offset, size)
            else:
                whole.append((raw_data(p), pieces(s, world, s["param_offset"], 0, None, 0, size)))
    plan = []
    sources = opt.store.checkpoint_sources()
    for name in STATE_ARRAYS:
        plan += over_parts(sources[name], _named(merged(fp32), name), 4)
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
            plan += over_parts(own[0], _named(merged(kept), "params"), size)
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
        side = {rel for rel in reader.manifest["files"] if rel.startswith("hf/")} if rank == 0 else set()
        reader.verify({rel for _, items in plan for rel, *_ in items} | side, blocks_of=clones)  # side: not read, tiny
    except (StorageError, OSError) as e:
        return failure(e)
    return None


@dataclass
class _Small:
    """What a load reads from the small files (Note [data, never code] in _files.py)."""

    client_state: Any
    buffers: Dict[str, torch.Tensor]
    rng: Optional[dict]  # this rank's RNG states; None at another world size


def _small(reader: CheckpointReader, rank: int, trust_pickle: bool):
    """The small files' ``_Small``, each file checked before it is parsed, or the failure.
    Every rank reads the client state and buffers (rank 0 wrote them once)."""
    same_world = reader.world == comm.world_size()
    try:
        if is_legacy(reader.manifest):
            return _small_legacy(reader, rank, same_world, trust_pickle)
        tensors, _ = reader.small(CLIENT_TENSORS)
        client_state = decode_client_state(reader.small(CLIENT_JSON), tensors, reader.file(CLIENT_JSON))
        buffers, _ = reader.small(BUFFERS)
        rng = None
        if same_world:
            rel = f"rank{rank}/{RNG}"
            rng = rng_states(*reader.small(rel), reader.file(rel))
        return _Small(client_state, buffers, rng)
    except Exception as e:  # noqa: BLE001 - e.g. a trusted old pickle that fails: every rank must hear of it
        return failure(e)


def _small_legacy(reader: CheckpointReader, rank: int, same_world: bool, trust_pickle: bool):
    """A version 1 or 2 checkpoint's pickles, verified, then read as trusted (``_legacy.py``)."""
    rels = [EXTRA] + ([f"rank{rank}/{OLD_RNG}"] if same_world else [])
    reader.verify(rels)
    saved = load_pickle(reader.file(EXTRA), trust_pickle=trust_pickle)
    rng = load_pickle(reader.file(rels[1]), trust_pickle=trust_pickle) if same_world else None
    return _Small(saved["extra"], saved["buffers"], rng)


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
