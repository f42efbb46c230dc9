"""The main job: ``python -m infinity.train [--config CONFIG] [overrides]``.

Fine-tunes a GPT-style causal LM from Hugging Face ``transformers`` with ZeRO (and offload,
as the config asks) on a text or JSONL file, on any number of ranks under ``torchrun``.
With no arguments it runs an embedded default (``default_config()``): a small GPT-2 built
from a preset, a generated corpus, the byte-level tokenizer and every model state on NVMe
under the system temp dir. Rank 0 shows a progress bar, writes telemetry and the weights,
and ends with a summary table. Bad input exits with status 2 and a message saying what to
change. This module is not imported by ``infinity/__init__``.

The parts live in ``infinity/_apps/``: the command line (``_train_cli``), the model
(``_train_model``), the data (``_train_data``), the loop (``_train_loop``), the summary
(``_train_summary``) and the disk probe (``_disk_probe``); this module composes them.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import List, Optional

import torch

from ._apps._disk_probe import PROBE_BYTES, PROBE_REPS, probe_disk
from ._apps._train_cli import (
    EXIT_BAD_INPUT,
    EXIT_SIGINT,
    default_config,
    default_nvme_path,
    nvme_paths,
    parse_args,
    resolve_config,
)
from ._apps._train_data import Batches, ByteTokenizer, read_texts, token_windows
from ._apps._train_loop import Run, _loss, save, setup, start, train_loop, train_step
from ._apps._train_model import PRESETS, ModelSpec, TrainError, activation_bytes, build_model, build_partitioned
from ._apps._train_summary import finish, summary_text
from ._checkpoint._train import TrainCheckpoints, interrupted_text
from ._runtime import _comm as comm
from .config import Config
from .errors import InsufficientResourcesError, NonFiniteError, UsageError

# What callers import from infinity.train (tests and scripts among them; ``_loss`` too, for a test's own loop).
__all__ = [
    "EXIT_BAD_INPUT", "PRESETS", "PROBE_BYTES", "PROBE_REPS", "Batches", "ByteTokenizer", "ModelSpec", "Run",
    "TrainError", "_loss", "activation_bytes", "build_model", "build_partitioned", "default_config",
    "default_nvme_path", "finish", "main", "nvme_paths", "parse_args", "probe_disk", "read_texts", "resolve_config",
    "run_job", "save", "setup", "start", "summary_text", "token_windows", "train_loop", "train_step",
]


def run_job(cfg: Config, checkpoints=None) -> Optional[str]:
    """Train as ``cfg`` says, resuming and saving checkpoints as ``checkpoints`` says; return
    the summary text on rank 0 (None elsewhere)."""
    run = setup(cfg)
    run.checkpoints = checkpoints
    try:
        start(run)
        if checkpoints is not None:
            run.first_step = checkpoints.resume_into(run)
            with checkpoints.on_signals():
                train_loop(run)
            checkpoints.wait(run)  # the last asynchronous save is committed (or its error raised)
        else:
            train_loop(run)
        if checkpoints is None or checkpoints.stopped_by is None:
            save(run)
        return finish(run)
    except (KeyboardInterrupt, SystemExit) as stop:  # a signal stopped the job at once (Note [preemption] in _train.py)
        if isinstance(stop, KeyboardInterrupt) or stop.code == 128 + signal.SIGTERM:
            name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM"
            print(interrupted_text(checkpoints, name, run.step), file=sys.stderr, flush=True)
        raise
    finally:
        if run.telemetry is not None:
            run.telemetry.close()
        if run.optimizer is not None:
            run.optimizer.engine.close()  # hooks off, this run's swap files removed; an interrupt stops the step


def _exit_on_sigterm(signum, frame):
    # torchrun and job schedulers stop workers with SIGTERM: unwind so the swap files go too
    # (with --save-on-signal the loop saves first: Note [preemption] in _checkpoint/_train.py).
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    t0 = time.perf_counter()
    own = threading.current_thread() is threading.main_thread()
    caller_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm) if own else None
    finished = False
    try:
        args = parse_args(argv)
        cfg = resolve_config(args)
        checkpoints = TrainCheckpoints.from_args(args.save_every, args.resume, args.keep_last, cfg.train.output_dir,
                                                  save_async=args.save_async, save_on_signal=args.save_on_signal,
                                                  trust_pickle=args.trust_pickle)
        text = run_job(cfg, checkpoints)
        finished = True
    except (UsageError, InsufficientResourcesError) as err:  # TrainError, DataError, ConfigError among them
        print(f"infinity.train: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (NonFiniteError, comm.CommTimeout) as err:  # precision.on_nonfinite: error; a peer that died, hung or
        print(f"infinity.train: error: {err}", file=sys.stderr)  # stopped the job (JobStopped): the message says it all
        return 1
    except KeyboardInterrupt:  # said by run_job; no traceback (Note [preemption] in _checkpoint/_train.py)
        return EXIT_SIGINT
    finally:
        if comm.is_distributed():
            if finished:
                comm.barrier()  # no rank tears its sockets down while another still talks
            torch.distributed.destroy_process_group()
        if own and caller_sigterm is not None:  # a caller running the job in its process gets its handler back
            signal.signal(signal.SIGTERM, caller_sigterm)
    if text is not None:
        print(text)
        print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
