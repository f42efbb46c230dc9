"""Checkpoints in the main job: ``--save-every N``, ``--resume auto|DIR``, ``--save-on-signal``.

Note [preemption]: with ``--save-on-signal``, SIGTERM (what cluster schedulers send before they
kill) or SIGINT only raises a flag; the step in flight finishes, then the ranks agree (one
all-reduce of the signals' numbers per step: a signal may reach some ranks only) to save a
checkpoint and stop, and the job exits 0 saying how to resume. Every rank then names the same
signal and skips the weights' export (a rank exporting alone would wait in gathers the others
never issue). A signal in the last step stops nothing: the job ends as it would, weights exported.
A second signal stops the job at once, as without the flag: SIGINT raises KeyboardInterrupt
and SIGTERM SystemExit where the main thread is, the engine is closed while it unwinds (the
overlapped step stops at its next chunk: Note [interrupted step] in _step_gate.py, the swap
files are removed), nothing is saved, the last complete checkpoint stays the one to resume
from, and the job exits 128 + the signal's number (130, 143). The data position is the step
number (``Batches.step`` is a function of it), saved with the LR scheduler's state.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from .._runtime import _comm as comm
from .._zero._engine import engine_of
from ..errors import UsageError
from ._format import LATEST, MANIFEST, complete_checkpoints
from ._load import load_checkpoint
from ._save import finish_pending, save_checkpoint

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class TrainCheckpoints:
    directory: Optional[str]  # where the job's checkpoints go: <output_dir>/checkpoints
    save_every: int = 0
    resume: Optional[str] = None  # "auto", a run's checkpoint directory, or one checkpoint
    keep_last: Optional[int] = None
    save_async: bool = False  # Note [asynchronous saves] in _async.py; a save on a signal still blocks
    save_on_signal: bool = False  # SIGTERM/SIGINT save at the step's end (Note [preemption])
    trust_pickle: bool = False  # --trust-pickle: resume from a version 1 or 2 checkpoint (Note [data, never code] in _files.py)
    stopped_by: Optional[str] = None  # the signal that stopped the job, on every rank once they agreed
    _flag: bool = False
    _signum: int = 0  # the signal that asked this rank to stop
    _last_saved: int = -1
    _uncounted: Optional[str] = None  # a save whose SSD bytes are not counted yet

    @classmethod
    def from_args(cls, save_every: Optional[int], resume: Optional[str], keep_last: Optional[int],
                  output_dir: Optional[str], save_async: bool = False,
                  save_on_signal: bool = False, trust_pickle: bool = False) -> "TrainCheckpoints":
        if save_every is not None and save_every < 1:
            raise UsageError(f"--save-every must be >= 1 (steps between checkpoints), got {save_every}")
        directory = os.path.join(output_dir, "checkpoints") if output_dir else None
        if directory is None and (save_every or resume == "auto"):
            raise UsageError("--save-every and --resume auto keep checkpoints under --output-dir/checkpoints: "
                             "pass --output-dir")
        if save_async and not save_every:
            raise UsageError("--save-async makes the saves of --save-every asynchronous: pass --save-every N too")
        if save_on_signal and directory is None:
            raise UsageError("--save-on-signal saves a checkpoint under --output-dir/checkpoints: pass --output-dir")
        if trust_pickle and resume is None:
            raise UsageError("--trust-pickle lets --resume read a checkpoint of format version 1 or 2: pass --resume "
                             "too")
        return cls(directory, save_every or 0, resume, keep_last, save_async, save_on_signal, trust_pickle=trust_pickle)

    # ------------------------------------------------------------ resume

    def _source(self):
        """(run directory, tag) to resume from, or None for a fresh start."""
        if self.resume is None:
            return None
        if self.resume == "auto":
            if not complete_checkpoints(self.directory):
                print(f"infinity.train: no checkpoint in {self.directory} yet; starting from step 1", file=sys.stderr)
                return None
            return self.directory, None
        path = os.path.abspath(self.resume)
        if os.path.exists(os.path.join(path, MANIFEST)):  # one checkpoint
            return os.path.dirname(path), os.path.basename(path)
        if os.path.exists(os.path.join(path, LATEST)) or complete_checkpoints(path):
            return path, None
        raise UsageError(f"--resume {self.resume}: neither a checkpoint (no {MANIFEST}) nor a directory of "
                         f"checkpoints (no {LATEST}); pass --resume auto or the directory save_checkpoint wrote")

    def resume_into(self, run) -> int:
        """Load the checkpoint to resume from, if any; the first step to run."""
        source = self._source()
        if source is None:
            return 1
        extra = load_checkpoint(source[0], run.model, run.optimizer, tag=source[1], trust_pickle=self.trust_pickle)
        run.scheduler.load_state_dict(extra["scheduler"])
        if comm.rank() == 0:
            print(f"infinity.train: resumed from {source[0]} ({source[1] or 'latest'}) after step {extra['step']}",
                  file=sys.stderr)
        return extra["step"] + 1

    # ------------------------------------------------------------ saving

    def save(self, run, step: int, *, blocking: bool = True) -> Optional[str]:
        if self.directory is None or step == self._last_saved:
            return None
        self._last_saved = step
        saved = save_checkpoint(self.directory, run.model, run.optimizer, tag=f"step{step}",
                                keep_last=self.keep_last, blocking=blocking,
                                client_state={"step": step, "scheduler": run.scheduler.state_dict()})
        self._count(run)  # the save before this one: committed, since this one waited for it
        path = saved if isinstance(saved, str) else saved.path
        self._uncounted = path
        if blocking:
            self._count(run)
        return path

    def _count(self, run) -> None:
        """The SSD bytes of the last save, once it has committed (Note [endurance budget] in _endurance.py)."""
        if self._uncounted is not None and getattr(run, "ssd", None) is not None:
            run.ssd.add_checkpoint(self._uncounted)
        self._uncounted = None

    def wait(self, run) -> None:
        """Collective: the asynchronous save in flight is committed, or its error raised."""
        finish_pending(engine_of(run.model), "infinity.train")
        self._count(run)

    def after_step(self, run, step: int, last: int) -> bool:
        """Save when due; True when a signal asked to stop (then saved: Note [preemption])."""
        stop = False
        if self.save_on_signal:  # the ranks agree on a stop only where a signal may ask for one
            # the signal's number, not a flag: every rank names it and skips the weights' export
            # alike (a rank that exported alone would wait in collectives the others never issue)
            asked = torch.tensor([float(self._signum if self._flag else 0)])
            comm.all_reduce(asked, "max", what="stop request")
            stop = asked.item() > 0 and step < last  # the last step's end: the job ends as it would
            if stop:
                self.stopped_by = signal.Signals(int(asked.item())).name
        if stop or (self.save_every and (step % self.save_every == 0 or step == last)):
            path = self.save(run, step, blocking=stop or not self.save_async)
            if stop and comm.rank() == 0:
                print(_stopped_text(self.stopped_by, step, path), flush=True)
        return stop

    @contextlib.contextmanager
    def on_signals(self):
        """With ``--save-on-signal``, SIGTERM and SIGINT raise the stop flag while the loop runs
        (main thread only); a second signal stops at once (Note [preemption])."""
        if not self.save_on_signal or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._flag:
                raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
            self._flag = True
            self._signum = signum

        old = {s: signal.signal(s, handler) for s in SIGNALS}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _resume_command() -> str:
    argv, skip = [], False
    for a in sys.argv[1:]:  # the same command, its --resume replaced
        if skip or a == "--resume" or a.startswith("--resume="):
            skip = a == "--resume"
            continue
        argv.append(a)
    job = f"-m infinity.train {' '.join(argv + ['--resume', 'auto'])}"
    ranks, here = int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("LOCAL_WORLD_SIZE")
    if ranks <= 1:
        return f"python {job}"
    if here is not None and int(here) == ranks:  # one node: torchrun's command for it
        return f"torchrun --nproc-per-node {ranks} {job}"
    return f"the launcher's command for the same {ranks} ranks, each running {job}"


def _stopped_text(signal_name: Optional[str], step: int, path: Optional[str]) -> str:
    if path is None:
        return f"infinity.train: stopped by {signal_name or 'a signal'} after step {step}; no --output-dir, nothing saved"
    return (f"infinity.train: stopped by {signal_name or 'a signal'} after step {step}; saved {path}. Resume with: "
            f"{_resume_command()}")


def interrupted_text(checkpoints: Optional[TrainCheckpoints], signal_name: str, step: int) -> str:
    """What a job stopped at once by a signal says (Note [preemption]): nothing saved, and the
    checkpoint to resume from, if any."""
    where = f"in step {step}" if step else "before its first step"
    text = f"infinity.train: stopped by {signal_name} {where}, without saving"
    if checkpoints is None or not checkpoints.save_on_signal:
        text += " (--save-on-signal saves a checkpoint at the step's end instead)"
    directory = checkpoints.directory if checkpoints is not None else None
    done = complete_checkpoints(directory) if directory else []
    if directory and not done and checkpoints is not None and checkpoints.save_every:
        return text + f"; no checkpoint is complete yet (--save-every {checkpoints.save_every}: none before that step)"
    if not directory or not done:
        return text + "; no checkpoint was saved (--save-every N saves one every N steps)"
    return (f"{text}; the last complete checkpoint is {os.path.join(directory, done[-1][1])}. "
            f"Resume with: {_resume_command()}")
