"""``python -m infinity.export CHECKPOINT OUT_DIR``: a checkpoint as a Hugging Face directory.

Note [streamed export]: the safetensors header is known from the manifest alone (names,
shapes, dtype), so each file's header is written first and then every tensor's bytes are
copied file to file from the ranks' shard files (a parameter's flat bytes are its chunks
of rank 0, 1, ... in order, the padding left out) through the fixed buffers of
``_checkpoint._io.Mover``: no tensor is ever assembled in memory, so peak memory is those
buffers plus the model's buffers, whatever the model size, and no process group is needed.
Every file of the checkpoint is verified against the manifest first (its kind, size and
checksum: Note [data, never code] in _checkpoint/_files.py), those the export does not read
too, so that an export vouches for the whole checkpoint. Writes ``model.safetensors`` or
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, the model's
``config.json`` / ``generation_config.json`` saved with the checkpoint, and tokenizer files
from ``--tokenizer DIR``. A tied weight is written once, under the name of the module that
owns it, which is the name Hugging Face keeps.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from typing import Dict, List, Optional, Tuple

import torch

from ._checkpoint._files import BUFFERS
from ._checkpoint._format import MANIFEST, CheckpointReader, itemsize, pieces, rank_file, resolve
from ._checkpoint._io import FileSink
from ._checkpoint._legacy import EXTRA, convert, is_legacy, load_pickle, refuse
from ._checkpoint._safetensors_export import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, _plan
from ._zero._tiling import untiled_names, untiled_pieces
from .errors import InfinityError, InsufficientResourcesError, UsageError

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")


__all__ = ["convert_checkpoint", "export_checkpoint", "main"]


def convert_checkpoint(checkpoint: str, *, trust_pickle: bool = False) -> List[str]:
    """Rewrite a checkpoint of format version 1 or 2 (whose extra.pt and rng.pt are pickles),
    or every one in a run's directory of them, in place as version 3, which holds no pickle
    (Note [data, never code] in _checkpoint/_files.py); return the paths converted. Reads the
    pickles, so it runs only with ``trust_pickle=True``: pass it only for checkpoints whose
    every writer you trust."""
    return convert(checkpoint, trust_pickle=trust_pickle)


def export_checkpoint(checkpoint: str, out_dir: str, *, weights: str = "params", tokenizer: Optional[str] = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, trust_pickle: bool = False) -> List[str]:
    """Write the checkpoint (a checkpoint directory, or a run's directory of them: its latest)
    to ``out_dir`` as a Hugging Face directory; return the weight files written. ``weights``:
    ``params`` (the compute-dtype weights the model trained with) or ``master`` (fp32 master
    weights; frozen parameters from their compute-dtype values). ``trust_pickle``: read a
    checkpoint of format version 1 or 2, whose extra.pt is a pickle (it runs whatever code it
    holds; ``convert_checkpoint`` converts one once). Note [streamed export]."""
    if weights not in ("params", "master"):
        raise UsageError(f"weights must be 'params' or 'master', got {weights!r}")
    path = checkpoint if os.path.exists(os.path.join(checkpoint, MANIFEST)) else resolve(checkpoint, None)
    reader = CheckpointReader(path)
    try:
        legacy = is_legacy(reader.manifest)
        if legacy and not trust_pickle:
            raise refuse(path, reader.manifest, "export")
        reader.verify(reader.manifest["files"])  # every file, before any is read
        tensors = _untiled(_sources(reader, weights), reader.manifest.get("tiled") or {})
        buffers = load_pickle(reader.file(EXTRA), trust_pickle=trust_pickle)["buffers"] if legacy else \
            reader.small(BUFFERS)[0]
        sizes = {n: t[2] * itemsize(t[1]) for n, t in tensors.items()}
        sizes.update({n: b.numel() * b.element_size() for n, b in buffers.items()})
        os.makedirs(out_dir, exist_ok=True)
        free = shutil.disk_usage(out_dir).free
        if free < sum(sizes.values()):
            raise InsufficientResourcesError(f"the export needs {sum(sizes.values())} bytes under {out_dir} and only "
                                             f"{free} are free; free space there or pass another OUT_DIR")
        shards = _plan(sizes, max_shard_bytes)
        for shard in shards:
            _write_shard(reader, os.path.join(out_dir, shard.file), shard.names, tensors, buffers)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {n: s.file for s in shards for n in s.names}}
            _write_text(os.path.join(out_dir, INDEX_FILE), json.dumps(index, indent=2))
        _copy_side_files(reader, out_dir, tokenizer)
        return [s.file for s in shards]
    finally:
        reader.close()


def _sources(reader: CheckpointReader, weights: str) -> Dict[str, Tuple[str, torch.dtype, int, list]]:
    """name -> (array, dtype, numel, pieces) of every parameter, verified files only."""
    out = {}
    for name, p in reader.params.items():
        array = "master" if weights == "master" and p["trainable"] else "params"
        dtype = torch.float32 if array == "master" else reader.dtype
        base = p["opt_offset"] if array == "master" else p["param_offset"]
        items = pieces(p, reader.world, base, 0, None, 0, itemsize(dtype))
        reader.verify(rank_file(k, array) for k, *_ in items)
        out[name] = (array, dtype, p["numel"], [(reader.file(rank_file(k, array)), src, n) for k, src, _, n in items])
    return out


def _untiled(tensors: dict, layout: dict) -> dict:
    """Note [untiled export] in _tiling.py: tiles written as the tensors they are parts of."""
    if not layout:
        return tensors
    order, owner = untiled_names(list(tensors), layout)
    out = {}
    for name in order:
        if name not in layout:
            out[name] = tensors[name]
            continue
        spec = layout[name]
        array, dtype, _, _ = tensors[spec["parts"][0][0]][:4]
        pieces_of = {part[0]: tensors[part[0]][3] for part in spec["parts"]}
        numel = 1
        for d in spec["shape"]:
            numel *= d
        out[name] = (array, dtype, numel, untiled_pieces(spec, pieces_of, itemsize(dtype)), tuple(spec["shape"]))
    return out


def _header(names: List[str], shapes: Dict[str, tuple]) -> bytes:
    """A safetensors header for these tensors in this order (data offsets contiguous)."""
    meta, at = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        dtype, shape, nbytes = shapes[name]
        meta[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_shard(reader, path: str, names: List[str], tensors: dict, buffers: dict) -> None:
    shapes = {}
    for n in names:
        if n in tensors:
            _, dtype, numel, _ = tensors[n][:4]
            shape = tensors[n][4] if len(tensors[n]) > 4 else reader.params[n]["shape"]
            shapes[n] = (dtype, shape, numel * itemsize(dtype))
        else:
            shapes[n] = (buffers[n].dtype, tuple(buffers[n].shape), buffers[n].numel() * buffers[n].element_size())
    tmp = path + ".tmp"
    sink = FileSink(tmp, reader.mover)
    head = _header(names, shapes)
    sink.append(torch.frombuffer(bytearray(head), dtype=torch.uint8), 0, len(head))
    for n in names:
        if n in tensors:
            for src, off, nbytes in tensors[n][3]:
                sink.append(src, off, nbytes)
        else:
            t = buffers[n].contiguous()
            sink.append(t, 0, t.numel() * t.element_size())
    sink.close()
    reader.mover.synced()
    os.replace(tmp, path)


def _write_text(path: str, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _copy_side_files(reader: CheckpointReader, out_dir: str, tokenizer: Optional[str]) -> None:
    for rel in [rel for rel in reader.manifest["files"] if rel.startswith("hf/")]:
        _write_bytes(os.path.join(out_dir, os.path.basename(rel)), reader.small_bytes(rel))  # the bytes verified
    if tokenizer is not None:
        found = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer, n))]
        if not found:
            raise UsageError(f"--tokenizer {tokenizer}: no tokenizer files there ({', '.join(TOKENIZER_FILES)})")
        for n in found:
            shutil.copyfile(os.path.join(tokenizer, n), os.path.join(out_dir, n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infinity.export",
                                description="Write an infinity checkpoint as a Hugging Face model directory, "
                                            "streamed with bounded memory, without a process group.")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run's directory of checkpoints (its latest)")
    p.add_argument("out_dir", nargs="?", help="the Hugging Face directory to write")
    p.add_argument("--weights", choices=("params", "master"), default="params",
                   help="params: the weights the model trained with (its compute dtype); master: fp32 master weights")
    p.add_argument("--tokenizer", help="a directory whose tokenizer files to copy along")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    p.add_argument("--trust-pickle", action="store_true",
                   help="read a checkpoint of format version 1 or 2, whose extra.pt and rng.pt are pickles: reading "
                        "them runs any code their writer put in them, so pass it only if you trust every writer")
    p.add_argument("--convert-old", action="store_true",
                   help="instead of exporting, rewrite CHECKPOINT (or every checkpoint of a run's directory) of "
                        "format version 1 or 2 in place as version 3, which holds no pickle; needs --trust-pickle")
    args = p.parse_args(argv)
    if args.convert_old == (args.out_dir is not None):
        p.error("pass OUT_DIR to export, or --convert-old without OUT_DIR to convert")
    try:
        if args.convert_old:
            done = convert_checkpoint(args.checkpoint, trust_pickle=args.trust_pickle)
            print(f"converted {len(done)} checkpoint(s) to format version 3" + "".join(f"\n  {d}" for d in done))
            return 0
        files = export_checkpoint(args.checkpoint, args.out_dir, weights=args.weights, tokenizer=args.tokenizer,
                                  max_shard_bytes=args.max_shard_bytes, trust_pickle=args.trust_pickle)
    except InfinityError as err:
        print(f"infinity.export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} safetensors file(s) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
