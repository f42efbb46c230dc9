"""Every error infinity raises on purpose derives from ``InfinityError``.

Each class also derives from the builtin exception a caller would expect (a bad argument is
a ``ValueError``, an I/O failure an ``OSError``, ...), so ``except ValueError`` keeps working
while ``except infinity.InfinityError`` catches everything infinity raises deliberately.
The messages say what happened and what to change. Every error a guide names is importable
from here, whichever module raises it.
"""
from __future__ import annotations

from typing import Union

import torch


class InfinityError(Exception):
    """Base of every error infinity raises on purpose."""


class UsageError(InfinityError, ValueError):
    """A value passed to infinity is not valid; the message says which and what to pass."""


class ConfigError(UsageError):
    """Every problem found in a config, each as ``(key path, message)``."""

    def __init__(self, problems: Union[str, list]):
        if isinstance(problems, str):
            problems = [("", problems)]
        self.problems: list[tuple[str, str]] = list(problems)
        super().__init__(_format_problems(self.problems))

    @property
    def keys(self) -> list[str]:
        """The key paths the problems are about."""
        return [key for key, _ in self.problems if key]


def _format_problems(problems: list) -> str:
    lines = [f"{key}: {msg}" if key else msg for key, msg in problems]
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems in the config:\n" + "\n".join(f"  - {line}" for line in lines)


class UsageTypeError(InfinityError, TypeError):
    """An argument of the wrong kind (a module where parameters are expected, ...)."""


class EngineError(InfinityError, RuntimeError):
    """The model or its use does not fit the engine (e.g. ranks built different models)."""


class InvariantError(InfinityError, AssertionError):
    """An internal invariant broke: a bug in infinity, or state changed behind its back."""


class ParameterNotAvailableError(InfinityError, RuntimeError):
    """A partitioned parameter was used while only its shard exists."""


class InsufficientResourcesError(InfinityError, RuntimeError):
    """A tier has no room for what the plan needs (checked before allocating)."""


class WaitTimeout(InfinityError, TimeoutError):
    """Waited too long for the overlapped optimizer step or for I/O to land."""


class StorageError(InfinityError, OSError):
    """A file of infinity's could not be created, reserved or accessed (errno kept)."""


class OutOfMemory(InfinityError, MemoryError):
    """An allocation of infinity's own did not fit."""


class DeviceOutOfMemory(OutOfMemory, torch.OutOfMemoryError):
    """The engine's own device allocations would exceed the configured budget: a
    ``torch.OutOfMemoryError`` too, as CUDA's, so ``except torch.OutOfMemoryError`` catches
    both (Note [device budget] in _runtime/_accelerator/__init__.py on what retry loops make of it)."""


class CommTimeout(InfinityError, RuntimeError):
    """A collective did not finish in time; the message names what it was moving."""


class JobStopped(CommTimeout):
    """A rank stopped the job (Note [one rank failing] in _runtime/_comm.py); the message names it and why."""


class ParamGroupError(UsageError):
    """The parameter groups given to ``infinity.initialize`` do not describe the model."""


class NativeLibraryMissing(InfinityError, ImportError):
    """A native library of infinity's was not built; the message says how to build it."""


class NotSupportedError(InfinityError, NotImplementedError):
    """A torch API that infinity cannot honour faithfully; the message says what to use."""


class NonFiniteError(InfinityError, FloatingPointError):
    """A step's loss or gradients are inf/NaN (``precision.on_nonfinite: error``)."""


class TiledWeightError(InfinityError, AttributeError):
    """The whole ``weight`` of a tiled module was asked for; it exists only as tiles (an
    AttributeError, so ``hasattr`` and ``getattr(m, "weight", None)`` keep working)."""


class TokenIdError(InfinityError, IndexError):
    """A token id outside a tiled embedding's vocabulary (an IndexError, like nn.Embedding's)."""


# The apps' own (the train job's and the estimator's), raised from infinity._apps.


class TrainError(UsageError):
    """Bad input to the train job; the message says what to change."""


class DataError(UsageError):
    """A data file or tokenizer problem; the message says what to change."""


class EstimateError(UsageError):
    """Bad input to the estimator; the message says what to change."""
