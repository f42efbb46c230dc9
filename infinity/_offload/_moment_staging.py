"""The NVMe optimizer store's checkpoint staging: compressed moments expanded into fp32 files
for a checkpoint and compressed back after a load (Note [compressed moments on disk] in
_nvme_optimizer_store.py).
"""

from __future__ import annotations

from typing import Optional

from ..aio._handle import close_handles
from ..aio._stripe import unlink
from ._optimizer_files import OptimizerFiles
from ._swap import Swap, new_aio
from ._swap_pipeline import SwapPipeline


class MomentStaging:
    """One fp32 staging file per compressed moment beside the swap files (8 bytes per element
    of disk while a save or load runs), written and read chunk by chunk through buffer set 0
    of ``pipeline`` (no step is in flight around a checkpoint). The files have their own
    handle, opened when first needed: closing it lets go of the removed files' descriptors."""

    def __init__(self, files: OptimizerFiles, swap: Swap, aio_cfg, pipeline: SwapPipeline, reader):
        self.files = files
        self.swap, self._aio_cfg = swap, aio_cfg  # the staging files go beside the swap files
        self._pipeline = pipeline
        self._reader = reader  # the store's own read handle
        self.paths: dict = {}  # moment -> its staging file
        self._io = None

    def _handle(self):
        if self._io is None:
            self._io = new_aio(self._aio_cfg)
        return self._io

    def stage(self, name: str) -> str:
        """An fp32 file of the expanded moment ``name``."""
        path = self.paths.get(name) or self.swap.file(f"{name}.fp32.swp", 4 * (self.files.total - self.files.base))
        self.paths[name] = path
        records, buf = self._pipeline.records[0], self._pipeline.sets[0][name]
        for off, n in self.files.spans():
            rec = self.files.record(records, name, n)
            self.files.read(self._reader, name, off, rec)
            self.files.wait(self._reader, f"reading {name} at element {off} for a checkpoint")
            self.files.decode(name, rec, buf[:n])
            self._handle().pwrite(buf[:n], path, (off - self.files.base) * 4)
            self.files.wait(self._io, f"staging {name} at element {off} for a checkpoint")
        return path

    def compress_back(self) -> None:
        """A load rewrote the staging files: compress them into the swap files, then remove them."""
        writer = self._pipeline.writers[0]
        for name, path in self.paths.items():
            records, buf = self._pipeline.records[0], self._pipeline.sets[0][name]
            for off, n in self.files.spans():
                self._handle().pread(buf[:n], path, (off - self.files.base) * 4)
                self.files.wait(self._io, f"reading the staged {name} at element {off}")
                rec = self.files.encode(name, buf[:n], records)
                self.files.put(writer, name, off, rec)
                self.files.wait(writer, f"compressing the loaded {name} at element {off}")
        self.done()

    def done(self) -> None:
        """The checkpoint no longer needs the staging files."""
        io: Optional[object] = self._io
        if io is not None:
            close_handles([io])
            self._io = None
        for path in self.paths.values():
            unlink(path)  # every member of a striped file (Note [striped swap files] in aio/_stripe.py)
        self.paths.clear()
