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

import copy
import json
import os
import shutil
import uuid
from typing import Optional, Union

from .._offload._swap import OWNER, _owner_gone, _owner_line
from .._runtime import _comm as comm
from .._runtime._comm import ranks_here
from .._runtime._host_memory import available as host_available
from .._runtime._host_memory import peak_above_now
from .._runtime._log import logger
from .._zero._tiling import untiled_layout
from ..errors import InfinityError, InsufficientResourcesError, UsageError, UsageTypeError
from ._async import SaveHandle
from ._async import start as start_async
from ._clone import Cloner
from ._files import encode_client_state
from ._format import (
    FORMAT,
    LATEST,
    MANIFEST,
    STATE_ARRAYS,
    VERSION,
    check_tag,
    complete_checkpoints,
    fsync_dir,
    now,
    write_atomic,
)
from ._io import Mover
from ._model import agree, engine_and_optimizer, failure, param_entries
from ._snapshot import finish_rank, run_jobs, snapshot, staged_bytes

__all__ = ["save_checkpoint", "finish_pending"]

SMALL_FILES_BYTES = 64 << 20  # room kept for the manifest, RNG states, client state, buffers and config files


def save_checkpoint(directory, model, optimizer, tag=None, *, client_state=None, keep_last: Optional[int] = None,
                    blocking: bool = True, clone: bool = True) -> Union[str, SaveHandle]:
    """Save every state of ``model`` and ``optimizer`` (from ``infinity.initialize``) as
    ``<directory>/<tag>`` (tag None: ``step<optimizer steps>``) and point ``latest`` at it.
    Collective: every rank calls it with the same arguments. ``client_state`` (e.g.
    {"scheduler": its state_dict, "data_position": i}) comes back from ``load_checkpoint``: it
    may hold dicts, lists, tuples, str, int, float, bool, None and tensors (back on the CPU),
    and anything else is refused before anything is written (Note [data, never code] in
    _files.py). ``keep_last``: then remove all but the newest ``keep_last`` complete
    checkpoints. ``clone``: NVMe states are cloned where the filesystem shares extents (Note
    [cloned checkpoints] in _clone.py), else copied. Returns the checkpoint's path; with
    ``blocking=False`` at once a ``SaveHandle`` (``wait()``, ``done()``) of a save that goes on
    while training does (Note [asynchronous saves] in _async.py), or, where its host copy would
    not fit host memory, a finished one of a blocking save (Note [staged copies preflighted]).
    A save in flight is waited for first, and its failure raised. Note [crash-safe commit], Note [checkpoint
    layout] in _format.py."""
    if not isinstance(blocking, bool) or not isinstance(clone, bool):
        raise UsageTypeError(f"save_checkpoint: blocking and clone are True or False, got {blocking!r}, {clone!r}")
    engine, opt = engine_and_optimizer(model, optimizer, "save_checkpoint")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise UsageError(f"save_checkpoint: keep_last must be an int >= 1 (or None to keep all), got {keep_last!r}")
    finish_pending(engine, "save_checkpoint")
    directory = os.path.abspath(os.fspath(directory))
    tag = check_tag(tag if tag is not None else f"step{opt._step}")
    extra = {} if client_state is None else client_state
    agree(_refused(extra), "save_checkpoint")  # before anything is written
    engine.settle_writes()  # the overlapped step and every shard write have landed
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]  # rank 0's
    tmp = os.path.join(directory, f".tmp-{tag}-{token}")
    final = os.path.join(directory, tag)
    staging = not blocking and _staging_fits(engine, opt)
    agree(_prepare(directory, tag, tmp, _bytes_needed(engine, opt)), "save_checkpoint")
    head = _manifest_head(engine, opt, tag) if comm.rank() == 0 else None  # the states as of this call
    mover = Mover(engine.cfg.aio)
    taken = _snapshot_rank(engine, opt, tmp, extra, Cloner(clone), mover, stage=staging)
    if staging:
        try:
            made, jobs = agree_or_abandon(taken, tmp, local=True)
        except InfinityError:
            mover.close()
            raise
        commit = (lambda files: _commit_or_abandon(head, tmp, final, tag, token, files, keep_last)) \
            if comm.rank() == 0 else None
        return start_async(engine, tmp, final, made, jobs, mover, commit, opt.store.checkpoint_done)
    try:
        made, jobs = agree_or_abandon(taken, tmp, local=True)
        files = agree_or_abandon(_write_rank(engine, opt, tmp, made, jobs, mover), tmp)
    finally:
        mover.close()
    error = _commit(head, tmp, final, tag, token, {k: v for f in files for k, v in f.items()}, keep_last) \
        if comm.rank() == 0 else None
    agree(error, "save_checkpoint")
    return final if blocking else SaveHandle(final)  # blocking=False that could not stage: saved already


def _refused(client_state) -> Optional[tuple]:
    """None where a checkpoint can hold ``client_state``, else the failure naming what it cannot."""
    try:
        encode_client_state(client_state)
    except UsageError as e:
        return failure(e)
    return None


def _staging_fits(engine, opt) -> bool:
    """Note [staged copies preflighted]: an asynchronous save copies every state that is not in
    a swap file into host memory at the call (``staged_bytes``), and training goes on beside
    the copy, taking again what its steps took before (``peak_above_now``). Where that does
    not fit what the host may still give (Note [host memory available] in
    _runtime/_host_memory.py) on some rank, with every rank of its node doing the same, the
    kernel's OOM killer would end the run mid-save; so every rank saves blocking instead (the
    checkpoint the same, crash-safe as ever, training waiting for it), and rank 0 logs why with
    the bytes and what would let it save without stopping. Falling back rather than refusing:
    a save requested in the middle of a long run is still made, as DeepSpeed's and torch's
    blocking saves would make it; only its cost in training time changes, and the log says so.
    Collective, so that every rank takes the same path."""
    staged, regrow, ranks = staged_bytes(engine, opt), peak_above_now(), ranks_here()
    have, bound = host_available()
    mine = (engine.rank, staged, regrow, ranks, have, bound)
    short = [r for r in comm.all_gather_object(mine) if r[1] and (r[1] + r[2]) * r[3] > r[4]]
    if short and comm.rank() == 0:
        rank, staged, regrow, ranks, have, bound = short[0]
        need = (staged + regrow) * ranks
        logger.warning(
            f"save_checkpoint(blocking=False) saves blocking instead: rank {rank} would copy {staged} bytes of states "
            f"in host memory into a staging copy while its steps take {regrow} bytes again, x {ranks} rank(s) on "
            f"its node: {need} bytes ({need / 2**30:.2f} GiB), and {bound} leaves {have} bytes "
            f"({have / 2**30:.2f} GiB); training waits for this save. To save without stopping, offload the states "
            f"to NVMe (zero.offload_optimizer.device / zero.offload_param.device: nvme: no host copy), run fewer "
            f"ranks per node, or give the job more host memory")
    return not short


def finish_pending(engine, what: str) -> None:
    """Collective: wait for this engine's save in flight, if any (Note [asynchronous saves]
    in _async.py); a failure on any rank raises on every rank."""
    pending, engine.save_fence.pending = engine.save_fence.pending, None
    error = None
    if pending is not None:
        try:
            pending.wait(comm.timeout_s())
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = failure(e)
            error = (error[0], error[1], f"the asynchronous save before this call failed: {error[2]}")
    agree(error, what)


def agree_or_abandon(result, tmp: str, *, local: bool = False):
    """``agree`` on each rank's result (``local``: only on whether it failed; this rank's result
    is returned); on a failure rank 0 removes the temporary directory (nothing refers to it:
    ``latest`` still names the previous checkpoint)."""
    try:
        if local:
            agree(result if _failed(result) else None, "save_checkpoint")
            return result
        return agree(result, "save_checkpoint")
    except InfinityError:
        if comm.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _failed(result) -> bool:
    return isinstance(result, tuple) and len(result) == 3 and result[0] == "failed"


def _snapshot_rank(engine, opt, tmp: str, extra, cloner: Cloner, mover: Mover, *, stage: bool):
    """This rank's ``snapshot`` (files made now, jobs left), or its failure."""
    try:
        made, jobs = snapshot(engine, opt, tmp, extra, cloner, mover, stage=stage)
        if cloner.cloned_bytes:
            logger.info(f"checkpoint: rank {engine.rank} cloned {cloner.cloned_bytes / 2**20:.1f} MiB of NVMe "
                        f"states into {tmp}")
        return made, jobs
    except Exception as e:  # noqa: BLE001 - e.g. a full disk: every rank must hear of it
        opt.store.checkpoint_done()
        return failure(e)


def _write_rank(engine, opt, tmp: str, made: dict, jobs, mover: Mover):
    """This rank's files: {relative path: {bytes, checksum}}, or its failure."""
    try:
        try:
            files = dict(made)
            files.update(run_jobs(jobs, mover))
        finally:
            opt.store.checkpoint_done()  # e.g. compressed moments' staging files
        finish_rank(tmp, engine.rank, mover)
        return files
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        return failure(e)


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


def _manifest_head(engine, opt, tag: str) -> dict:
    """The manifest but for its files, as of the call (an asynchronous save commits later)."""
    return {
        "tag": tag, "step": opt._step,
        "world_size": engine.world_size, "stage": engine.cfg.zero.stage, "dtype": str(engine.dtype),
        "param_total": opt.layout.param_total, "opt_total": opt.layout.opt_total,
        "params": param_entries(engine, opt),
        "tiled": untiled_layout(engine.model),  # Note [untiled export] in _tiling.py
        "groups": [{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in opt.param_groups],
        "scaler": copy.deepcopy(opt.scaler.state_dict()) if opt.scaler is not None else None,
    }


def _commit_or_abandon(head: dict, tmp: str, final: str, tag: str, token: str, files_of, keep_last):
    """Rank 0's thread of an asynchronous save: gather the ranks' files, then commit; the
    temporary directory goes if either fails (the other ranks see it gone)."""
    try:
        files = files_of()
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = _commit(head, tmp, final, tag, token, files, keep_last)
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return error


def _commit(head: dict, tmp: str, final: str, tag: str, token: str, files: dict, keep_last) -> Optional[tuple]:
    """Rank 0, once every rank's files are written: Note [crash-safe commit]."""
    try:
        manifest = dict(format=FORMAT, version=VERSION, **head, saved_at=now(),
                        files=dict(sorted(files.items())))
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
