"""The optimizer states on NVMe: master weights, moments and gradient shards in swap files,
streamed through fixed-size chunks by the step (Note [optimizer swapper]), with a host cache of
the first chunks (Note [host cache]) and optionally every gradient shard in host memory (Note
[gradients in host memory]).
"""

from __future__ import annotations

import functools
import os
from typing import Callable, List, Optional

import torch

from .._runtime._log import logger
from .._runtime._tiers import Tier
from ..aio import aligned_empty
from ..aio._checksum import checksummed, sums_of
from ..aio._handle import close_handles
from ..aio._memory import release_pages
from ..errors import InvariantError
from ._memory_plan import GRADIENTS, OPT_BUFFERS, OPT_FILES, OPT_HOST_CACHE, totals
from ._moments import Codec, file_bytes, record_bytes
from ._optimizer_store import Chunk, chunk_elems, head_elems, sq_and_finite, zeros_host
from ._swap import SwapDir, new_aio, wait_io

_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad")
_SIGNED = {"exp_avg": True, "exp_avg_sq": False}



BLOCK_ELEMS = 1024  # fp32 elements per 4 KiB block of a swap file


def written_spans(offset: int, numel: int, changed) -> List[tuple]:
    """Note [unchanged ranges are not written]: the step rewrites a chunk's master weights and
    moments only where it changed them. A parameter that got no gradient on any rank is left
    out of the step's plan (Note [update plan] in _param_groups.py), so its states in the
    buffers are the bytes read from the file; writing them back would spend the SSD's
    endurance on nothing (Note [endurance budget] in _apps/_endurance.py). The update function
    says which (start, end) ranges it changed (``Chunk.changed``; None: all); each is widened
    to whole 4 KiB blocks of the file (the sums of a swap file are kept per block, Note [swap
    checksums]), clamped to the chunk, and neighbours merged. A compressed moment's record
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


class NvmeOptimizerStore:
    """Note [optimizer swapper]: the fp32 master weights, both moments and the gradient
    shards live in swap files. ``update`` walks the flat space in chunks of ``chunk``
    elements through ``SETS`` buffer sets, each with its own read and write handle: while
    chunk k is updated on the CPU, the reads of chunks k+1 .. k+SETS-2 and the write-back of
    chunk k-1 are in flight (three sets already keep a 2 GB/s disk busy both ways; a fourth
    measured no faster). Gradient shards are written as backward produces them; with
    gradient accumulation the later micro-batches read, add and write back. The squared norm and the
    finiteness of the gradients are folded in as their final values are written (one
    micro-batch per step), or measured in a read pass otherwise. Accumulation (main thread)
    and an overlapped step (its own thread) use separate I/O handles and byte counters.

    Note [gradients in host memory]: with ``grads_in_memory``
    (``zero.offload_optimizer.gradients``) every gradient shard accumulates in one flat host
    tensor instead of the swap file (and the host cache holds no gradients of its own), and
    each chunk's update uses its slice:
    4 bytes per parameter of host memory save writing every gradient during backward and
    reading it back in the step (a third of the step's disk traffic, and the time the
    backward waited for those writes). The overlapped step's ordering argument is the same
    as for the file: a unit's gradient range is consumed by its update before the unit can
    be fetched, hence before the next backward accumulates into it.

    Note [host cache]: the first ``head`` elements of the flat space (whole chunks; by
    default the first fetch unit's range, e.g. a tied embedding) also stay in host memory.
    The overlapped step cannot hand the next forward anything before it has updated that
    range, and its gradients are complete only at the very end of backward, so its disk
    round trips would all lie on the critical path. Instead its master weights and moments
    are a write-through cache (the files stay complete and authoritative; the cache is
    filled by the first update and dropped by ``load_master``), and its gradient shards
    live in memory only (the files never hold them). ``update_head`` then runs on the
    caller's thread without waiting for a single read, and ``update_tail`` streams the rest
    through the buffer sets, whose first reads ``update_head`` has already started. The
    cache stays resident with ``zero.host_allocator: cache`` or ``keep``. With ``release``
    (the default) it is not held through the activation peak: during forward
    (``release_idle``), once its write-through has landed, its master weights and moments
    give their pages back (Note [released pages] in aio/_memory.py), and their reads start
    when backward delivers its first gradient below the middle of the flat space, landing
    while backward finishes. One read of the head per step buys the head's whole size at
    the peak (463 MiB for GPT-2 124M), off the critical path. It pays only where torch's own
    freed blocks do not set the peak: with glibc's heap (``keep``) they did (GPT-2 124M on
    NVMe peaked at 3.6-3.7 GiB held or released); with the block cache bounded (Note [block
    cache] in native/host_alloc/host_alloc.cpp) the peak is the live set, and releasing the
    cache takes it from 3.2 to 2.7 GiB.
    With compressed moments (Note [compressed moments] in _moments.py) the cache holds them
    expanded to fp32, each update's values compressed and expanded again: the cache always
    equals the file, so a run computes the same whether a chunk is cached or not.

    Note [compressed moments on disk]: ``moments`` bf16/int8 keeps ``exp_avg`` and
    ``exp_avg_sq`` in their files as one record per chunk; each buffer set (and each cached
    chunk) has a record buffer per moment that the I/O reads and writes, expanded into and
    compressed from the set's fp32 arrays around the update. A checkpoint sees fp32 files:
    ``checkpoint_sources`` expands the moments into staging files beside the swap files
    (``checkpoint_done`` removes them), and after a load ``checkpoint_loaded`` compresses the
    staging files back, so checkpoints move between fp32, bf16 and int8 runs both ways."""

    SETS = 3

    def __init__(self, total: int, ranges: List[tuple], swap: SwapDir, aio_cfg, chunk: Optional[int],
                 accumulation_steps: int, host_cache: Optional[int] = None, grads_in_memory: bool = False,
                 moments: str = "fp32", release_cache: bool = False, phased: bool = False):
        self.tier = Tier.NVME
        self.total = total
        self.ranges = ranges  # (offset, numel) of every unit's shard in the flat space
        self.chunk = chunk_elems(chunk, total)
        self.head = head_elems(host_cache, ranges, self.chunk, total)  # Note [host cache]
        # Note [gradients in host memory]: every gradient shard; None = the swap file (and the head sets)
        self.grad_mem = zeros_host(total, GRADIENTS) if grads_in_memory else None
        self._swapped = _NAMES[:3] if grads_in_memory else _NAMES  # the arrays with a swap file and a head buffer
        # Note [compressed moments on disk]: the moments' records, or None for fp32 files
        self.moments = moments
        self.codec: Optional[Codec] = Codec(moments, self.chunk) if moments != "fp32" else None
        self._packed = tuple(_SIGNED) if self.codec else ()
        self.paths = {n: checksummed(swap.file(f"{n}.swp", self._file_bytes(n)), self._file_bytes(n), aio_cfg.checksums)
                      for n in self._swapped}  # Note [swap checksums] in aio/_checksum.py
        self._swap = swap
        self._staging: dict = {}  # checkpoint staging files of the expanded moments
        self._aio_cfg = aio_cfg
        self._staging_io = None  # their own handle: closing it lets go of the removed files' descriptors
        self._gen = torch.Generator().manual_seed(0x5EED + swap.rank)  # stochastic rounding's noise
        self.array_io = {n: [0, 0] for n in self._swapped}  # [read, written] bytes per swap file
        # zeros: the gaps between aligned unit ranges must read as zero gradients
        self.head_sets = [{n: zeros_host(self.chunk, OPT_HOST_CACHE) for n in self._swapped}
                          for _ in range(self.head // self.chunk)]
        self.head_io = new_aio(aio_cfg)
        self._head = "empty"  # the head sets' master weights and moments: empty, reading or loaded (Note [host cache])
        self._release_cache = release_cache  # give them back through the activation peak (Note [host cache])
        self._phased = phased  # reads and writes take turns (Note [phased swap I/O])
        self._reload_below = total // 2  # a gradient below this offset starts the head's reads (Note [host cache])
        self._tail_primed = False  # the first tail chunks' reads are in flight
        self.reader = new_aio(aio_cfg)
        self.readers = [new_aio(aio_cfg) for _ in range(self.SETS)]  # a read and a write handle per set
        self.writers = [new_aio(aio_cfg) for _ in range(self.SETS)]
        self.grad_reader = new_aio(aio_cfg)
        self.grad_writer = new_aio(aio_cfg)
        self.sets = [{n: aligned_empty(self.chunk, torch.float32, what=OPT_BUFFERS) for n in _NAMES} for _ in range(self.SETS)]
        self.records = [self._record_set(OPT_BUFFERS) for _ in range(self.SETS)]  # Note [compressed moments on disk]
        self.head_records = [self._record_set(OPT_HOST_CACHE) for _ in self.head_sets]
        self.accumulation_steps = accumulation_steps
        self.rank = swap.rank
        self._written: set = set()  # offsets of gradient ranges written since the last step
        self._sq, self._finite, self._stats_valid = 0.0, True, accumulation_steps == 1
        self._io = {"step": [0, 0], "grad": [0, 0]}  # [read, written] bytes by the step's and the grads' handles
        self._coef = 1.0  # the gradients' scale (unscaling and clipping), applied inside the next update
        self._master_writer = None  # the parameter store that writes the step's master weights, if any
        self._zero_files()
        # What trades host memory for disk traffic, said once (Note [host cache], [gradients in host memory])
        logger.info("optimizer states on NVMe: host cache of the first %d elements (%.0f MiB; "
                    "zero.offload_optimizer.host_cache: %s), gradient shards in %s (%.0f MiB of host memory), "
                    "buffer sets %.0f MiB", self.head, 4 * len(self._swapped) * self.head / 2**20,
                    "auto" if host_cache is None else host_cache,
                    "host memory" if grads_in_memory else "a swap file", 4 * total * grads_in_memory / 2**20,
                    self.SETS * 4 * len(_NAMES) * self.chunk / 2**20)

    @property
    def _code(self) -> Codec:
        """The moments' codec: reached only for the packed arrays (Note [compressed moments on disk])."""
        if self.codec is None:
            raise InvariantError("compressed-moment record used with fp32 moments")
        return self.codec

    def master_written_by(self, param_store) -> None:
        """Note [parameters from the master] in _placement.py: the parameter tier shares
        master.swp and writes the step's master weights (its hand-off); the step writes only
        the moments. Readers of the file wait for that store's writes too."""
        self._master_writer = param_store

    def count_master_write(self, nbytes: int) -> None:
        """The parameter store wrote ``nbytes`` of master.swp for the step (Note [parameters from the master])."""
        self._io["step"][1] += nbytes
        self.array_io["master"][1] += nbytes

    def _master_landed(self) -> None:
        self._wait(self.head_io, "writing back the cached optimizer chunks")
        if self._master_writer is not None:
            self._master_writer.flush()

    @property
    def bytes_read(self) -> int:
        return sum(r for r, _ in self._io.values())

    @property
    def bytes_written(self) -> int:
        return sum(w for _, w in self._io.values())

    def _file_bytes(self, name: str) -> int:
        return file_bytes(self.moments if name in self._packed else "fp32", self.total, self.chunk)

    def _record_set(self, what: str) -> dict:
        return {n: aligned_empty(self._code.record, torch.uint8, what=what) for n in self._packed}

    def _byte_offset(self, name: str, offset: int) -> int:
        """Where element ``offset`` (a chunk's start, for a compressed moment) is in its file."""
        if name in self._packed:
            return offset // self.chunk * self._code.record
        return offset * 4

    def element_of(self, name: str, byte_offset: int) -> int:
        """The element at ``byte_offset`` of a swap file (the chunk's first, for a compressed moment)."""
        if name in self._packed:
            return byte_offset // self._code.record * self.chunk
        return byte_offset // 4

    def _zero_files(self) -> None:
        zeros = self.sets[0]["grad"].zero_()
        for name in (n for n in self._swapped if n != "master"):
            for off in range(0, self.total, self.chunk):
                n = min(self.chunk, self.total - off)
                self._put(self.writers[0], name, off, zeros.view(torch.uint8)[: self._code.length(n)]
                          if name in self._packed else zeros[:n])
        self._wait(self.writers[0], "zero-filling the optimizer swap files")

    # -------------------------------------------------------------- I/O helpers

    def _wait(self, handle, what: str) -> None:
        wait_io(handle, f"{what} (optimizer swapper, rank {self.rank})")

    def _read(self, handle, name: str, offset: int, out: torch.Tensor) -> None:
        handle.pread(out, self.paths[name], self._byte_offset(name, offset))
        nbytes = out.numel() * out.element_size()
        self._io["step"][0] += nbytes
        self.array_io[name][0] += nbytes

    def _write(self, handle, name: str, offset: int, values: torch.Tensor) -> None:
        self._put(handle, name, offset, values)
        self._io["step"][1] += values.numel() * values.element_size()

    def _put(self, handle, name: str, offset: int, values: torch.Tensor) -> None:
        handle.pwrite(values, self.paths[name], self._byte_offset(name, offset))
        self.array_io[name][1] += values.numel() * values.element_size()

    def _grad_read(self, offset: int, out: torch.Tensor) -> None:
        self.grad_reader.pread(out, self.paths["grad"], offset * 4)
        self._wait(self.grad_reader, f"reading gradient shards at element {offset}")
        self._io["grad"][0] += out.numel() * 4

    def _grad_write(self, offset: int, values: torch.Tensor) -> None:
        self.grad_writer.pwrite(values, self.paths["grad"], offset * 4)
        self._io["grad"][1] += values.numel() * 4

    def load_master(self, offset: int, values: torch.Tensor) -> None:
        self._master_landed()  # older values must land first
        buf = values.contiguous().to(torch.float32)
        self._write(self.writers[0], "master", offset, buf)
        self._wait(self.writers[0], f"writing master weights at element {offset}")
        if offset < self.head:
            self._head = "empty"  # the next update reads the cache afresh (Note [host cache])

    def read_master(self, offset: int, numel: int) -> torch.Tensor:
        self._master_landed()  # the files are then complete
        out = torch.empty(numel, dtype=torch.float32)
        self._read(self.reader, "master", offset, out)
        self._wait(self.reader, f"reading master weights at element {offset}")
        return out

    def checkpoint_sources(self) -> dict:
        """The swap files of the master weights and moments, complete once the host cache's
        write-through has landed (Note [host cache]) and so have the parameter store's writes of
        the master (Note [parameters from the master] in _placement.py), for a checkpoint;
        compressed moments expanded into fp32 staging files (Note [compressed moments on disk])."""
        self._master_landed()
        out = {name: self.paths[name] for name in _NAMES[:3]}
        for name in self._packed:
            out[name] = self._stage(name)
        return out

    def checkpoint_loaded(self) -> None:
        """A checkpoint rewrote the files (compressed moments: their staging files, now
        compressed back into the swap files): the host cache reads them afresh."""
        for name, path in self._staging.items():
            rec, buf = self.records[0][name], self.sets[0][name]
            for off in range(0, self.total, self.chunk):
                n = min(self.chunk, self.total - off)
                self._staging_handle().pread(buf[:n], path, off * 4)
                self._wait(self._staging_io, f"reading the staged {name} at element {off}")
                self._code.encode(buf[:n], rec[: self._code.length(n)], _SIGNED[name], self._gen)
                self._put(self.writers[0], name, off, rec[: self._code.length(n)])
                self._wait(self.writers[0], f"compressing the loaded {name} at element {off}")
        self.checkpoint_done()
        self._head = "empty"

    def checkpoint_done(self) -> None:
        """The checkpoint no longer needs the staging files."""
        if self._staging_io is not None:
            close_handles([self._staging_io])
            self._staging_io = None
        for path in self._staging.values():
            os.unlink(path)
        self._staging.clear()

    def _staging_handle(self):
        if self._staging_io is None:
            self._staging_io = new_aio(self._aio_cfg)
        return self._staging_io

    def _stage(self, name: str) -> str:
        """An fp32 file of the expanded moment ``name``, chunk by chunk through buffer set 0."""
        path = self._staging.get(name) or self._swap.file(f"{name}.fp32.swp", 4 * self.total)
        self._staging[name] = path
        rec, buf = self.records[0][name], self.sets[0][name]
        for off in range(0, self.total, self.chunk):
            n = min(self.chunk, self.total - off)
            self._read(self.reader, name, off, rec[: self._code.length(n)])
            self._wait(self.reader, f"reading {name} at element {off} for a checkpoint")
            self._code.decode(rec[: self._code.length(n)], buf[:n], _SIGNED[name])
            self._staging_handle().pwrite(buf[:n], path, off * 4)
            self._wait(self._staging_io, f"staging {name} at element {off} for a checkpoint")
        return path

    def _head_pieces(self, offset: int, numel: int):
        """(head set, start in its chunk, length, start in the range) of the part of
        [offset, offset + numel) inside the head, which is always a prefix of the range."""
        end = min(offset + numel, self.head)
        pos = offset
        while pos < end:
            i, lo = divmod(pos, self.chunk)
            n = min(self.chunk - lo, end - pos)
            yield self.head_sets[i], lo, n, pos - offset
            pos += n

    def _in_head(self, offset: int, numel: int) -> int:
        """Elements of [offset, offset + numel) inside the head."""
        return max(0, min(offset + numel, self.head) - offset)

    # -------------------------------------------------------------- gradients

    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        if self._head == "empty" and self.head_sets and offset < self._reload_below:
            self._read_head()  # backward is past its peak: the head's reads land while it finishes
        g = shard_grad.mul(scale) if scale != 1.0 else shard_grad.contiguous()
        again = offset in self._written
        if again:
            self._stats_valid = False
        else:
            self._written.add(offset)
        if self._stats_valid:
            s, f = sq_and_finite(g)
            self._sq += s
            self._finite = self._finite and f
        if self.grad_mem is not None:  # Note [gradients in host memory]
            dst = self.grad_mem[offset : offset + g.numel()]
            if again:
                dst.add_(g)
            else:
                dst.copy_(g)
            return
        for hs, lo, n, at in self._head_pieces(offset, g.numel()):  # Note [host cache]: in memory only
            dst, src = hs["grad"][lo : lo + n], g[at : at + n]
            if again:
                dst.add_(src)
            else:
                dst.copy_(src)
        h = self._in_head(offset, g.numel())
        if h == g.numel():
            return
        g = g[h:]
        if again:
            self._wait(self.grad_writer, "gradient shard writes")  # the earlier write of this range must land
            old = torch.empty_like(g)
            self._grad_read(offset + h, old)
            g = old.add_(g)
        self._grad_write(offset + h, g)  # the handle keeps g alive until written

    def wait_grad_writes(self) -> None:
        """Gradient buffers handed to ``accumulate`` may be reused once this returns."""
        self._wait(self.grad_writer, "gradient shard writes")

    def finalize_grads(self) -> None:
        """Before the step: ranges that got no gradient this step must read as zeros."""
        missing = [(o, n) for o, n in self.ranges if o not in self._written and n]
        if missing:
            zeros = torch.zeros(max(n for _, n in missing), dtype=torch.float32)
            for o, n in missing:
                self._written.add(o)
                if self.grad_mem is not None:
                    self.grad_mem[o : o + n].zero_()
                    continue
                for hs, lo, k, _ in self._head_pieces(o, n):
                    hs["grad"][lo : lo + k].zero_()
                h = self._in_head(o, n)
                if h < n:
                    self._grad_write(o + h, zeros[: n - h])
        self._wait(self.grad_writer, "gradient shard writes")

    def grad_stats(self) -> tuple:
        """Of the gradients accumulated so far (call with no step in flight: it borrows a buffer set)."""
        if self._stats_valid:
            return self._sq, self._finite
        sq, finite = 0.0, True
        for off in range(0, self.total, self.chunk):
            n = min(self.chunk, self.total - off)
            if self.grad_mem is not None:
                buf = self.grad_mem[off : off + n]
            elif off < self.head:
                buf = self.head_sets[off // self.chunk]["grad"][:n]
            else:
                buf = self.sets[0]["grad"][:n]
                self._grad_read(off, buf)
            s, f = sq_and_finite(buf)
            sq += s
            finite = finite and f
        return sq, finite

    def scale_grads(self, coef: float) -> None:
        self._coef = coef  # applied per chunk inside update, saving a pass over the file

    def zero_grads(self) -> None:
        """Forget the gradients accumulated so far: the next accumulation overwrites instead of adding."""
        self._wait(self.grad_writer, "gradient shard writes")
        self._written.clear()
        self._sq, self._finite, self._stats_valid = 0.0, True, self.accumulation_steps == 1

    def seal_grads(self) -> None:
        """The accumulated gradients now belong to the next ``update``; accumulation starts
        afresh (the next backward may run while an overlapped update still reads: Note
        [overlapped step] in _zero_optimizer.py says why it never reads a range being rewritten)."""
        self.zero_grads()

    # -------------------------------------------------------------- the step

    def update(self, fn: Callable[[Chunk], None]) -> None:
        """Run ``fn`` over every chunk of the flat space, in order, and write the results back."""
        self.update_head(fn)
        self.update_tail(fn)

    def update_head(self, fn: Callable[[Chunk], None]) -> None:
        """The cached chunks, on this thread (Note [host cache]). Starts the tail's first
        reads before computing, so that they land meanwhile."""
        self._prime_tail()
        if not self.head_sets:
            return
        if self._head == "empty":
            self._read_head()
        self._wait(self.head_io, "reading the cached optimizer chunks")  # and their last write-back
        if self._head == "reading":
            for i, (_, bufs) in enumerate(self._head_chunks()):
                self._expand(self.head_records[i], bufs)
            self._head = "loaded"
        for i, (off, bufs) in enumerate(self._head_chunks()):
            self._update_one(fn, off, bufs, self.head_io, self.head_records[i], cached=True)

    def _read_head(self) -> None:
        """Submit the reads of the cached chunks' master weights and moments (Note [host cache])."""
        for i, (off, bufs) in enumerate(self._head_chunks()):
            self._read_arrays(self.head_io, off, bufs, self.head_records[i], ("master", "exp_avg", "exp_avg_sq"))
        self._head = "reading"

    def release_idle(self, block: bool = True) -> None:
        """During forward, before the activation peak, with ``release_cache``: the cached
        chunks' master weights and moments give their pages back once their write-through
        has landed (without ``block``, only if it has), and are read again late in backward
        (Note [host cache])."""
        if not self._release_cache or self._head != "loaded" or not block and self.head_io.in_flight():
            return
        if self._master_writer is not None and not self._master_writer.flush(0, self.head, block=block):
            return  # the head's master weights, written by the parameter store, are still landing
        self._wait(self.head_io, "writing back the cached optimizer chunks")
        for hs, recs in zip(self.head_sets, self.head_records):
            for t in [hs[n] for n in ("master", "exp_avg", "exp_avg_sq")] + list(recs.values()):
                release_pages(t)
        self._head = "empty"

    def _head_chunks(self):
        """(offset, the head set's arrays cut to the chunk's length) of every cached chunk."""
        for i, hs in enumerate(self.head_sets):
            off = i * self.chunk
            n = min(self.chunk, self.total - off)
            yield off, self._with_grad({name: t[:n] for name, t in hs.items()}, off, n)

    def update_tail(self, fn: Callable[[Chunk], None]) -> None:
        """The chunks past the head, streamed through the buffer sets (Note [optimizer swapper]).

        Note [phased swap I/O]: by default chunk k + 1's reads run while chunk k computes and
        chunk k - 1's writes drain, so the disk serves reads and writes at once. Some disks
        serve that mix slowly: this machine's virtual disk, over a 48 GB working set, moved
        1.2-1.6 GB/s reading and writing at once but 1.8-2.1 GB/s in turns
        (scripts/bench_disk_mix.py). With ``swap_io: phased`` they take turns: chunk k's
        writes (the master weights' too, which the parameter store writes) land before chunk
        k + 1's reads are submitted, and those reads land before chunk k's moments are
        written; the arithmetic of chunk k overlaps chunk k + 1's reads, and so does the
        write of its master weights where the parameter store writes them as published."""
        self._prime_tail()
        starts = self._tail_starts()
        ahead = self.SETS - 2  # chunks read ahead; one set computes, one set's writes drain
        for k, off in enumerate(starts):
            self._wait(self.readers[k % self.SETS], f"reading optimizer chunk at element {off}")  # set k % SETS
            j = k + ahead
            if j < len(starts):
                if self._phased and k:
                    self._drain_writes(starts[k - 1])
                self._wait(self.writers[j % self.SETS], "writing back an optimizer chunk")  # set held chunk j - SETS
                self._read_chunk(j % self.SETS, starts[j])
            n = min(self.chunk, self.total - off)
            bufs = self._with_grad({name: t[:n] for name, t in self.sets[k % self.SETS].items()}, off, n)
            self._expand(self.records[k % self.SETS], bufs)
            next_read = None  # phased: chunk j's reads land before this chunk's writes start
            if self._phased and j < len(starts):
                next_read = functools.partial(self._wait, self.readers[j % self.SETS],
                                              f"reading optimizer chunk at element {starts[j]}")
            self._update_one(fn, off, bufs, self.writers[k % self.SETS], self.records[k % self.SETS],
                             before_writes=next_read)
        for w in self.writers:
            self._wait(w, "writing back optimizer chunks")
        for bufs in self.sets + self.records:  # idle until the next step (Note [released pages])
            for t in bufs.values():
                release_pages(t)
        self._coef = 1.0
        self._tail_primed = False

    def _drain_writes(self, off: int) -> None:
        """Note [phased swap I/O]: every write of the chunk at ``off`` has landed, the master
        weights' (written by the parameter store) included."""
        for w in self.writers:
            self._wait(w, "writing back optimizer chunks")
        if self._master_writer is not None:
            self._master_writer.flush(off, min(self.chunk, self.total - off))

    def _update_one(self, fn: Callable[[Chunk], None], off: int, bufs: dict, writer, records: dict,
                    cached: bool = False, before_writes: Optional[Callable[[], None]] = None) -> None:
        if self._coef != 1.0:
            bufs["grad"].mul_(self._coef)
        chunk = Chunk(off, bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"])
        fn(chunk)
        if before_writes is not None:
            before_writes()
        if self.grad_mem is not None or cached:
            release_pages(bufs["grad"])  # consumed: idle until backward writes it again (Note [released pages])
        spans = written_spans(off, bufs["master"].numel(), chunk.changed)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            if name == "master" and self._master_writer is not None:
                continue  # fn handed them to the parameter store, which writes them
            if name not in self._packed:
                for lo, hi in spans:
                    self._write(writer, name, lo, bufs[name][lo - off : hi - off])
                continue
            if not spans:
                continue  # a record is written whole or not at all
            rec = records[name][: self._code.length(bufs[name].numel())]
            self._code.encode(bufs[name], rec, _SIGNED[name], self._gen)
            if cached:  # the cache holds what the file holds (Note [host cache])
                self._code.decode(rec, bufs[name], _SIGNED[name])
            self._write(writer, name, off, rec)

    def _read_arrays(self, handle, off: int, bufs: dict, records: dict, names) -> None:
        """Submit the reads of a chunk's arrays: fp32 straight into ``bufs``, compressed moments into ``records``."""
        for name in names:
            n = bufs[name].numel()
            self._read(handle, name, off, records[name][: self._code.length(n)] if name in self._packed else bufs[name])

    def _expand(self, records: dict, bufs: dict) -> None:
        """The landed records of a chunk's compressed moments into its fp32 arrays."""
        for name in self._packed:
            self._code.decode(records[name][: self._code.length(bufs[name].numel())], bufs[name], _SIGNED[name])

    def _tail_starts(self) -> list:
        return list(range(self.head, self.total, self.chunk))

    def _prime_tail(self) -> None:
        """Submit the reads of the first tail chunks (once per update)."""
        if self._tail_primed:
            return
        starts = self._tail_starts()
        for j in range(min(self.SETS - 2, len(starts))):
            self._read_chunk(j, starts[j])
        self._tail_primed = True

    def _with_grad(self, bufs: dict, offset: int, numel: int) -> dict:
        """A chunk's arrays, its gradients from host memory where they live there."""
        if self.grad_mem is not None:
            bufs["grad"] = self.grad_mem[offset : offset + numel]
        return bufs

    def _read_chunk(self, s: int, off: int) -> None:
        n = min(self.chunk, self.total - off)
        self._read_arrays(self.readers[s], off, {name: t[:n] for name, t in self.sets[s].items()}, self.records[s],
                          self._swapped)

    def nbytes(self) -> dict:
        return totals(self.plan(self.total, self.chunk, len(self.head_sets) * self.chunk, self.grad_mem is not None,
                                self.moments))

    def close(self) -> None:
        """Close the I/O handles (Note [closing handles] in aio/_handle.py)."""
        close_handles([self.head_io, self.reader, *self.readers, *self.writers, self.grad_reader, self.grad_writer])
        self.checkpoint_done()
        # Note [closed engines] in _engine.py: the buffer sets, host cache and gradients go now
        self.sets, self.records, self.head_sets, self.head_records = [], [], [], []
        self.grad_mem = None
        self.head = 0

    def checksums(self) -> dict:
        """The block sums of each swap file by array name (Note [swap checksums] in aio/_checksum.py)."""
        return {n: sums_of(p) for n, p in self.paths.items() if sums_of(p)}

    @classmethod
    def plan(cls, total: int, chunk: int, head: int, grads_in_memory: bool, moments: str = "fp32") -> dict:
        """Bytes for a plan (Note [one memory model] in _memory_plan.py): the swap files (gradients
        too unless they stay in host memory), the buffer sets, the host cache of the first
        ``head`` elements (Note [host cache]) and the gradients in host memory (Note
        [gradients in host memory]). Not yet counted: the files' block sums, 1/512 of the swap
        bytes (BlockSums.bytes_for; Note [swap checksums] in aio/_checksum.py), nor a
        checkpoint's staging files of compressed moments (8 bytes per element while it runs).
        Compressed moments (Note [compressed moments on disk]) shrink their files and add a
        record buffer per moment to each buffer set and cached chunk."""
        swapped = len(_NAMES) - (1 if grads_in_memory else 0)
        packed = 2 * (record_bytes(moments, chunk) if moments != "fp32" else 0)  # both moments' records
        files = 4 * (swapped - 2) * total + 2 * file_bytes(moments, total, chunk)
        return {"nvme": {OPT_FILES: files},
                "host": {OPT_BUFFERS: cls.SETS * (4 * len(_NAMES) * chunk + packed),
                         OPT_HOST_CACHE: 4 * swapped * head + head // chunk * packed,
                         GRADIENTS: 4 * total if grads_in_memory else 0}}

