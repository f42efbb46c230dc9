"""The small files of a checkpoint: JSON and safetensors only, each verified before it is parsed.

Note [data, never code]: a checkpoint travels (a colleague's run, a shared cluster directory,
an upload), and a pickle runs whatever its writer put in it the moment it is read, before any
check of what it holds can refuse it. So since format version 3 (Note [manifest versions] in
_format.py) every file a checkpoint holds is data that a reader parses without running any of
it: the flat shard files (raw bytes at the layout's offsets, whose sizes the manifest's layout
fixes), JSON (the manifest, ``client_state.json``, the Hugging Face config files under
``hf/``) or safetensors (``client_state.safetensors``, ``buffers.safetensors``,
``rank<r>/rng.safetensors``: a JSON header and raw tensor bytes). ``client_state`` is what
JSON and tensors can hold: dicts with str keys, lists, str, int, float, bool, None and
tensors, plus tuples and dicts with int keys, written as tagged JSON objects so that they come
back as they went in; a tensor is a reference into ``client_state.safetensors`` and comes back
on the CPU. Anything else (an object, a function, a numpy value) is refused at the call, naming
its key path and type, before anything is written. The RNG states are uint8 tensors with their
few scalars as JSON in the header's metadata. Every file is read whole into memory, its size
and checksum compared with the manifest's on those very bytes, and only then parsed: a
changed file is refused by name, and what is parsed is what was checked. Checkpoints of
versions 1 and 2 hold two pickles (``extra.pt``, ``rank<r>/rng.pt``); they are read only
with ``trust_pickle=True``, in one place (``_legacy.py``), or converted once to version 3
(``python -m infinity.export --convert-old DIR --trust-pickle``).
"""
from __future__ import annotations

import json
import os
import random
import struct
import zlib
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .._runtime import _accelerator as acc
from ..errors import StorageError, UsageError
from ._io import crc32c_of, fsync_path

CLIENT_JSON, CLIENT_TENSORS, BUFFERS = "client_state.json", "client_state.safetensors", "buffers.safetensors"
RNG = "rng.safetensors"  # rank<r>/rng.safetensors
TAG = "__infinity__"  # the key of a tagged JSON object (a tensor, a tuple, a dict with int keys)
_PLAIN = (str, int, float, bool, type(None))


# ---------------------------------------------------------------- client state


def encode_client_state(value: Any) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(JSON tree, {key: tensor}) of ``value`` (Note [data, never code]), or UsageError naming
    the first value a checkpoint cannot hold. The tensors are the caller's, not copies."""
    tensors: Dict[str, torch.Tensor] = {}
    return _encode(value, "client_state", tensors), tensors


def _encode(v: Any, path: str, tensors: Dict[str, torch.Tensor]) -> Any:
    if type(v) in _PLAIN:
        return v
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_quantized or v.is_complex():
            raise _refused(path, f"a {v.layout} {v.dtype} tensor", "a dense real tensor")
        key = str(len(tensors))
        tensors[key] = v
        return {TAG: "tensor", "key": key}
    if type(v) is list:
        return [_encode(x, f"{path}[{i}]", tensors) for i, x in enumerate(v)]
    if type(v) is tuple:
        return {TAG: "tuple", "items": [_encode(x, f"{path}[{i}]", tensors) for i, x in enumerate(v)]}
    if type(v) is dict:
        if all(type(k) is str for k in v):
            if TAG in v:
                raise UsageError(f"save_checkpoint: {path} has the key {TAG!r}, which the checkpoint format "
                                 f"reserves (Note [data, never code] in _checkpoint/_files.py); rename that key")
            return {k: _encode(x, f"{path}[{k!r}]", tensors) for k, x in v.items()}
        for k in v:
            if type(k) not in (str, int):
                raise _refused(f"{path} key {k!r}", f"a {type(k).__qualname__}", "a str or int key")
        return {TAG: "dict", "items": [[k, _encode(x, f"{path}[{k!r}]", tensors)] for k, x in v.items()]}
    kind = "a function" if callable(v) else f"a {type(v).__module__}.{type(v).__qualname__}"
    raise _refused(path, kind, "JSON values (dict, list, str, int, float, bool, None), tuples and tensors")


def _refused(path: str, kind: str, what: str) -> UsageError:
    return UsageError(f"save_checkpoint: {path} is {kind}; a checkpoint holds data, never code (no pickle: Note "
                      f"[data, never code] in _checkpoint/_files.py), so client_state may hold only {what}: save "
                      f"its state instead (e.g. obj.state_dict(), int(x), torch.from_numpy(a))")


def decode_client_state(tree: Any, tensors: Dict[str, torch.Tensor], where: str) -> Any:
    """The value ``encode_client_state`` was given, from the files read at ``where``."""
    if isinstance(tree, list):
        return [decode_client_state(x, tensors, where) for x in tree]
    if not isinstance(tree, dict):
        return tree
    tag = tree.get(TAG)
    if tag is None:
        return {k: decode_client_state(x, tensors, where) for k, x in tree.items()}
    try:
        if tag == "tensor":
            return tensors[tree["key"]]
        if tag == "tuple":
            return tuple(decode_client_state(x, tensors, where) for x in tree["items"])
        if tag == "dict":
            return {k: decode_client_state(x, tensors, where) for k, x in tree["items"]}
    except (KeyError, TypeError, ValueError) as e:
        raise StorageError(f"{where}: a {tag} entry is malformed ({type(e).__name__}: {e}); the file was "
                           f"changed: load another tag or the previous checkpoint") from None
    raise StorageError(f"{where}: unknown entry kind {tag!r}; upgrade infinity to the release that wrote it")


def client_state_files(value: Any) -> Dict[str, bytes]:
    """{file: bytes} of the client state (rank 0 writes them)."""
    tree, tensors = encode_client_state(value)
    return {CLIENT_JSON: json.dumps(tree, indent=1).encode(), CLIENT_TENSORS: tensor_bytes(tensors)}


# ---------------------------------------------------------------- RNG states


def current_rng() -> dict:
    """This rank's RNG states now: torch's, its device's, python's and numpy's."""
    return {"torch": torch.get_rng_state(), "cuda": acc.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def rng_bytes(states: dict) -> bytes:
    """RNG states (``current_rng``'s, or a version 1 or 2 ``rng.pt``'s) as a safetensors
    file: the generators' states as uint8 tensors, their scalars as JSON in the metadata."""
    version, words, gauss = states["python"]
    kind, keys, pos, has_gauss, cached = states["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    tensors = {"torch": states["torch"], "python": _u8(np.asarray(words, dtype="<u4")),
               "numpy": _u8(np.asarray(keys, dtype="<u4"))}
    device = states.get("cuda")
    if isinstance(device, (list, tuple)):  # version 1: every visible GPU's
        tensors.update((f"device.{i}", t) for i, t in enumerate(device))
    elif device is not None:
        tensors["device"] = device
    meta = {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensor_bytes(tensors, {"states": json.dumps(meta)})


def rng_states(tensors: Dict[str, torch.Tensor], meta: Dict[str, str], where: str) -> dict:
    """The states ``rng_bytes`` saved, as ``set_rng`` takes them."""
    try:
        scalars = json.loads(meta["states"])
        version, gauss = scalars["python"]
        kind, pos, has_gauss, cached = scalars["numpy"]
        words = tuple(int(w) for w in _words(tensors["python"]))
        devices = sorted((int(k.split(".")[1]), t) for k, t in tensors.items() if k.startswith("device."))
        device = [t for _, t in devices] if devices else tensors.get("device")
        return {"torch": tensors["torch"], "cuda": device, "python": (version, words, gauss),
                "numpy": (kind, torch.from_numpy(_words(tensors["numpy"]).copy()), pos, has_gauss, cached)}
    except (KeyError, TypeError, ValueError) as e:
        raise StorageError(f"{where} does not hold the RNG states this infinity saves ({type(e).__name__}: {e}); "
                           f"the file was changed: load another tag or the previous checkpoint") from None


def set_rng(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    acc.set_rng_state(_own_device_state(states.get("cuda")))
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))


def _own_device_state(state):
    """This rank's device generator: one state, that of the rank's own device; checkpoints of
    version 1 may hold every visible GPU's (take this rank's)."""
    if isinstance(state, (list, tuple)):
        index = acc.device().index or 0
        return state[index] if index < len(state) else None
    return state


def _u8(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy())


def _words(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view("<u4")


# ---------------------------------------------------------------- files


def tensor_bytes(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """A safetensors file of host copies of ``tensors`` (a tensor shared twice is stored twice)."""
    host = {k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}
    return st_save(host, metadata=metadata)


def write_small(path: str, data: bytes) -> dict:
    """Write ``data`` as ``path``, fsynced; its manifest entry (bytes, CRC-32)."""
    with open(path, "wb") as f:
        f.write(data)
    fsync_path(path)
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def read_checked(path: str, entry: dict) -> bytes:
    """The bytes of ``path``, read once and checked against the manifest ``entry`` (size and
    CRC-32 or CRC32C) before anything parses them; StorageError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(entry["bytes"] + 1)
    except OSError as e:
        raise StorageError(e.errno, f"checkpoint file {path} is missing or unreadable ({e.strerror}); the "
                                    f"checkpoint is incomplete: load another tag or the previous checkpoint") from e
    if len(data) != entry["bytes"]:
        raise StorageError(f"checkpoint file {path} has {os.path.getsize(path)} bytes, the manifest says "
                           f"{entry['bytes']}: the file is truncated or was changed; load another tag or the "
                           f"previous checkpoint")
    kind = "crc32c" if "crc32c" in entry else "crc32"
    if kind == "crc32":
        got = zlib.crc32(data)
    else:  # a small file is never cloned, but the manifest may say so (Note [manifest versions] in _format.py)
        got = crc32c_of(torch.frombuffer(bytearray(data), dtype=torch.uint8)) if data else 0
    if got != entry[kind]:
        raise StorageError(f"checkpoint file {path} fails its checksum ({kind} {got:08x}, the manifest says "
                           f"{entry[kind]:08x}): its contents are corrupt; load another tag or the previous checkpoint")
    return data


def parse_json(data: bytes, path: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise StorageError(f"checkpoint file {path} is not JSON ({e}): it was changed or is not infinity's; "
                           f"load another tag or the previous checkpoint") from None


def parse_tensors(data: bytes, path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, header metadata) of a safetensors file's bytes; parsing runs none of them."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        return st_load(data), meta
    except (struct.error, UnicodeDecodeError, ValueError, AttributeError, SafetensorError) as e:
        raise StorageError(f"checkpoint file {path} is not a safetensors file ({type(e).__name__}: {e}): it was "
                           f"changed or is not infinity's; load another tag or the previous checkpoint") from None


def parse_kind(rel: str, data: bytes, path: str) -> Any:
    """``data`` parsed as what the file ``rel`` is: JSON or safetensors."""
    if rel.endswith(".json"):
        return parse_json(data, path)
    if rel.endswith(".safetensors"):
        return parse_tensors(data, path)
    raise StorageError(f"checkpoint file {path} is of no kind this format holds")
