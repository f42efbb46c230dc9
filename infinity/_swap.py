"""Swap files on the NVMe tier: one directory per run and rank, removed on clean exit.

Note [swap directories]: every engine writes under ``<nvme_path>/infinity-<run id>/rank<r>``
with a fresh random run id, so a second run on the same ``nvme_path`` never reads the files
of a first (crashed or concurrent) one. The directory is removed when the engine is garbage
collected or the interpreter exits normally; a crashed run leaves it behind, and the name
says which run it belonged to.
"""
from __future__ import annotations

import os
import shutil
import uuid
import weakref
from typing import Optional

import torch

from .errors import StorageError, UsageError


class SwapDir:
    def __init__(self, nvme_path: str, rank: int, run_id: Optional[str] = None):
        if not nvme_path:
            raise UsageError("NVMe offload needs nvme_path: set zero.offload_param.nvme_path / "
                             "zero.offload_optimizer.nvme_path to a directory on a fast local disk")
        os.makedirs(nvme_path, exist_ok=True)
        self.rank = rank
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.path = os.path.join(os.path.abspath(nvme_path), f"infinity-{self.run_id}", f"rank{rank}")
        os.makedirs(self.path, exist_ok=False)
        self._finalizer = weakref.finalize(self, _remove, os.path.dirname(self.path), self.path)

    def file(self, name: str, nbytes: int) -> str:
        """Create (preallocated to ``nbytes``) and return the path of a swap file."""
        path = os.path.join(self.path, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    raise StorageError(e.errno, f"cannot reserve {nbytes} bytes for swap file {path}: {e.strerror}; "
                                           f"free space under the nvme_path or point it at a larger disk") from e
        finally:
            os.close(fd)
        return path

    def remove(self) -> None:
        self._finalizer()


def _remove(run_dir: str, rank_dir: str) -> None:
    shutil.rmtree(rank_dir, ignore_errors=True)
    try:
        os.rmdir(run_dir)  # the last rank out removes the run directory
    except OSError:
        pass


def new_aio(cfg, *, backend: Optional[str] = None):
    """An AsyncIO handle configured from the ``aio`` config section."""
    from .aio import AsyncIO

    return AsyncIO(block_size=cfg.block_size, queue_depth=cfg.queue_depth, threads=cfg.threads,
                   direct=cfg.direct, backend=backend or cfg.backend)


def wait_io(handle, what: str) -> None:
    """Wait for a handle's requests, at most the engine's wait timeout (INFINITY_COMM_TIMEOUT
    seconds); a timeout raises TimeoutError naming ``what`` and the files still in flight."""
    from ._comm import DEFAULT_TIMEOUT_S

    handle.wait(timeout=DEFAULT_TIMEOUT_S, what=what)


def nbytes_of(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()
