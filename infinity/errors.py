"""Every error infinity raises on purpose derives from ``InfinityError``.

Each class also derives from the builtin exception a caller would expect (a bad argument is
a ``ValueError``, an I/O failure an ``OSError``, ...), so ``except ValueError`` keeps working
while ``except infinity.InfinityError`` catches everything infinity raises deliberately.
The messages say what happened and what to change.
"""
from __future__ import annotations


class InfinityError(Exception):
    """Base of every error infinity raises on purpose."""


class UsageError(InfinityError, ValueError):
    """A value passed to infinity is not valid; the message says which and what to pass."""


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
