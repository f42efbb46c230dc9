"""The NVMe optimizer store's swap files: one per array, where a chunk's values lie in each
(a compressed moment keeps one record per chunk: Note [compressed moments on disk] in
_nvme_optimizer_store.py), and the bytes moved through each. Every part of the store reads
and writes through here.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..aio import AioError, aligned_empty
from ..aio._checksum import checksummed
from ..errors import InvariantError
from ._moments import Codec, file_bytes
from ._ordered_writes import MasterFile
from ._swap import Swap, wait_io

NAMES = ("master", "exp_avg", "exp_avg_sq", "grad")
STATES = NAMES[:3]  # what an update reads and writes back; the gradients it only consumes
SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the moments, and whether their codes carry a sign


class OptimizerFiles:
    """The swap file of each array with one (the gradients have none when they stay in host
    memory), the moments' codec, and byte counts: per file (``array_io``) and per kind of
    handle (``io``: the step's and the gradients', which run on different threads).
    ``master``: master.swp shared with the parameter store, which writes the step's master
    weights (Note [parameters from the master] in _placement.py); None: this store's own.
    ``base``: the files hold the flat space from this element (whole chunks) on; the part
    before it lives in host memory only (Note [split tiers] in _split.py)."""

    def __init__(self, total: int, chunk: int, swap: Swap, aio_cfg, *, grads_in_memory: bool, moments: str,
                 master: Optional[MasterFile] = None, base: int = 0):
        if base % chunk or not 0 <= base <= total:
            raise InvariantError(f"optimizer files from element {base}: not a chunk boundary of {total} elements")
        self.total, self.chunk, self.rank, self.base = total, chunk, swap.rank, base
        self.swapped = STATES if grads_in_memory else NAMES  # the arrays with a swap file
        self.moments = moments
        self.codec: Optional[Codec] = Codec(moments, chunk) if moments != "fp32" else None
        self.packed = tuple(SIGNED) if self.codec else ()
        self.master = master
        self.paths = {n: master.path if n == "master" and master is not None else
                      checksummed(swap.file(f"{n}.swp", self.file_bytes(n)), self.file_bytes(n), aio_cfg.checksums)
                      for n in self.swapped}  # Note [swap checksums] in aio/_checksum.py
        self.array_io = {n: [0, 0] for n in self.swapped}  # [read, written] bytes per swap file, by this store
        self.io = {"step": [0, 0], "grad": [0, 0]}  # [read, written] bytes by the step's and the gradients' handles
        self.noise = torch.Generator().manual_seed(0x5EED + swap.rank)  # stochastic rounding's

    @property
    def code(self) -> Codec:
        """The moments' codec: reached only for the packed arrays (Note [compressed moments on disk] in
        _nvme_optimizer_store.py)."""
        if self.codec is None:
            raise InvariantError("compressed-moment record used with fp32 moments")
        return self.codec

    @property
    def master_shared(self) -> bool:
        """The parameter store writes the step's master weights (Note [parameters from the master] in _placement.py)."""
        return self.master is not None

    def master_landed(self, offset: int = 0, numel: Optional[int] = None, *, block: bool = True) -> bool:
        """The parameter store's writes of master.swp over the range have landed (always, when unshared)."""
        if self.master is None:
            return True
        return self.master.landed(offset, self.total - offset if numel is None else numel, block=block)

    # ------------------------------------------------------------ where values lie

    def file_bytes(self, name: str) -> int:
        return file_bytes(self.moments if name in self.packed else "fp32", self.total - self.base, self.chunk)

    def spans(self):
        """(offset, elements) of every chunk the files hold, in order."""
        for off in range(self.base, self.total, self.chunk):
            yield off, min(self.chunk, self.total - off)

    def byte_offset(self, name: str, offset: int) -> int:
        """Where element ``offset`` (a chunk's start, for a compressed moment) is in its file."""
        if offset < self.base:
            raise InvariantError(f"optimizer element {offset} is in host memory only (the files start at {self.base})")
        if name in self.packed:
            return (offset - self.base) // self.chunk * self.code.record
        return (offset - self.base) * 4

    def element_of(self, name: str, byte_offset: int) -> int:
        """The element at ``byte_offset`` of a swap file (the chunk's first, for a compressed moment)."""
        if name in self.packed:
            return self.base + byte_offset // self.code.record * self.chunk
        return self.base + byte_offset // 4

    def record_set(self, what: str) -> dict:
        """A record buffer per compressed moment, for one chunk (none for fp32 moments)."""
        return {n: aligned_empty(self.code.record, torch.uint8, what=what) for n in self.packed}

    def record(self, records: dict, name: str, numel: int) -> torch.Tensor:
        """The part of ``records[name]`` that holds a chunk of ``numel`` elements."""
        return records[name][: self.code.length(numel)]

    def encode(self, name: str, values: torch.Tensor, records: dict) -> torch.Tensor:
        rec = self.record(records, name, values.numel())
        self.code.encode(values, rec, SIGNED[name], self.noise)
        return rec

    def decode(self, name: str, rec: torch.Tensor, values: torch.Tensor) -> None:
        self.code.decode(rec, values, SIGNED[name])

    def expand(self, records: dict, bufs: dict) -> None:
        """The landed records of a chunk's compressed moments into its fp32 arrays."""
        for name in self.packed:
            self.decode(name, self.record(records, name, bufs[name].numel()), bufs[name])

    # ------------------------------------------------------------ transfers

    def wait(self, handle, what: str) -> None:
        wait_io(handle, f"{what} (optimizer swapper, rank {self.rank})")

    def drain(self, handle, what: str) -> None:
        """``wait``, a failed request's error dropped: after a failed update (Note [failed
        step] in _step_gate.py) nothing uses what it moved, and its error was raised already."""
        try:
            self.wait(handle, what)
        except AioError:
            pass

    def read(self, handle, name: str, offset: int, out: torch.Tensor) -> None:
        handle.pread(out, self.paths[name], self.byte_offset(name, offset))
        nbytes = out.numel() * out.element_size()
        self.io["step"][0] += nbytes
        self.array_io[name][0] += nbytes

    def write(self, handle, name: str, offset: int, values: torch.Tensor) -> None:
        self.put(handle, name, offset, values)
        self.io["step"][1] += values.numel() * values.element_size()

    def put(self, handle, name: str, offset: int, values: torch.Tensor) -> None:
        """A write counted against its file only (not the step's traffic)."""
        handle.pwrite(values, self.paths[name], self.byte_offset(name, offset))
        self.array_io[name][1] += values.numel() * values.element_size()

    def read_arrays(self, handle, off: int, bufs: dict, records: dict, names: Iterable[str]) -> None:
        """Submit the reads of a chunk's arrays: fp32 straight into ``bufs``, compressed moments into ``records``."""
        for name in names:
            n = bufs[name].numel()
            self.read(handle, name, off, self.record(records, name, n) if name in self.packed else bufs[name])

    def zero_fill(self, zeros: torch.Tensor, handle) -> None:
        """Every file but master.swp reads as zeros (moments start at zero; the gaps between
        unit ranges must read as zero gradients). ``zeros``: one chunk of them."""
        for name in (n for n in self.swapped if n != "master"):
            for off, n in self.spans():
                self.put(handle, name, off, zeros.view(torch.uint8)[: self.code.length(n)]
                         if name in self.packed else zeros[:n])
        self.wait(handle, "zero-filling the optimizer swap files")

    # ------------------------------------------------------------ accounting

    @property
    def bytes_read(self) -> int:
        return sum(r for r, _ in self.io.values())

    @property
    def bytes_written(self) -> int:
        """Including the parameter store's writes of a shared master.swp: the optimizer's bytes."""
        shared = self.master.writes.bytes_written if self.master is not None else 0
        return sum(w for _, w in self.io.values()) + shared

    def bytes_by_file(self) -> dict:
        """[read, written] bytes per swap file, a shared master.swp's writes by the parameter store included."""
        out = {n: list(v) for n, v in self.array_io.items()}
        if self.master is not None:
            out["master"][1] += self.master.writes.bytes_written
        return out
