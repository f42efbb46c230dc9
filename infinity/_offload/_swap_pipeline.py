"""The NVMe optimizer store's swap pipeline: the chunks past the host cache streamed through
SETS buffer sets, reads ahead and write-backs behind the chunk being updated (Note [optimizer
swapper] and Note [phased swap I/O] in _nvme_optimizer_store.py).
"""

from __future__ import annotations

import enum
import functools
from typing import Callable, List, Optional

import torch

from ..aio import aligned_empty
from ..aio._handle import close_handles
from ..aio._memory import release_pages
from ._memory_plan import OPT_BUFFERS
from ._optimizer_files import NAMES, STATES, OptimizerFiles
from ._optimizer_store import Chunk
from ._swap import new_aio

WithGrad = Callable[[dict, int, int], dict]  # a chunk's arrays, its gradients put where they live
BLOCK_ELEMS = 1024  # fp32 elements per 4 KiB block of a swap file


def written_spans(offset: int, numel: int, changed) -> List[tuple]:
    """Note [unchanged ranges are not written]: the step rewrites a chunk's master weights and
    moments only where it changed them. A parameter that got no gradient on any rank is left
    out of the step's plan (Note [update plan] in _param_groups.py), so its states in the
    buffers are the bytes read from the file; writing them back would spend the SSD's
    endurance on nothing (Note [endurance budget] in _apps/_endurance.py). The update function
    says which (start, end) ranges it changed (``Chunk.changed``; None: all); each is widened
    to whole 4 KiB blocks of the file (the sums of a swap file are kept per block, Note [swap
    checksums] in _checksum.py), clamped to the chunk, and neighbours merged. A compressed moment's record
    covers its chunk, so it is written whole or, where nothing changed, not at all."""
    end = offset + numel
    if changed is None:
        return [(offset, end)] if numel else []
    out: List[list] = []
    for lo, hi in sorted(changed):
        lo, hi = max(offset, lo // BLOCK_ELEMS * BLOCK_ELEMS), min(end, -(-hi // BLOCK_ELEMS) * BLOCK_ELEMS)
        if lo >= hi:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class TailState(enum.Enum):
    """Whether the first tail chunks' reads are in flight (``update_head`` starts them so that
    they land while it computes; ``update_tail`` consumes them)."""

    IDLE = "idle"
    PRIMED = "primed"


class SwapPipeline:
    """SETS buffer sets, each with a read and a write handle: while chunk k is updated on the
    CPU, the reads of chunks k+1 .. k+SETS-2 and the write-back of chunk k-1 are in flight."""

    SETS = 3

    def __init__(self, files: OptimizerFiles, head: int, aio_cfg, *, phased: bool, grads_in_memory: bool):
        self.files = files
        self.head = head  # the tail starts here
        self.phased = phased  # reads and writes take turns (Note [phased swap I/O] in _nvme_optimizer_store.py)
        self._grads_in_memory = grads_in_memory
        self.readers = [new_aio(aio_cfg) for _ in range(self.SETS)]
        self.writers = [new_aio(aio_cfg) for _ in range(self.SETS)]
        self.sets = [{n: aligned_empty(files.chunk, torch.float32, what=OPT_BUFFERS) for n in NAMES}
                     for _ in range(self.SETS)]
        # Note [compressed moments on disk] in _nvme_optimizer_store.py
        self.records = [files.record_set(OPT_BUFFERS) for _ in range(self.SETS)]
        self.state = TailState.IDLE

    def _starts(self) -> list:
        return list(range(self.head, self.files.total, self.files.chunk))

    def _read_chunk(self, s: int, off: int) -> None:
        n = min(self.files.chunk, self.files.total - off)
        self.files.read_arrays(self.readers[s], off, {name: t[:n] for name, t in self.sets[s].items()},
                               self.records[s], self.files.swapped)

    def prime(self) -> None:
        """Submit the reads of the first tail chunks, once per update (IDLE -> PRIMED; PRIMED stays)."""
        if self.state is TailState.PRIMED:
            return
        starts = self._starts()
        for j in range(min(self.SETS - 2, len(starts))):
            self._read_chunk(j, starts[j])
        self.state = TailState.PRIMED

    def run(self, fn: Callable[[Chunk], None], with_grad: WithGrad) -> None:
        """Update every tail chunk, in order (PRIMED or IDLE -> IDLE), and wait for the last write-back."""
        self.prime()
        starts = self._starts()
        ahead = self.SETS - 2  # chunks read ahead; one set computes, one set's writes drain
        for k, off in enumerate(starts):
            s = k % self.SETS
            self.files.wait(self.readers[s], f"reading optimizer chunk at element {off}")
            j = k + ahead
            if j < len(starts):
                if self.phased and k:
                    self._drain_writes(starts[k - 1])
                self.files.wait(self.writers[j % self.SETS], "writing back an optimizer chunk")  # held chunk j - SETS
                self._read_chunk(j % self.SETS, starts[j])
            n = min(self.files.chunk, self.files.total - off)
            bufs = with_grad({name: t[:n] for name, t in self.sets[s].items()}, off, n)
            self.files.expand(self.records[s], bufs)
            next_read = None  # phased: chunk j's reads land before this chunk's writes start
            if self.phased and j < len(starts):
                next_read = functools.partial(self.files.wait, self.readers[j % self.SETS],
                                              f"reading optimizer chunk at element {starts[j]}")
            self.update_one(fn, off, bufs, self.writers[s], self.records[s], before_writes=next_read)
        for w in self.writers:
            self.files.wait(w, "writing back optimizer chunks")
        for bufs in self.sets + self.records:  # idle until the next step (Note [released pages] in _memory.py)
            for t in bufs.values():
                release_pages(t)
        self.state = TailState.IDLE

    def _drain_writes(self, off: int) -> None:
        """Note [phased swap I/O] in _nvme_optimizer_store.py: every write of the chunk at ``off`` has landed, the master
        weights' (written by the parameter store) included."""
        for w in self.writers:
            self.files.wait(w, "writing back optimizer chunks")
        self.files.master_landed(off, min(self.files.chunk, self.files.total - off))

    def update_one(self, fn: Callable[[Chunk], None], off: int, bufs: dict, writer, records: dict,
                   cached: bool = False, before_writes: Optional[Callable[[], None]] = None,
                   owned: bool = False) -> None:
        """``fn`` on one chunk, then its states written back through ``writer`` (a cached chunk:
        written through, its memory kept equal to the file: Note [host cache] in _nvme_optimizer_store.py;
        ``owned``, in the host share of a split, written nowhere: Note [split tiers] in _split.py)."""
        chunk = Chunk(off, bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"])
        fn(chunk)
        if before_writes is not None:
            before_writes()
        if self._grads_in_memory or cached:
            release_pages(bufs["grad"])  # consumed: idle until backward writes it again (Note [released pages] in _memory.py)
        spans = written_spans(off, bufs["master"].numel(), chunk.changed)
        for name in STATES:
            if name == "master" and self.files.master_shared:
                continue  # fn handed them to the parameter store, which writes them
            if name not in self.files.packed:
                for lo, hi in [] if owned else spans:
                    self.files.write(writer, name, lo, bufs[name][lo - off : hi - off])
                continue
            if not spans:
                continue  # a record is written whole or not at all
            rec = self.files.encode(name, bufs[name], records)
            if cached:  # the cache holds what the file holds (Note [host cache] in _nvme_optimizer_store.py)
                self.files.decode(name, rec, bufs[name])
            if not owned:  # the host share computes as the files' do (Note [split tiers] in _split.py)
                self.files.write(writer, name, off, rec)

    def reset(self) -> None:
        """Any -> IDLE after a failed update (Note [failed step] in _step_gate.py): every read
        and write in flight drained; the next update reads its chunks afresh."""
        for handle in self.readers + self.writers:
            self.files.drain(handle, "a failed update's optimizer chunks")
        self.state = TailState.IDLE

    def close(self) -> None:
        close_handles([*self.readers, *self.writers])
        self.sets, self.records = [], []  # Note [closed engines] in _engine.py
