"""The optimizer states on NVMe: master weights, moments and gradient shards in swap files,
streamed through fixed-size chunks by the step (Note [optimizer swapper]), with a host cache of
the first chunks (Note [host cache]) and optionally every gradient shard in host memory (Note
[gradients in host memory]). The store composes parts with one job each: the files
(_optimizer_files.py), the host cache (_head_cache.py), the gradient shards (_grad_shards.py),
the swap pipeline (_swap_pipeline.py) and the checkpoint staging (_moment_staging.py).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .._runtime._log import logger
from .._runtime._telemetry_counters import seconds_into
from .._runtime._tiers import Tier
from ..aio._checksum import sums_of
from ..aio._handle import close_handles
from ..errors import InvariantError
from ._grad_shards import GradShards
from ._head_cache import HeadCache, HeadState
from ._layout import ParamSource
from ._memory_plan import GRADIENTS, OPT_BUFFERS, OPT_FILES, OPT_HOST_CACHE, OPT_STATES, totals
from ._moment_staging import MomentStaging
from ._moments import file_bytes, record_bytes
from ._optimizer_files import NAMES, STATES, OptimizerFiles
from ._optimizer_store import Chunk, chunk_elems, head_elems
from ._ordered_writes import MasterFile
from ._swap import Swap, new_aio
from ._swap_pipeline import SwapPipeline


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

    SETS = SwapPipeline.SETS

    def __init__(self, total: int, ranges: List[tuple], swap: Swap, aio_cfg, chunk: Optional[int],
                 accumulation_steps: int, host_cache: Optional[int] = None, grads_in_memory: bool = False,
                 moments: str = "fp32", release_cache: bool = False, phased: bool = False,
                 master: Optional[MasterFile] = None, host_upto: int = 0):
        self.tier = Tier.NVME
        self.total = total
        self.ranges = ranges  # (offset, numel) of every unit's shard in the flat space
        self.chunk = chunk_elems(chunk, total)
        self.first = head_elems(host_cache, ranges, self.chunk, total)  # Note [host cache]: updated by update_head
        # ``host_upto``: the first elements in host memory only, the host share of a split (Note [split tiers] in
        # _split.py), cached chunks of their own; the cache covers them and the ``host_cache`` after them
        head = max(self.first, host_upto)
        self.host_upto = host_upto
        # seconds the update spent on each tier, running totals (Note [engine telemetry keys] in _runtime/_telemetry.py)
        self.tier_seconds = dict.fromkeys(("cpu", "nvme") if host_upto else ("nvme",), 0.0)
        if host_upto and master is not None:
            raise InvariantError("a split optimizer tier keeps the master weights of its host share out of master.swp")
        # master: master.swp shared with the parameter store (Note [parameters from the master] in _placement.py)
        self.files = OptimizerFiles(total, self.chunk, swap, aio_cfg, grads_in_memory=grads_in_memory,
                                    moments=moments, master=master, base=host_upto)
        self.cache = HeadCache(self.files, head, aio_cfg)
        self.pipeline = SwapPipeline(self.files, head, aio_cfg, phased=phased, grads_in_memory=grads_in_memory)
        self.grads = GradShards(self.files, self.cache, ranges, in_memory=grads_in_memory,
                                accumulation_steps=accumulation_steps, aio_cfg=aio_cfg,
                                scratch=self.pipeline.sets[0]["grad"])
        self.reader = new_aio(aio_cfg)  # master weights read back, moments staged for a checkpoint
        self.staging = MomentStaging(self.files, swap, aio_cfg, self.pipeline, self.reader)
        self.release_cache = release_cache  # give the cache back through the activation peak (Note [host cache])
        self._reload_below = total // 2  # a gradient below this offset starts the cache's reads (Note [host cache])
        self.files.zero_fill(self.pipeline.sets[0]["grad"].zero_(), self.pipeline.writers[0])
        # What trades host memory for disk traffic, said once (Note [host cache], [gradients in host memory])
        if host_upto:
            logger.info("optimizer states split: the first %d of %d elements (%.0f MiB with their gradients) in host "
                        "memory only, the rest in swap files (zero.offload_optimizer.split)", host_upto, total,
                        16 * host_upto / 2**20)
        logger.info("optimizer states on NVMe: host cache of the first %d elements (%.0f MiB; "
                    "zero.offload_optimizer.host_cache: %s), gradient shards in %s (%.0f MiB of host memory), "
                    "buffer sets %.0f MiB", head, 4 * len(self.files.swapped) * head / 2**20,
                    "auto" if host_cache is None else host_cache,
                    "host memory" if grads_in_memory else "a swap file", 4 * total * grads_in_memory / 2**20,
                    self.SETS * 4 * len(NAMES) * self.chunk / 2**20)

    # ------------------------------------------------------------ what the parts hold, by name

    @property
    def head(self) -> int:
        """Elements at the start of the flat space in the host cache (Note [host cache])."""
        return self.cache.head

    @property
    def memory_elems(self) -> int:
        """The split's host share (Note [split tiers] in _split.py): the rest is in the files."""
        return self.host_upto

    @property
    def head_sets(self) -> list:
        return self.cache.sets

    @property
    def grad_mem(self) -> Optional[torch.Tensor]:
        """Every gradient shard in host memory (Note [gradients in host memory]); None: grad.swp."""
        return self.grads.mem

    @property
    def paths(self) -> dict:
        return self.files.paths

    @property
    def array_io(self) -> dict:
        """[read, written] bytes per swap file."""
        return self.files.bytes_by_file()

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.files.bytes_written

    def element_of(self, name: str, byte_offset: int) -> int:
        """The element at ``byte_offset`` of a swap file (the chunk's first, for a compressed moment)."""
        return self.files.element_of(name, byte_offset)

    def _files_landed(self) -> None:
        """The files are complete: the cache's write-through and the parameter store's writes
        of a shared master.swp have landed."""
        self.cache.wait()
        self.files.master_landed()

    # ------------------------------------------------------------ master weights

    def load_master(self, offset: int, values: torch.Tensor) -> None:
        self._files_landed()  # older values must land first
        buf = values.contiguous().to(torch.float32)
        for dst, at in self.cache.owned_pieces(offset, buf.numel(), "master"):  # Note [split tiers] in _split.py
            dst.copy_(buf[at : at + dst.numel()])
        skip = max(0, min(self.host_upto - offset, buf.numel()))
        if skip < buf.numel():
            writer = self.pipeline.writers[0]
            self.files.write(writer, "master", offset + skip, buf[skip:])
            self.files.wait(writer, f"writing master weights at element {offset + skip}")
            if offset + skip < self.head:
                self.cache.invalidate()  # the next update reads the cache afresh (Note [host cache])

    def read_master(self, offset: int, numel: int) -> torch.Tensor:
        self._files_landed()
        out = torch.empty(numel, dtype=torch.float32)
        for src, at in self.cache.owned_pieces(offset, numel, "master"):  # Note [split tiers] in _split.py
            out[at : at + src.numel()].copy_(src)
        skip = max(0, min(self.host_upto - offset, numel))
        if skip < numel:
            self.files.read(self.reader, "master", offset + skip, out[skip:])
            self.files.wait(self.reader, f"reading master weights at element {offset + skip}")
        return out

    def master_view(self) -> Optional[torch.Tensor]:
        """None: the master weights are in a file, not one tensor in memory."""
        return None

    # ------------------------------------------------------------ checkpoints

    def checkpoint_sources(self) -> dict:
        """The swap files of the master weights and moments, once complete (Note [host cache],
        Note [parameters from the master] in _placement.py), for a checkpoint; compressed
        moments expanded into fp32 staging files (Note [compressed moments on disk])."""
        self._files_landed()
        out: dict = {name: self.files.paths[name] for name in STATES}
        for name in self.files.packed:
            out[name] = self.staging.stage(name)
        if self.host_upto:  # Note [split tiers] in _split.py: the host share, then the files
            out = {name: [(bufs[name], bufs[name].numel()) for _, bufs in self.cache.chunks(0, self.host_upto)]
                   + [(path, self.total - self.host_upto)] for name, path in out.items()}
        return out

    def checkpoint_loaded(self) -> None:
        """A checkpoint rewrote the files (compressed moments: their staging files, now
        compressed back into the swap files): the host cache reads them afresh."""
        self.staging.compress_back()
        self.cache.invalidate()

    def checkpoint_done(self) -> None:
        """The checkpoint no longer needs the staging files."""
        self.staging.done()

    # ------------------------------------------------------------ gradients

    def accumulate(self, offset: int, shard_grad: torch.Tensor, scale: float) -> None:
        if self.cache.state is HeadState.EMPTY and self.cache.sets and offset < self._reload_below:
            self.cache.start_reads()  # backward is past its peak: the cache's reads land while it finishes
        self.grads.accumulate(offset, shard_grad, scale)

    def wait_grad_writes(self) -> None:
        """Gradient buffers handed to ``accumulate`` may be reused once this returns."""
        self.grads.wait_writes()

    def finalize_grads(self) -> None:
        self.grads.finalize()

    def grad_stats(self) -> tuple:
        """Of the gradients accumulated so far (call with no step in flight: it borrows a buffer set)."""
        return self.grads.grad_stats()

    def grads_flat(self) -> Optional[torch.Tensor]:
        """The accumulated gradient shards as one tensor, when they are in host memory."""
        return self.grads.mem

    def landing_slot(self, offset: int, numel: int) -> Optional[torch.Tensor]:
        return None  # gradients are added (in fp32 on the host or into a swap file): none lands in place

    def note_norm(self, offset: int, norm: torch.Tensor) -> None:
        pass

    def zero_grads(self) -> None:
        self.grads.zero()

    def seal_grads(self) -> None:
        """The accumulated gradients now belong to the next ``update``; accumulation starts
        afresh (the next backward may run while an overlapped update still reads: Note
        [overlapped step] in _zero_optimizer.py says why it never reads a range being rewritten)."""
        self.grads.zero()

    # ------------------------------------------------------------ the step

    def update(self, fn: Callable[[Chunk], None]) -> None:
        """Run ``fn`` over every chunk of the flat space, in order, and write the results back."""
        self.update_head(fn)
        self.update_tail(fn)

    def update_head(self, fn: Callable[[Chunk], None]) -> None:
        """The cached chunks, on this thread (Note [host cache]). Starts the tail's first
        reads before computing, so that they land meanwhile."""
        with seconds_into(self.tier_seconds, "nvme"):  # the files' reads submitted and waited for
            self.pipeline.prime()
            if not self.cache.sets:
                return
            if self.cache.state is HeadState.EMPTY:
                self.cache.start_reads()
            self.cache.land()  # and their last write-back
        self._update_cached(fn, 0, self.first)

    def _update_cached(self, fn: Callable[[Chunk], None], lo: int, hi: int) -> None:
        """The cached chunks starting in [lo, hi): written through, or not at all in the host share of a split."""
        for off, bufs in self.cache.chunks(lo, hi):
            # the host share's seconds are the cpu's; a cached chunk's the NVMe tier's, written through to its file
            with seconds_into(self.tier_seconds, "cpu" if off < self.host_upto else "nvme"):
                bufs = self.grads.with_grad(bufs, off, bufs["master"].numel())
                self.pipeline.update_one(fn, off, bufs, self.cache.io, self.cache.records[off // self.chunk],
                                         cached=True, owned=off < self.host_upto)

    def update_tail(self, fn: Callable[[Chunk], None]) -> None:
        """The chunks past the head, streamed through the buffer sets (Note [optimizer swapper]).

        Note [phased swap I/O]: by default chunk k + 1's reads run while chunk k computes and
        chunk k - 1's writes drain, so the disk serves reads and writes at once. Some disks
        serve that mix slowly: this machine's virtual disk, over a 48 GB working set, moved
        1.2-1.6 GB/s reading and writing at once but 1.8-2.1 GB/s in turns
        (benchmarks/disk_mix.py). With ``swap_io: phased`` they take turns: chunk k's
        writes (the master weights' too, which the parameter store writes) land before chunk
        k + 1's reads are submitted, and those reads land before chunk k's moments are
        written; the arithmetic of chunk k overlaps chunk k + 1's reads, and so does the
        write of its master weights where the parameter store writes them as published.

        The cached chunks past ``first`` (a split's host share larger than the head that
        ``update_head`` takes) come first, while the primed reads of the files' first chunks land."""
        if self.head > self.first:
            self._update_cached(fn, self.first, self.head)
        with seconds_into(self.tier_seconds, "nvme"):  # the streamed chunks: their reads, update and write-backs
            self.pipeline.run(fn, self.grads.with_grad)

    def abandon_update(self) -> None:
        """Note [failed step] in _step_gate.py: the buffer sets' and the host cache's I/O
        drained and read afresh next time, the gradients dropped."""
        self.pipeline.reset()
        self.cache.forget()
        self.files.drain(self.grads.writer, "a failed update's gradient shards")
        self.grads.zero()

    def release_idle(self, block: bool = True) -> None:
        """During forward, before the activation peak, with ``release_cache``: the cached
        chunks' master weights and moments give their pages back once their write-through
        has landed (without ``block``, only if it has), and are read again late in backward
        (Note [host cache])."""
        cache = self.cache
        if not self.release_cache or cache.state is not HeadState.LOADED or not block and cache.io.in_flight():
            return
        if not self.files.master_landed(0, cache.head, block=block):
            return  # the head's master weights, written by the parameter store, are still landing
        cache.release()

    # ------------------------------------------------------------ accounting, shutdown

    def state_bytes(self, source: ParamSource) -> dict:
        """Optimizer states and gradient shards held in memory the way the engine reports
        them: a split's host share (Note [split tiers] in _split.py), the rest being on NVMe."""
        return {"optimizer": 12 * self.host_upto, "grads": 4 * self.host_upto if self.grads.mem is None else 0}

    def nbytes(self) -> dict:
        return totals(self.plan(self.total, self.chunk, len(self.cache.sets) * self.chunk, self.grads.mem is not None,
                                self.files.moments, self.host_upto))

    def close(self) -> None:
        """Close the I/O handles (Note [closing handles] in aio/_handle.py); the buffer sets,
        host cache and gradients go now (Note [closed engines] in _engine.py)."""
        close_handles([self.reader])
        self.cache.close()
        self.pipeline.close()
        self.grads.close()
        self.checkpoint_done()

    def checksums(self) -> dict:
        """The block sums of each swap file by array name (Note [swap checksums] in aio/_checksum.py)."""
        return {n: sums_of(p) for n, p in self.files.paths.items() if sums_of(p)}

    @classmethod
    def plan(cls, total: int, chunk: int, head: int, grads_in_memory: bool, moments: str = "fp32",
             host_upto: int = 0) -> dict:
        """Bytes for a plan (Note [one memory model] in _memory_plan.py): the swap files (gradients
        too unless they stay in host memory), the buffer sets, the host cache of the first
        ``head`` elements (Note [host cache]) and the gradients in host memory (Note
        [gradients in host memory]). Not yet counted: the files' block sums, 1/512 of the swap
        bytes (BlockSums.bytes_for; Note [swap checksums] in aio/_checksum.py), nor a
        checkpoint's staging files of compressed moments (8 bytes per element while it runs).
        Compressed moments (Note [compressed moments on disk]) shrink their files and add a
        record buffer per moment to each buffer set and cached chunk. ``host_upto``: the host
        share of a split (whole chunks at the start, inside ``head``; Note [split tiers] in
        _split.py), optimizer states in host memory with no file behind them."""
        swapped = len(NAMES) - (1 if grads_in_memory else 0)
        packed = 2 * (record_bytes(moments, chunk) if moments != "fp32" else 0)  # both moments' records
        on_disk = total - host_upto
        files = 4 * (swapped - 2) * on_disk + 2 * file_bytes(moments, on_disk, chunk)
        return {"nvme": {OPT_FILES: files},
                "host": {OPT_BUFFERS: cls.SETS * (4 * len(NAMES) * chunk + packed),
                         OPT_STATES: 4 * swapped * host_upto + host_upto // chunk * packed,
                         OPT_HOST_CACHE: 4 * swapped * (head - host_upto) + (head - host_upto) // chunk * packed,
                         GRADIENTS: 4 * total if grads_in_memory else 0}}

