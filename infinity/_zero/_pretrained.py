"""Pretrained weights read straight from safetensors files into ``infinity.Init``'s partitions.

Note [streamed load]: Hugging Face's ``from_pretrained`` (transformers 5) builds the model on
the meta device, opens each ``*.safetensors`` file, takes a slice object per key and, for each
parameter, copies the whole tensor out of the file (``slice[...]``, then ``.to(dtype)``), wraps
it in an ``nn.Parameter`` and assigns it to its module (``setattr``). Under ``Init`` two seams
change what that costs, and nothing else in Hugging Face's loader:
- the file handles the loader opens (``transformers.modeling_utils.safe_open``) hand out
  ``PendingTensor``s instead of values: a meta tensor that knows where its values are in the
  file. ``.to``, ``detach``, ``requires_grad_`` and metadata queries keep it pending, so the
  loader's renaming, dtype choice and ``nn.Parameter`` wrapping run unchanged; any other
  operation (a weight converter that splits or concatenates) reads the whole tensor first,
  so a conversion is still exact;
- the assignment reaches ``Init`` through torch's global parameter-registration hook; a
  pending value becomes a partitioned parameter whose shard (this rank's element range,
  Note [shard layout] in _unit.py) is read from the file - and only that range - cast to the
  parameter's dtype and put in the Init store.
So each rank reads about 1/world of the checkpoint, and the host holds one shard at a time.
Reads go through ``infinity.aio`` on the 4 KiB-aligned range that covers the shard (O_DIRECT);
the few bytes of an unaligned end of file are read buffered.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from .._offload._swap import new_aio
from ..aio import aligned_empty
from ..errors import StorageError
from ._param import _META_ATTRS

_ALIGN = 4096
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's values are: a byte offset in a safetensors file, its stored dtype and shape."""

    path: str
    offset: int  # of the first element, from the start of the file
    dtype: torch.dtype
    shape: torch.Size
    file_size: int  # where O_DIRECT reads must stop: the end of the file rounded down to 4 KiB

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(path: str) -> Dict[str, TensorSource]:
    """The tensors of a safetensors file, from its JSON header (no tensor data is read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StorageError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise StorageError(f"{path}: not a safetensors file (header length {n} exceeds the file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise StorageError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype"))
        begin, end = entry["data_offsets"]
        src = TensorSource(path, 8 + n + begin, dtype, torch.Size(entry["shape"]), size)
        if dtype is None:
            raise StorageError(f"{path}: tensor {key!r} has dtype {entry.get('dtype')!r}, which infinity cannot read")
        if end - begin != src.numel * dtype.itemsize or src.offset + (end - begin) > size:
            raise StorageError(f"{path}: tensor {key!r} is truncated or its offsets are corrupt "
                               f"(bytes {begin}..{end} of the data section, file size {size})")
        out[key] = src
    return out


class SourceReader:
    """Ranged reads of checkpoint tensors through ``infinity.aio``; counts the bytes it reads."""

    def __init__(self, aio_cfg):
        self._cfg = aio_cfg
        self._io = None
        self._lock = threading.Lock()
        self._buf: Optional[torch.Tensor] = None
        self.bytes_read = 0

    def read(self, src: TensorSource, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor into ``out[:hi - lo]``, cast to its dtype.
        The read goes through one kept aligned buffer, not the heap, so loading a checkpoint
        tensor by tensor leaves no heap behind."""
        es = src.dtype.itemsize
        start, end = src.offset + lo * es, src.offset + hi * es
        if end <= start:
            return out
        a0 = start // _ALIGN * _ALIGN
        a1 = min(-(-end // _ALIGN) * _ALIGN, src.file_size // _ALIGN * _ALIGN)
        with self._lock:
            buf = self._bounce(max(a1, end) - a0)
            if self._io is None:
                self._io = new_aio(self._cfg)
            if a1 > a0:
                self._io.sync_pread(buf[: a1 - a0], src.path, a0)
            tail = max(a1, a0)
            if end > tail:  # the unaligned end of the file: a buffered read
                with open(src.path, "rb") as f:
                    f.seek(tail)
                    got = f.readinto(memoryview(buf[tail - a0:end - a0].numpy()))
                if got != end - tail:
                    raise StorageError(f"{src.path}: short read at offset {tail} ({got} of {end - tail} bytes)")
            self.bytes_read += end - start
            out[: hi - lo].copy_(buf[start - a0:end - a0].view(src.dtype))
        return out

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """The aligned read buffer, kept between reads (a fresh mapping per read would fault in
        every page again); grown to the largest range read so far."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None
            self._buf = aligned_empty(-(-nbytes // (2 << 20)) * (2 << 20), torch.uint8)
        return self._buf[:nbytes]

    def close(self) -> None:
        self._buf = None
        if self._io is not None:
            self._io.close()
            self._io = None


# Metadata queries a pending tensor answers without reading its values.
_LAZY_METHODS = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor.is_contiguous,
    torch.Tensor.__len__,
}


class PendingTensor(torch.Tensor):
    """A checkpoint tensor not read yet (Note [streamed load]): a meta tensor with the target
    dtype whose values are ``source``'s, converted to that dtype."""

    source: TensorSource
    reader: SourceReader

    @staticmethod
    def of(source: TensorSource, reader: SourceReader, dtype: Optional[torch.dtype] = None,
           requires_grad: bool = False) -> "PendingTensor":
        meta = torch.empty(source.shape, dtype=dtype or source.dtype, device="meta")
        t = torch.Tensor._make_subclass(PendingTensor, meta, requires_grad)
        t.source, t.reader = source, reader
        return t

    def values(self, lo: int = 0, hi: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor, read from the file, in this tensor's dtype
        (into ``out[:hi - lo]`` if given)."""
        hi = self.source.numel if hi is None else hi
        return self.reader.read(self.source, lo, hi, aligned_empty(hi - lo, self.dtype) if out is None else out)

    def read_shard(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """A rank's shard (Note [shard layout] in _unit.py): elements ``[lo, hi)`` into ``out``, the rest of
        ``out`` (the padding of the last shard) zero."""
        self.values(lo, hi, out=out)
        out[hi - lo:].zero_()
        return out

    def full(self) -> torch.Tensor:
        return self.values().view(self.source.shape)

    def _like(self, dtype: torch.dtype, requires_grad: bool) -> "PendingTensor":
        out = PendingTensor.of(self.source, self.reader, dtype, requires_grad)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("source", "reader")})
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"PendingTensor({os.path.basename(self.source.path)}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner in _META_ATTRS or func in _LAZY_METHODS or owner in (
                torch._C.TensorBase.shape, torch._C.TensorBase.ndim, torch._C.TensorBase.nbytes):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.__repr__:
            return args[0].__repr__()
        me = args[0] if args else None
        if isinstance(me, PendingTensor):
            if func is torch.Tensor.to:
                device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                if device is None or device.type in ("cpu", "meta"):
                    return me._like(dtype or me.dtype, me.requires_grad)
            if func in (torch.Tensor.detach, torch.Tensor.detach_):
                return me._like(me.dtype, False)
            if func is torch.Tensor.requires_grad_:
                flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
                with torch._C.DisableTorchFunctionSubclass():
                    torch.Tensor.requires_grad_(me, flag)
                return me
        args, kwargs = _realize(args), _realize(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _realize(obj):
    """Replace pending tensors by their values: an operation other than a cast needs them."""
    if isinstance(obj, PendingTensor):
        return obj.full()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_realize(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _realize(v) for k, v in obj.items()}
    return obj


class _LazySlice:
    """The loader's slice of one tensor: ``[...]`` gives a ``PendingTensor``; other indexing reads."""

    def __init__(self, inner, source: TensorSource, reader: SourceReader):
        self._inner, self._source, self._reader = inner, source, reader

    def __getitem__(self, index):
        if index is Ellipsis or index == slice(None):
            return PendingTensor.of(self._source, self._reader)
        return self._inner[index]

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _LazyFile:
    """A ``safe_open`` handle whose slices are pending (Note [streamed load])."""

    def __init__(self, opener, reader: SourceReader, filename, *args, **kwargs):
        self._inner = opener(filename, *args, **kwargs)
        self._sources = read_header(os.fspath(filename))
        self._reader = reader

    def get_slice(self, key):
        return _LazySlice(self._inner.get_slice(key), self._sources[key], self._reader)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


def open_lazily(reader: SourceReader) -> Optional[Callable[[], None]]:
    """Make Hugging Face's loader open safetensors files through ``_LazyFile``; returns the
    undo, or None when the seam is not there (transformers not imported, or not version 5):
    then loading still works, each tensor read whole by Hugging Face and partitioned as it is
    assigned."""
    mu = sys.modules.get("transformers.modeling_utils")
    opener = getattr(mu, "safe_open", None) if mu is not None else None
    if opener is None:
        return None

    def lazy_open(filename, *args, **kwargs):
        return _LazyFile(opener, reader, filename, *args, **kwargs)

    mu.safe_open = lazy_open

    def undo() -> None:
        mu.safe_open = opener

    return undo
