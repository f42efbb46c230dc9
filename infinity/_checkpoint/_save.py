"""``infinity.save_checkpoint``: every rank writes its shards, rank 0 commits.

Note [crash-safe commit]: a checkpoint becomes visible in one atomic step. The ranks write
into ``<dir>/.tmp-<tag>-<token>`` (a fresh token per save, so two runs, or two saves, never
share a file; each rank writes only under its own ``rank<r>``), fsync every file and their
directory, and report each file's size and CRC-32. After a collective that proves every rank
finished, rank 0 writes ``manifest.json`` (the one file a complete checkpoint has and a
partial one lacks), fsyncs it and the directory, renames the directory to ``<dir>/<tag>``
(atomic; refused if the tag exists), fsyncs ``<dir>``, and only then replaces ``latest``
(written aside, fsynced, renamed). A crash at any moment leaves ``latest`` at the previous
complete checkpoint; leftovers are a ``.tmp-`` directory, removed by the next save once the
process that wrote it is gone. ``keep_last`` removes older checkpoints only after ``latest``
names the new one.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import uuid
import zlib
from typing import Dict, Optional

import torch

from .._offload._swap import OWNER, _owner_gone, _owner_line
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._zero._param import raw_data
from .._zero._tiling import untiled_layout
from ..errors import InfinityError, InsufficientResourcesError, UsageError
from ._format import (
    FORMAT,
    LATEST,
    MANIFEST,
    STATE_ARRAYS,
    VERSION,
    check_tag,
    complete_checkpoints,
    fsync_dir,
    itemsize,
    now,
    rank_file,
    write_atomic,
)
from ._io import FileSink, Mover, fsync_path
from ._model import agree, engine_and_optimizer, failure, param_entries
from ._safetensors_export import _persistent_buffers

EXTRA, RNG = "extra.pt", "rng.pt"
SMALL_FILES_BYTES = 64 << 20  # room kept for the manifest, RNG states, extra and config files


def save_checkpoint(directory, model, optimizer, tag=None, *, keep_last: Optional[int] = None, **extra) -> str:
    """Save every state of ``model`` and ``optimizer`` (from ``infinity.initialize``) as
    ``<directory>/<tag>`` (tag None: ``step<optimizer steps>``) and point ``latest`` at it.
    Collective: every rank calls it with the same arguments. ``extra`` (picklable values, e.g.
    the LR scheduler's state_dict and the data position) comes back from ``load_checkpoint``.
    ``keep_last``: then remove all but the newest ``keep_last`` complete checkpoints.
    Returns the checkpoint's path. Note [crash-safe commit], Note [checkpoint layout]."""
    engine, opt = engine_and_optimizer(model, optimizer, "save_checkpoint")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise UsageError(f"save_checkpoint: keep_last must be an int >= 1 (or None to keep all), got {keep_last!r}")
    directory = os.path.abspath(os.fspath(directory))
    tag = check_tag(tag if tag is not None else f"step{opt._step}")
    engine.settle_writes()  # the overlapped step and every shard write have landed
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]  # rank 0's
    tmp = os.path.join(directory, f".tmp-{tag}-{token}")
    agree(_prepare(directory, tag, tmp, _bytes_needed(engine, opt)), "save_checkpoint")
    try:
        files = agree(_write_rank(engine, opt, tmp, extra), "save_checkpoint")
    except InfinityError:
        if comm.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing refers to it: latest still names the previous one
        raise
    final = os.path.join(directory, tag)
    if comm.rank() == 0:
        error = _commit(engine, opt, tmp, final, tag, token, {k: v for f in files for k, v in f.items()}, keep_last)
    else:
        error = None
    agree(error, "save_checkpoint")
    return final


def _bytes_needed(engine, opt) -> int:
    """Bytes every rank together writes: the shard files (from the layout) and a margin."""
    per_rank = opt.layout.param_total * engine.itemsize + len(STATE_ARRAYS) * 4 * opt.layout.opt_total
    return engine.world_size * per_rank + SMALL_FILES_BYTES


def _prepare(directory: str, tag: str, tmp: str, needed: int):
    """Rank 0: check the tag is new and the disk has room, create the temporary directory."""
    if comm.rank() != 0:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(os.path.join(directory, tag)):
            raise UsageError(f"checkpoint {tag!r} already exists in {directory}; pass another tag, or remove it")
        _remove_leftovers(directory)
        free = shutil.disk_usage(directory).free
        if free < needed:
            raise InsufficientResourcesError(
                f"the checkpoint needs {needed} bytes ({needed / 2**30:.2f} GiB) under {directory} and only {free} "
                f"bytes are free; free space there, pass keep_last to prune old checkpoints, or save elsewhere")
        os.makedirs(tmp)
        with open(os.path.join(tmp, OWNER), "w") as f:
            f.write(_owner_line(os.getpid()))
    except (OSError, UsageError, InsufficientResourcesError) as e:
        return failure(e)
    return None


def _remove_leftovers(directory: str) -> None:
    """``.tmp-`` directories of saves whose process is gone, ``.old-`` ones a prune did not
    finish removing (Note [crash-safe commit])."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and (name.startswith(".old-") or (name.startswith(".tmp-") and _owner_gone(path))):
            shutil.rmtree(path, ignore_errors=True)


def _write_rank(engine, opt, tmp: str, extra: dict):
    """This rank's files: {relative path: {bytes, crc32}}, or its failure."""
    rank = engine.rank
    try:
        os.makedirs(os.path.join(tmp, f"rank{rank}"), exist_ok=True)
        mover = Mover(engine.cfg.aio)
        try:
            out = {}
            out[rank_file(rank, "params")] = _write_params(engine, opt, tmp, mover)
            sources = opt.store.checkpoint_sources()
            try:
                for name in STATE_ARRAYS:
                    out[rank_file(rank, name)] = _write_flat(tmp, rank_file(rank, name), sources[name], 4 * opt.total,
                                                             mover)
            finally:
                opt.store.checkpoint_done()  # e.g. compressed moments' staging files
            mover.synced()
        finally:
            mover.close()
        out[f"rank{rank}/{RNG}"] = _save_small(rng_states(), os.path.join(tmp, f"rank{rank}", RNG))
        if rank == 0:
            out[EXTRA] = _save_small({"extra": extra, "buffers": _buffers(engine.model)}, os.path.join(tmp, EXTRA))
            out.update(_hf_files(engine.model, tmp))
        fsync_dir(os.path.join(tmp, f"rank{rank}"))
        return out
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable extra: every rank must hear of it
        return failure(e)


def _write_flat(tmp: str, rel: str, source, nbytes: int, mover: Mover) -> dict:
    sink = FileSink(os.path.join(tmp, rel), mover, nbytes)
    sink.append(source, 0, nbytes)
    size, crc = sink.close()
    return {"bytes": size, "crc32": crc}


def _write_params(engine, opt, tmp: str, mover: Mover) -> dict:
    """The compute-dtype shards: the parameter store (stage 3), else each unit's shard cut
    from its whole parameters, one unit at a time, at the layout's offsets."""
    rel = rank_file(engine.rank, "params")
    size = itemsize(engine.dtype)
    if opt.param_store is not None:
        return _write_flat(tmp, rel, opt.param_store.checkpoint_source(), size * opt.layout.param_total, mover)
    sink = FileSink(os.path.join(tmp, rel), mover, opt.layout.param_total * size)
    for unit in engine.units:
        sink.zeros(unit.param_offset * size - sink.size)
        shard = unit.shard_of([raw_data(p) for p in unit.params], engine.dtype)
        sink.append(shard.cpu(), 0, shard.numel() * size)
    sink.zeros(opt.layout.param_total * size - sink.size)
    nbytes, crc = sink.close()
    return {"bytes": nbytes, "crc32": crc}


def _save_small(obj, path: str) -> dict:
    """A small file through torch.save, fsynced; its size and CRC-32."""
    torch.save(obj, path)
    return _small_entry(path)


def _small_entry(path: str) -> dict:
    """Size and CRC-32 of a small file, once fsynced."""
    fsync_path(path)
    with open(path, "rb") as f:
        data = f.read()
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _buffers(model) -> Dict[str, torch.Tensor]:
    """The model's persistent buffers (rank 0's: every rank holds the same)."""
    return {name: b.detach().cpu().clone() for name, b in _persistent_buffers(model).items()}


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
        out[f"hf/{name}"] = _small_entry(os.path.join(hf, name))
    if out:
        fsync_dir(hf)
    return out


def rng_states() -> dict:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": acc.get_rng_state(),
            "python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)}


def _commit(engine, opt, tmp: str, final: str, tag: str, token: str, files: dict, keep_last) -> Optional[str]:
    """Rank 0, once every rank's files are written: Note [crash-safe commit]."""
    try:
        manifest = {
            "format": FORMAT, "version": VERSION, "tag": tag, "saved_at": now(), "step": opt._step,
            "world_size": engine.world_size, "stage": engine.cfg.zero.stage, "dtype": str(engine.dtype),
            "param_total": opt.layout.param_total, "opt_total": opt.layout.opt_total,
            "params": param_entries(engine, opt),
            "tiled": untiled_layout(engine.model),  # Note [untiled export] in tiling.py
            "groups": [{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in opt.param_groups],
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
            "files": dict(sorted(files.items())),
        }
        path = os.path.join(tmp, MANIFEST)
        with open(path, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UsageError(f"checkpoint {tag!r} appeared in {os.path.dirname(final)} while saving (another run "
                             f"saves there?): {e.strerror}; pass another tag") from e
        directory = os.path.dirname(final)
        fsync_dir(directory)
        write_atomic(os.path.join(directory, LATEST), tag + "\n", token)
        if keep_last is not None:
            _prune(directory, keep_last, token)
    except (OSError, UsageError, TypeError, ValueError) as e:
        return failure(e)
    return None


def _plain(v) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _prune(directory: str, keep_last: int, token: str) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints: each is first renamed
    aside (it vanishes at once, never half-deleted under its tag), then deleted."""
    for _, tag in complete_checkpoints(directory)[:-keep_last]:
        aside = os.path.join(directory, f".old-{tag}-{token}")
        os.rename(os.path.join(directory, tag), aside)
        shutil.rmtree(aside, ignore_errors=True)
