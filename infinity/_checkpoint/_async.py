"""``save_checkpoint(..., blocking=False)``: the save goes on while training does.

Note [asynchronous saves]: at the call every rank snapshots its states consistently (the
overlapped step joined and every write landed first): host states are staged into copies,
NVMe states cloned where the filesystem shares extents, and the small files (RNG, client
state, buffers) written; rank 0 also fixes the manifest's record of the model and optimizer
(step counts, groups, scaler) as of the call. The call returns a ``SaveHandle``. A thread of
the rank then writes the staged copies and copies the swap files that could not be cloned,
holding the fence that keeps the next step from rewriting them until they are copied (Note
[save fence] in _save_fence.py), fsyncs everything, and reports the rank's files in
``rank<r>/files.json`` (or its error in ``rank<r>/failed``), written aside and renamed. Rank
0's thread waits for every rank's report (at most the comm timeout) and commits exactly as a
blocking save does (Note [crash-safe commit] in _save.py): manifest last, atomic rename, then
``latest``; no collective runs off the main thread, so the training's collectives never meet
the save's. Another rank's handle is done once rank 0 committed (the manifest is there) or gave
up (the temporary directory is gone). ``wait()`` raises this rank's failure; the next
``save_checkpoint`` / ``load_checkpoint`` first waits for the save in flight and agrees on
every rank's outcome, so a failure anywhere raises on every rank there, and ``Engine.close``
waits for it and raises its error: a failed save is never silent.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Callable, Dict, List, Optional

from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from ..errors import StorageError, WaitTimeout
from ._format import MANIFEST, fsync_dir
from ._io import Mover
from ._snapshot import Job, finish_rank, run_jobs

FILES, FAILED = "files.json", "failed"
POLL_S = 0.01


class SaveHandle:
    """A save in flight: ``done()``, ``wait()`` (its path, or its error raised), ``path``."""

    def __init__(self, path: str):
        self.path = path
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def start(self, body: Callable[[], None]) -> "SaveHandle":
        backend = acc.current()  # Note [backend per thread] in _accelerator/__init__.py

        def run():
            try:
                with acc.bound(backend):
                    body()
            except BaseException as e:  # noqa: BLE001 - kept for wait() and the next save
                self._error = e

        self._thread = threading.Thread(target=run, name="infinity-checkpoint-save", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> str:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise WaitTimeout(f"the asynchronous save of {self.path} did not finish in {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self.path


def start(engine, tmp: str, final: str, made: Dict[str, dict], jobs: List[Job], mover: Mover,
          commit: Optional[Callable[[Callable[[], dict]], Optional[tuple]]], done_reading: Callable[[], None]) -> SaveHandle:
    """Run the rank's ``jobs`` on a thread; rank 0 (``commit`` given) then commits."""
    handle = SaveHandle(final)
    fence = engine.save_fence
    copies = [j for j in jobs if j.reads_swap]
    if copies:
        fence.hold(handle)
    else:
        fence.pending = handle
        done_reading()  # nothing reads the stores any more (e.g. compressed moments' staging files)
    timeout = comm.timeout_s()

    def body() -> None:
        rank_dir = os.path.join(tmp, f"rank{engine.rank}")
        try:
            try:
                files = dict(made)
                files.update(run_jobs(copies, mover))
            finally:
                if copies:
                    done_reading()
                    fence.release()
            files.update(run_jobs([j for j in jobs if not j.reads_swap], mover))
            finish_rank(tmp, engine.rank, mover)
            _report(rank_dir, FILES, json.dumps(files))
        except BaseException as e:
            _report(rank_dir, FAILED, f"{type(e).__name__}: {e}")
            raise
        finally:
            mover.close()
        if commit is not None:
            error = commit(lambda: _gather(tmp, engine.world_size, timeout))
            if error is not None:
                raise StorageError(f"save_checkpoint: {error[2]}")
        else:
            _await_commit(tmp, final, timeout)

    return handle.start(body)


def _report(rank_dir: str, name: str, text: str) -> None:
    """The rank's report, written aside and renamed: rank 0 never reads half of one."""
    try:
        aside = os.path.join(rank_dir, f".{name}.tmp")
        with open(aside, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(aside, os.path.join(rank_dir, name))
    except OSError:
        pass  # rank 0 then gives up at the timeout, naming this rank


def _gather(tmp: str, world: int, timeout: float) -> dict:
    """Rank 0: every rank's files, once all have reported; raises a rank's failure."""
    deadline = time.monotonic() + timeout
    files: dict = {}
    for r in range(world):
        rank_dir = os.path.join(tmp, f"rank{r}")
        while True:
            failed = os.path.join(rank_dir, FAILED)
            if os.path.exists(failed):
                with open(failed) as f:
                    raise StorageError(f"save_checkpoint: rank {r} failed: {f.read()}")
            report = os.path.join(rank_dir, FILES)
            if os.path.exists(report):
                with open(report) as f:
                    files.update(json.load(f))
                os.unlink(report)  # not part of the checkpoint
                fsync_dir(rank_dir)
                break
            if time.monotonic() > deadline:
                raise WaitTimeout(f"save_checkpoint: rank {r} did not report its files in {timeout:.0f} s")
            time.sleep(POLL_S)
    return files


def _await_commit(tmp: str, final: str, timeout: float) -> None:
    """Another rank: until rank 0 committed (the manifest is there) or gave up (tmp is gone)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(final, MANIFEST)):
        if not os.path.exists(tmp) and not os.path.exists(final):
            raise StorageError(f"save_checkpoint: rank 0 did not commit {final} (its error is raised there)")
        if time.monotonic() > deadline:
            raise WaitTimeout(f"save_checkpoint: rank 0 did not commit {final} in {timeout:.0f} s")
        time.sleep(POLL_S)


def abandon(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
