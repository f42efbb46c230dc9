"""One rank's part of a save: what is taken at the call, and what is written after it.

``snapshot`` creates the rank's files that cost nothing to make at the call (clones of swap
files where the filesystem shares extents, Note [cloned checkpoints] in _clone.py; the RNG
states, the client state, the buffers and the Hugging Face config, as JSON and safetensors:
Note [data, never code] in _files.py) and returns the rest as
``Job``s: a state in host memory (written in place by a blocking save, or staged into a copy
for an asynchronous one, Note [asynchronous saves] in _async.py) or a swap file to copy
(``reads_swap``: the step must not rewrite it until the job ran, Note [save fence] in
_save_fence.py). A blocking save runs the jobs at once; either way every file is fsynced
before the rank reports it (Note [crash-safe commit] in _save.py).
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from .._zero._param import raw_data
from ..aio import aligned_empty
from ._clone import Cloner
from ._files import BUFFERS, RNG, client_state_files, current_rng, rng_bytes, tensor_bytes, write_small
from ._format import STATE_ARRAYS, fsync_dir, itemsize, rank_file
from ._io import FileSink, Mover, Place, as_bytes, fsync_path
from ._safetensors_export import _persistent_buffers


@dataclass
class Job:
    """A file still to write: ``write(mover)`` gives its manifest entry (bytes, checksum)."""

    rel: str
    write: Callable[[Mover], dict]
    reads_swap: bool  # it copies a swap file that the next step may rewrite


def snapshot(engine, opt, tmp: str, extra, cloner: Cloner, mover: Mover, *, stage: bool) -> Tuple[dict, List[Job]]:
    """This rank's files made now ({relative path: entry}) and the jobs left. ``stage``: host
    states are copied now, so that the jobs never read what the next step changes."""
    rank = engine.rank
    os.makedirs(os.path.join(tmp, f"rank{rank}"), exist_ok=True)
    made: Dict[str, dict] = {}
    jobs: List[Job] = []
    size = itemsize(engine.dtype)
    params = rank_file(rank, "params")
    parts = opt.param_store.checkpoint_parts() if opt.param_store is not None else []
    if len(parts) == 1:
        _add(made, jobs, tmp, params, parts[0][0], size * opt.layout.param_total, cloner, mover, stage)
    elif parts:  # the master's, then the frozen units' (Note [parameters from the master] in _placement.py)
        jobs.append(_parts_job(tmp, params, parts, size, stage))
    elif stage:
        jobs.append(Job(params, _flat_writer(tmp, params, _params_flat(engine, opt), size * opt.layout.param_total),
                        False))
    else:
        jobs.append(Job(params, lambda m: _write_unit_shards(engine, opt, tmp, m), False))
    sources = opt.store.checkpoint_sources()
    for name in STATE_ARRAYS:
        if isinstance(sources[name], list):  # over tiers: Note [split tiers] in _offload/_split.py
            jobs.append(_parts_job(tmp, rank_file(rank, name), sources[name], 4, stage))
        else:
            _add(made, jobs, tmp, rank_file(rank, name), sources[name], 4 * opt.total, cloner, mover, stage)
    made[f"rank{rank}/{RNG}"] = write_small(os.path.join(tmp, f"rank{rank}", RNG), rng_bytes(current_rng()))
    if rank == 0:  # Note [data, never code] in _files.py
        small = client_state_files(extra)
        small[BUFFERS] = tensor_bytes(_persistent_buffers(engine.model))
        made.update((rel, write_small(os.path.join(tmp, rel), data)) for rel, data in small.items())
        made.update(_hf_files(engine.model, tmp))
    return made, jobs


def staged_bytes(engine, opt) -> int:
    """Bytes an asynchronous save copies into host memory at the call (``_staged``,
    ``_params_flat``): every state that is not in a swap file."""
    params = itemsize(engine.dtype) * (opt.layout.param_total if opt.param_store is None else
                                       opt.param_store.memory_elems)
    states = len(STATE_ARRAYS) * 4 * opt.store.memory_elems
    return params + states


def run_jobs(jobs: List[Job], mover: Mover) -> Dict[str, dict]:
    return {job.rel: job.write(mover) for job in jobs}


def finish_rank(tmp: str, rank: int, mover: Mover) -> None:
    """Every file of the rank is on disk, and so is its directory."""
    mover.synced()
    fsync_dir(os.path.join(tmp, f"rank{rank}"))


def _add(made: dict, jobs: List[Job], tmp: str, rel: str, source, nbytes: int, cloner: Cloner, mover: Mover,
         stage: bool) -> None:
    dest = os.path.join(tmp, rel)
    if nbytes and isinstance(source, str) and cloner.can(source, os.path.dirname(dest)):
        made[rel] = cloner.clone_out(source, dest, nbytes, mover.checksum)
        mover.sync_soon(dest)
    elif isinstance(source, str):
        jobs.append(Job(rel, _flat_writer(tmp, rel, source, nbytes), True))
    else:
        jobs.append(Job(rel, _flat_writer(tmp, rel, _staged(source, nbytes) if stage else source, nbytes), False))


def _parts_job(tmp: str, rel: str, parts: List[tuple], size: int, stage: bool) -> Job:
    """One checkpoint file from (tensor or swap file, elements) parts in order; ``stage``: the tensors copied now."""
    pieces = [(_staged(src, size * n) if stage and not isinstance(src, str) else src, size * n) for src, n in parts]
    return Job(rel, _parts_writer(tmp, rel, pieces), any(isinstance(src, str) for src, _ in parts))


def _parts_writer(tmp: str, rel: str, parts: List[Tuple[Place, int]]) -> Callable[[Mover], dict]:
    """One checkpoint file made of the first bytes of several sources (swap files, tensors), in order."""
    def write(mover: Mover) -> dict:
        sink = FileSink(os.path.join(tmp, rel), mover, sum(n for _, n in parts))
        for source, nbytes in parts:
            sink.append(source, 0, nbytes)
        size, crc = sink.close()
        return {"bytes": size, "crc32": crc}

    return write


def _staged(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A copy of the tensor's first ``nbytes`` in aligned host memory (O_DIRECT writes it as is)."""
    out = aligned_empty(nbytes)
    out.copy_(as_bytes(t)[:nbytes])
    return out


def _flat_writer(tmp: str, rel: str, source, nbytes: int) -> Callable[[Mover], dict]:
    def write(mover: Mover) -> dict:
        sink = FileSink(os.path.join(tmp, rel), mover, nbytes)
        sink.append(source, 0, nbytes)
        size, crc = sink.close()
        return {"bytes": size, "crc32": crc}

    return write


def _params_flat(engine, opt) -> torch.Tensor:
    """Stages 1-2: the rank's compute-dtype shards at the layout's offsets, in host memory."""
    size = itemsize(engine.dtype)
    out = aligned_empty(opt.layout.param_total * size)
    out.zero_()
    for unit in engine.units:
        shard = unit.shard_of([raw_data(p) for p in unit.params], engine.dtype).cpu()
        out[unit.param_offset * size : unit.param_offset * size + shard.numel() * size].copy_(as_bytes(shard))
    return out


def _write_unit_shards(engine, opt, tmp: str, mover: Mover) -> dict:
    """Stages 1-2: each unit's shard cut from its whole parameters, one unit at a time, at
    the layout's offsets (no copy of the whole space)."""
    size = itemsize(engine.dtype)
    sink = FileSink(os.path.join(tmp, rank_file(engine.rank, "params")), mover, opt.layout.param_total * size)
    for unit in engine.units:
        sink.zeros(unit.param_offset * size - sink.size)
        shard = unit.shard_of([raw_data(p) for p in unit.params], engine.dtype)
        sink.append(shard.cpu(), 0, shard.numel() * size)
    sink.zeros(opt.layout.param_total * size - sink.size)
    nbytes, crc = sink.close()
    return {"bytes": nbytes, "crc32": crc}


def small_entry(path: str) -> dict:
    """Size and CRC-32 of a small file, once fsynced."""
    fsync_path(path)
    with open(path, "rb") as f:
        data = f.read()
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _hf_files(model, tmp: str) -> dict:
    """The Hugging Face config (and generation config) of the model, for export."""
    out = {}
    hf = os.path.join(tmp, "hf")
    for attr in ("config", "generation_config"):
        cfg = getattr(model, attr, None)
        if cfg is None or not hasattr(cfg, "save_pretrained"):
            continue
        os.makedirs(hf, exist_ok=True)
        cfg.save_pretrained(hf)
    for name in sorted(os.listdir(hf)) if os.path.isdir(hf) else []:
        out[f"hf/{name}"] = small_entry(os.path.join(hf, name))
    if out:
        fsync_dir(hf)
    return out
