"""The NVMe optimizer store's gradient shards: accumulated as backward delivers them into
grad.swp, the host cache or one flat host tensor (Note [gradients in host memory] in
_nvme_optimizer_store.py), with their squared norm and finiteness.
"""

from __future__ import annotations

import enum
from typing import List, Optional

import torch

from ..aio._handle import close_handles
from ._head_cache import HeadCache
from ._memory_plan import GRADIENTS
from ._optimizer_files import OptimizerFiles
from ._optimizer_store import sq_and_finite, zeros_host
from ._swap import new_aio


class GradStats(enum.Enum):
    """How ``grad_stats`` knows the squared norm and finiteness of the gradients (Note
    [optimizer swapper] in _nvme_optimizer_store.py)."""

    FOLDED = "folded"  # summed as each range's final value was written: one micro-batch per step so far
    READ_PASS = "read pass"  # a range was accumulated again (or several micro-batches): measured by reading them


class GradShards:
    """Where the sink's gradient shards accumulate. A range's first gradient of the step
    overwrites, later ones add; ``finalize`` zeroes the ranges that got none. Writes to
    grad.swp run on their own handles (accumulation is on the main thread while an
    overlapped step may use the step's). ``scratch``: one chunk's buffer the read pass
    borrows (a buffer set's gradient array: ``grad_stats`` runs with no step in flight)."""

    def __init__(self, files: OptimizerFiles, cache: HeadCache, ranges: List[tuple], *, in_memory: bool,
                 accumulation_steps: int, aio_cfg, scratch: torch.Tensor):
        self.files, self.cache = files, cache
        self.ranges = ranges  # (offset, numel) of every unit's shard in the flat space
        self.mem: Optional[torch.Tensor] = zeros_host(files.total, GRADIENTS) if in_memory else None
        self.reader, self.writer = new_aio(aio_cfg), new_aio(aio_cfg)
        self._scratch = scratch
        self._accumulation_steps = accumulation_steps
        self._written: set = set()  # offsets of ranges accumulated since the last step
        self.zero()

    def zero(self) -> None:
        """Forget the gradients accumulated so far: the next accumulation overwrites instead of adding."""
        self.wait_writes()
        self._written.clear()
        self._sq, self._finite = 0.0, True
        self.stats = GradStats.FOLDED if self._accumulation_steps == 1 else GradStats.READ_PASS

    def wait_writes(self) -> None:
        self.files.wait(self.writer, "gradient shard writes")

    def _read(self, offset: int, out: torch.Tensor) -> None:
        self.reader.pread(out, self.files.paths["grad"], self.files.byte_offset("grad", offset))
        self.files.wait(self.reader, f"reading gradient shards at element {offset}")
        self.files.io["grad"][0] += out.numel() * 4

    def _write(self, offset: int, values: torch.Tensor) -> None:
        # the handle keeps values alive
        self.writer.pwrite(values, self.files.paths["grad"], self.files.byte_offset("grad", offset))
        self.files.io["grad"][1] += values.numel() * 4

    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        g = shard_grad.mul(scale) if scale != 1.0 else shard_grad.contiguous()
        again = offset in self._written
        if again:
            self.stats = GradStats.READ_PASS
        else:
            self._written.add(offset)
        if self.stats is GradStats.FOLDED:
            s, f = sq_and_finite(g)
            self._sq += s
            self._finite = self._finite and f
        if self.mem is not None:  # Note [gradients in host memory] in _nvme_optimizer_store.py
            _put(self.mem[offset : offset + g.numel()], g, again)
            return
        # Note [host cache] in _nvme_optimizer_store.py: in memory only
        for hs, lo, n, at in self.cache.pieces(offset, g.numel()):
            _put(hs["grad"][lo : lo + n], g[at : at + n], again)
        h = self.cache.within(offset, g.numel())
        if h == g.numel():
            return
        g = g[h:]
        if again:
            self.wait_writes()  # the earlier write of this range must land
            old = torch.empty_like(g)
            self._read(offset + h, old)
            g = old.add_(g)
        self._write(offset + h, g)

    def finalize(self) -> None:
        """Before the step: ranges that got no gradient this step must read as zeros."""
        missing = [(o, n) for o, n in self.ranges if o not in self._written and n]
        if missing:
            zeros = torch.zeros(max(n for _, n in missing), dtype=torch.float32)
            for o, n in missing:
                self._written.add(o)
                if self.mem is not None:
                    self.mem[o : o + n].zero_()
                    continue
                for hs, lo, k, _ in self.cache.pieces(o, n):
                    hs["grad"][lo : lo + k].zero_()
                h = self.cache.within(o, n)
                if h < n:
                    self._write(o + h, zeros[: n - h])
        self.wait_writes()

    def grad_stats(self) -> tuple:
        """(squared norm, all finite) of the gradients accumulated so far."""
        if self.stats is GradStats.FOLDED:
            return self._sq, self._finite
        sq, finite = 0.0, True
        chunk, total = self.files.chunk, self.files.total
        for off in range(0, total, chunk):
            n = min(chunk, total - off)
            if self.mem is not None:
                buf = self.mem[off : off + n]
            elif off < self.cache.head:
                buf = self.cache.sets[off // chunk]["grad"][:n]
            else:
                buf = self._scratch[:n]
                self._read(off, buf)
            s, f = sq_and_finite(buf)
            sq += s
            finite = finite and f
        return sq, finite

    def with_grad(self, bufs: dict, offset: int, numel: int) -> dict:
        """A chunk's arrays, its gradients from host memory where they live there."""
        if self.mem is not None:
            bufs["grad"] = self.mem[offset : offset + numel]
        return bufs

    def close(self) -> None:
        close_handles([self.reader, self.writer])
        self.mem = None  # Note [closed engines] in _engine.py
        self._scratch = torch.empty(0)


def _put(dst: torch.Tensor, src: torch.Tensor, add: bool) -> None:
    if add:
        dst.add_(src)
    else:
        dst.copy_(src)
