"""The fence between an asynchronous checkpoint save and the writes of the next steps.

Note [save fence]: ``save_checkpoint(..., blocking=False)`` snapshots every state at the call:
host states are staged (copied in memory), NVMe states cloned where the filesystem shares
extents. A swap file that cannot be cloned is copied in the background instead, and until that
copy is done the engine must not rewrite it: the fence is held from the call until the copy
ends, and everything that writes the stores' states waits for it first (the optimizer's step,
an edit under ``GatheredParameters`` re-partitioned by the engine). Forward and backward run
meanwhile (they only read those files; gradient shards have files of their own). The fence also
keeps the pending save, so that ``Engine.close`` waits for it and raises its error (Note
[asynchronous saves] in _checkpoint/_async.py). A wait on the fence ends after ``timeout``
seconds with WaitTimeout, as every wait does (Note [comm timeout] in _comm.py).
"""
from __future__ import annotations

import threading
from typing import Optional, Protocol

from ..errors import WaitTimeout


class PendingSave(Protocol):
    def wait(self, timeout: Optional[float] = None) -> str: ...


class SaveFence:
    def __init__(self):
        self._free = threading.Event()
        self._free.set()
        self.pending: Optional[PendingSave] = None  # the save in flight, until someone waits for it

    def hold(self, pending: PendingSave) -> None:
        """A save started that still reads the swap files: writes wait from now on."""
        self.pending = pending
        self._free.clear()

    def release(self) -> None:
        """The save no longer reads the swap files (done, or failed)."""
        self._free.set()

    def wait_writes(self, timeout: Optional[float]) -> None:
        """Return once the stores' states may be rewritten."""
        if not self._free.wait(timeout):
            raise WaitTimeout(f"the step waited {timeout:.0f} s for an asynchronous checkpoint save to finish "
                              f"copying the swap files (a hung disk?)")

    def finish(self, timeout: Optional[float] = None) -> None:
        """Wait for the save in flight, if any; raises its error."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait(timeout)
