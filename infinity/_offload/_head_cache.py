"""The NVMe optimizer store's host cache: the first chunks of the flat space in host memory
(Note [host cache] in _nvme_optimizer_store.py), their state one enum moved by named
transitions.
"""

from __future__ import annotations

import enum
from typing import Iterator, Optional, Tuple

from ..aio._handle import close_handles
from ..aio._memory import release_pages
from ..errors import InvariantError
from ._memory_plan import OPT_HOST_CACHE, OPT_STATES
from ._optimizer_files import STATES, OptimizerFiles
from ._optimizer_store import zeros_host
from ._swap import new_aio


class HeadState(enum.Enum):
    """Where the cached chunks' master weights and moments are. Their gradient shards (when
    not in host memory altogether) live in the cache in every state: the files never hold them."""

    EMPTY = "empty"  # not in memory: never read, given back through the activation peak, or the files rewritten
    READING = "reading"  # their reads are in flight on the cache's handle
    LOADED = "loaded"  # in memory, equal to the files once the write-through has landed


class HeadCache:
    """``head`` elements (whole chunks) of master weights, moments and gradient shards in host
    memory, written through to the files by the update; the chunks below the files' ``base``
    (the host share of a split, Note [split tiers] in _split.py) are the only copy: never
    read, written or given back, whatever the state, which describes the chunks after them. Transitions: ``start_reads`` (EMPTY
    -> READING), ``land`` (READING or LOADED -> LOADED), ``release`` (LOADED -> EMPTY, pages
    given back), ``invalidate`` (any -> EMPTY: the files were rewritten), ``forget`` (any ->
    EMPTY: an update failed); each raises InvariantError in a state it does not start from."""

    def __init__(self, files: OptimizerFiles, head: int, aio_cfg):
        self.files = files
        self.head = head
        self.owned = files.base  # elements in host memory only
        # zeros: the gaps between aligned unit ranges must read as zero gradients
        what = [OPT_STATES if i * files.chunk < files.base else OPT_HOST_CACHE for i in range(head // files.chunk)]
        self.sets = [{n: zeros_host(files.chunk, w) for n in files.swapped} for w in what]
        # Note [compressed moments on disk] in _nvme_optimizer_store.py
        self.records = [files.record_set(w) for w in what]
        self.io = new_aio(aio_cfg)
        self.state = HeadState.EMPTY

    def _expect(self, transition: str, *states: HeadState) -> None:
        if self.state not in states:
            raise InvariantError(f"host cache: {transition} in state {self.state.name} (expects "
                                 f"{' or '.join(s.name for s in states)})")

    def start_reads(self) -> None:
        """Submit the reads of the cached chunks' master weights and moments."""
        self._expect("start_reads", HeadState.EMPTY)
        for i, (off, bufs) in enumerate(self.chunks()):
            if off >= self.owned:
                self.files.read_arrays(self.io, off, bufs, self.records[i], STATES)
        self.state = HeadState.READING

    def land(self) -> None:
        """Wait for the cache's reads (and its last write-back); compressed moments expanded."""
        self._expect("land", HeadState.READING, HeadState.LOADED)
        self.files.wait(self.io, "reading the cached optimizer chunks")
        if self.state is HeadState.READING:
            for i, (off, bufs) in enumerate(self.chunks()):
                if off >= self.owned:
                    self.files.expand(self.records[i], bufs)
            self.state = HeadState.LOADED

    def release(self) -> None:
        """Give the master weights' and moments' pages back once their write-through has
        landed (Note [released pages] in aio/_memory.py); read again before the next update."""
        self._expect("release", HeadState.LOADED)
        self.files.wait(self.io, "writing back the cached optimizer chunks")
        first = self.owned // self.files.chunk
        for hs, recs in zip(self.sets[first:], self.records[first:]):
            for t in [hs[n] for n in STATES] + list(recs.values()):
                release_pages(t)
        self.state = HeadState.EMPTY

    def invalidate(self) -> None:
        """The files were rewritten (master weights loaded, a checkpoint): the next update reads them afresh."""
        self.files.wait(self.io, "writing back the cached optimizer chunks")
        self.state = HeadState.EMPTY

    def forget(self) -> None:
        """Any -> EMPTY after a failed update (Note [failed step] in _step_gate.py): its reads
        and write-backs in flight drained; the next update reads the files afresh."""
        self.files.drain(self.io, "a failed update's cached optimizer chunks")
        self.state = HeadState.EMPTY

    def wait(self, what: str = "writing back the cached optimizer chunks") -> None:
        self.files.wait(self.io, what)

    def chunks(self, lo: int = 0, hi: Optional[int] = None) -> Iterator[Tuple[int, dict]]:
        """(offset, the cached arrays cut to the chunk's length) of every cached chunk (those
        starting in [lo, hi) only, if given)."""
        chunk, total = self.files.chunk, self.files.total
        for i, hs in enumerate(self.sets):
            off = i * chunk
            if lo <= off < (self.head if hi is None else hi):
                yield off, {name: t[:min(chunk, total - off)] for name, t in hs.items()}

    def owned_pieces(self, offset: int, numel: int, name: str):
        """(view of the cached ``name`` array, start in the range) of the part of
        [offset, offset + numel) held in host memory only."""
        end = min(offset + numel, self.owned)
        for hs, lo, n, at in self.pieces(offset, max(0, end - offset)):
            yield hs[name][lo : lo + n], at

    def pieces(self, offset: int, numel: int):
        """(cached set, start in its chunk, length, start in the range) of the part of
        [offset, offset + numel) inside the head, which is always a prefix of the range."""
        end = min(offset + numel, self.head)
        pos = offset
        while pos < end:
            i, lo = divmod(pos, self.files.chunk)
            n = min(self.files.chunk - lo, end - pos)
            yield self.sets[i], lo, n, pos - offset
            pos += n

    def within(self, offset: int, numel: int) -> int:
        """Elements of [offset, offset + numel) inside the head."""
        return max(0, min(offset + numel, self.head) - offset)

    def close(self) -> None:
        """Close the handle; the memory goes now (Note [closed engines] in _engine.py)."""
        close_handles([self.io])
        self.sets, self.records, self.head = [], [], 0
