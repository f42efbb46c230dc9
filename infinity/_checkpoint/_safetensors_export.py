"""Save a trained model's weights as Hugging Face safetensors, gathered unit by unit.

Note [bounded export]: the shard plan is made from the parameters' full shapes before any
gather, so file names (``model-00001-of-00003.safetensors``) are known up front. Units are
gathered one at a time (collectively, on every rank); rank 0 copies each full parameter to
host memory and writes a shard file as soon as all of its tensors are present, then drops
them. Host memory therefore stays within one shard plus one unit, whatever the model size.
A parameter shared by several modules (tied embeddings) is saved once, under the first name
``named_parameters()`` gives it, which is the name Hugging Face keeps for tied weights.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file
from torch import nn

from .._runtime import _comm as comm
from .._zero._engine import engine_of
from .._zero._gathered import GatheredParameters
from .._zero._tiling import untiled_layout, untiled_names
from ..errors import UsageError

DEFAULT_MAX_SHARD_BYTES = 200 * 1000 * 1000
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclass
class _Shard:
    file: str
    names: List[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class ExportResult:
    directory: str
    files: List[str]
    total_bytes: int
    tensors: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out


def _plan(sizes: Dict[str, int], max_shard_bytes: int) -> List[_Shard]:
    shards: List[_Shard] = []
    for name, nbytes in sizes.items():
        if not shards or (shards[-1].names and shards[-1].nbytes + nbytes > max_shard_bytes):
            shards.append(_Shard(""))
        shards[-1].names.append(name)
        shards[-1].nbytes += nbytes
    if len(shards) == 1:
        shards[0].file = SINGLE_FILE
    for i, s in enumerate(shards):
        if len(shards) > 1:
            s.file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    return shards


def _groups(model: nn.Module) -> List[List[nn.Parameter]]:
    """Parameters in gather groups: one fetch unit each when infinity manages the model."""
    engine = engine_of(model)
    if engine is None:
        return [[p] for p in model.parameters()]
    return [list(unit.params) for unit in engine.units]


class _ShardWriter:
    """The writer rank's side of Note [bounded export]: a host copy of each tensor as it
    arrives, and a shard's file written as soon as all of its tensors are present."""

    def __init__(self, directory: str, shards: List[_Shard], out_dtype):
        self.directory, self.out_dtype = directory, out_dtype
        self.owner = {n: s for s in shards for n in s.names}
        self.pending: Dict[str, torch.Tensor] = {}
        os.makedirs(directory, exist_ok=True)

    def take(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.detach().to("cpu", self.out_dtype(tensor.dtype)).contiguous().clone()
        shard = self.owner[name]
        if all(n in self.pending for n in shard.names):
            path = os.path.join(self.directory, shard.file)
            save_file({n: self.pending.pop(n) for n in shard.names}, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)


def export_safetensors(model: nn.Module, directory: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       dtype: Optional[torch.dtype] = None, writer_rank: int = 0) -> Optional[ExportResult]:
    """Write ``model``'s parameters and persistent buffers to ``directory`` as safetensors
    (plus ``model.safetensors.index.json`` when there is more than one shard, and the
    Hugging Face ``config.json`` when the model has one). Collective: every rank calls it;
    ``writer_rank`` writes and gets the result, the others get None. See Note [bounded export].
    ``dtype`` casts floating tensors (e.g. torch.float32); None keeps the training dtype."""
    if max_shard_bytes <= 0:
        raise UsageError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    names = {}
    for name, p in model.named_parameters():  # deduplicated: a tied weight keeps its first name
        names.setdefault(p, name)
    buffers = _persistent_buffers(model)

    def out_dtype(t_dtype):
        return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype

    layout = untiled_layout(model)  # Note [untiled export] in _tiling.py
    by_name = {n: p for p, n in names.items()}
    order, tile_owner = untiled_names(list(by_name), layout)
    sizes = {n: _numel(layout[n]["shape"]) * _itemsize(out_dtype(by_name[layout[n]["parts"][0][0]].dtype))
             if n in layout else by_name[n].numel() * _itemsize(out_dtype(by_name[n].dtype)) for n in order}
    sizes.update({n: b.numel() * _itemsize(out_dtype(b.dtype)) for n, b in buffers.items()})
    shards = _plan(sizes, max_shard_bytes)
    sink = _ShardWriter(directory, shards, out_dtype) if comm.rank() == writer_rank else None
    _gather_into(model, names, layout, tile_owner, sink)
    if sink is not None:
        for name, buf in buffers.items():
            sink.take(name, buf)
        _write_index_and_config(model, directory, shards, sizes)
    comm.barrier()
    if sink is None:
        return None
    return ExportResult(directory, [s.file for s in shards], sum(sizes.values()), len(sizes))


def _gather_into(model: nn.Module, names: dict, layout: dict, tile_owner: dict, sink: Optional[_ShardWriter]) -> None:
    """Gather the parameters unit by unit (collectively, on every rank); the writer's ``sink``
    takes each one, a tile through the whole tensor it is a part of."""
    assembling: Dict[str, list] = {}  # untiled name -> [whole host tensor, tiles still to come]
    seen = set()
    for group in _groups(model):
        group = [p for p in group if p in names and p not in seen]
        if not group:
            continue
        with GatheredParameters(group) if engine_of(model) is not None else contextlib.nullcontext():
            if sink is not None:
                for p in group:
                    if names[p] in tile_owner:  # a tile: copied into its place in the whole tensor
                        _place(assembling, layout, tile_owner[names[p]], names[p], p, sink.out_dtype, sink.take)
                    else:
                        sink.take(names[p], p)
        seen.update(group)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _place(assembling: dict, layout: dict, whole: str, tile_name: str, tile: torch.Tensor, out_dtype, take) -> None:
    """Copy one gathered tile into the host tensor of its untiled parameter; hand that to
    ``take`` once its last tile is in (host memory: one tiled operator at a time)."""
    spec = layout[whole]
    if whole not in assembling:
        assembling[whole] = [torch.empty(spec["shape"], dtype=out_dtype(tile.dtype)), len(spec["parts"])]
    entry = assembling[whole]
    ranges = next(r for n, r in spec["parts"] if n == tile_name)
    entry[0][tuple(slice(lo, hi) for lo, hi in ranges)].copy_(tile.detach())
    entry[1] -= 1
    if entry[1] == 0:
        take(whole, assembling.pop(whole)[0])


def _write_index_and_config(model: nn.Module, directory: str, shards: List[_Shard], sizes: Dict[str, int]) -> None:
    index_path = os.path.join(directory, INDEX_FILE)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: s.file for s in shards for n in s.names}}
        with open(index_path + ".tmp", "w") as f:
            json.dump(index, f, indent=2)
        os.replace(index_path + ".tmp", index_path)
    elif os.path.exists(index_path):
        os.remove(index_path)  # a stale index from an earlier, larger export would mislead loaders
    current = {s.file for s in shards}
    for name in os.listdir(directory):  # weight files of an earlier export with another shard count
        if name not in current and (name == SINGLE_FILE or _SHARD_NAME.fullmatch(name)):
            os.remove(os.path.join(directory, name))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
