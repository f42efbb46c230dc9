"""The checkpoint format on disk, readable without a process group.

Note [checkpoint layout]: format "infinity-checkpoint", versions 1 and 2 (Note [manifest
versions]). A run's directory holds one subdirectory per tag and a ``latest`` file naming the
newest complete one:

    <dir>/latest                      the tag of the newest complete checkpoint (one line)
    <dir>/<tag>/manifest.json         written last: what is below, every file's size and CRC-32
                                      ("crc32"; "crc32c" for a file cloned from a swap file)
    <dir>/<tag>/rank<r>/params.bin    rank r's compute-dtype shards, the parameter store's flat
                                      space (every unit, frozen ones too)
    <dir>/<tag>/rank<r>/master.bin    rank r's fp32 master weights, the optimizer's flat space
    <dir>/<tag>/rank<r>/exp_avg.bin   ... the first Adam moments, same offsets
    <dir>/<tag>/rank<r>/exp_avg_sq.bin  ... the second moments, same offsets
    <dir>/<tag>/rank<r>/rng.pt        rank r's RNG states (torch, cuda, python, numpy)
    <dir>/<tag>/extra.pt              the caller's ``client_state`` and the model's buffers (rank 0)
    <dir>/<tag>/hf/                   the Hugging Face config files of the model, if it has them

Every flat space is the shard layout (Note [shard layout] in _unit.py): a parameter of
``numel`` elements is padded to ``chunk * world_size`` and rank r holds elements
[r * chunk, (r + 1) * chunk) of it at the same offset in every rank's file
(``param_offset`` in params.bin, ``opt_offset`` in the fp32 files; frozen parameters have
no ``opt_offset``). The manifest lists every parameter (name, shape, numel, chunk, offsets,
its own step count and parameter group), so a loader at any world size computes the global
element range each of its new chunks needs and reads it from the ranks that hold it
(``pieces``); the placement (device, cpu, nvme) only decides where the bytes go.

Note [manifest versions]: version 1 gives every file a CRC-32 (``crc32``). Version 2 lets a
file give a CRC32C (``crc32c``) instead: a file cloned from a swap file (Note [cloned
checkpoints] in _clone.py), whose checksum comes from the swap file's CRC32C block sums. A
CRC-32 is another polynomial and cannot be derived from those sums without reading the file,
the very write-sized cost a clone avoids, so an infinity that reads only version 1 (it reads
``entry["crc32"]``) cannot verify a cloned file. The manifest says version 2 for it, and such a
reader refuses the checkpoint naming the version instead of failing on a missing key. A save
writes the lowest version that describes its files (``manifest_version``): a checkpoint whose
files were all copied is version 1 and loads in older releases as well. A reader accepts the
versions in ``VERSIONS`` and refuses any other, naming it and the release to upgrade to.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..aio._checksum import BLOCK
from ..errors import StorageError, UsageError
from ._io import Mover, check_file, copy_into

FORMAT = "infinity-checkpoint"
VERSIONS = (1, 2)  # the manifest versions this infinity reads (Note [manifest versions])
MANIFEST, LATEST = "manifest.json", "latest"
STATE_ARRAYS = ("master", "exp_avg", "exp_avg_sq")  # fp32, the optimizer's flat space
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def rank_file(rank: int, array: str) -> str:
    return f"rank{rank}/{array}.bin"


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str, token: str) -> None:
    """Replace ``path`` with ``text``: written aside, fsynced, renamed, the directory fsynced."""
    tmp = f"{path}.tmp-{token}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (LATEST, ".", "..") or tag.startswith(".") or os.sep in tag or "/" in tag:
        raise UsageError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', not starting with '.', "
                         f"not {LATEST!r}); pass e.g. tag='step100'")
    return tag


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint directory ``path``, or StorageError saying what is wrong."""
    where = os.path.join(path, MANIFEST)
    try:
        with open(where) as f:
            manifest = json.load(f)
    except FileNotFoundError as e:
        raise StorageError(e.errno, f"{where} does not exist: {path} is not a complete infinity checkpoint "
                                    f"(a save that did not finish leaves no manifest); load another tag") from e
    except (OSError, ValueError) as e:
        raise StorageError(f"cannot read the checkpoint manifest {where}: {e}") from e
    if manifest.get("format") != FORMAT:
        raise StorageError(f"{where} is not an infinity checkpoint manifest (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if version not in VERSIONS:
        raise StorageError(f"{where} has format version {version!r}; this infinity reads versions "
                           f"{', '.join(map(str, VERSIONS))}: upgrade infinity to the release that wrote it, "
                           f"or newer, to load it (Note [manifest versions])")
    return manifest


def manifest_version(files: dict) -> int:
    """The lowest version that describes these manifest entries (Note [manifest versions])."""
    return 2 if any("crc32c" in entry for entry in files.values()) else 1


def complete_checkpoints(directory: str) -> List[Tuple[float, str]]:
    """(saved_at, tag) of every complete checkpoint under ``directory``, oldest first."""
    out = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith(".") or name == LATEST:
            continue
        try:
            out.append((float(read_manifest(os.path.join(directory, name))["saved_at"]), name))
        except (StorageError, KeyError, TypeError, ValueError):
            continue
    return sorted(out)


def resolve(directory: str, tag: Optional[str]) -> str:
    """The path of checkpoint ``tag`` under ``directory``; tag None: the one ``latest`` names,
    or, when there is no ``latest`` file, the newest complete one."""
    directory = os.fspath(directory)
    if tag is not None:
        path = os.path.join(directory, check_tag(tag))
        if not os.path.isdir(path):
            found = [t for _, t in complete_checkpoints(directory)]
            raise UsageError(f"no checkpoint {tag!r} in {directory} (complete ones there: {found or 'none'})")
        return path
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return os.path.join(directory, check_tag(f.read().strip()))
    except FileNotFoundError:
        found = complete_checkpoints(directory)
        if not found:
            raise UsageError(f"no complete checkpoint in {directory}: save one with infinity.save_checkpoint "
                             f"or pass the directory that holds the run's checkpoints") from None
        return os.path.join(directory, found[-1][1])


def pieces(param: dict, world: int, base: int, new_chunk: int, new_rank: Optional[int], new_base: int,
           size: int) -> List[Tuple[int, int, int, int]]:
    """(source rank, source byte offset, destination byte offset, bytes) that fill a
    parameter's new chunk ``new_rank`` (None: the whole parameter, from element 0) from a
    checkpoint saved at ``world`` ranks, where the parameter starts at element ``base`` of
    every rank's file and at ``new_base`` of the destination; ``size`` bytes per element."""
    numel, chunk = param["numel"], param["chunk"]
    lo, hi = (0, numel) if new_rank is None else (new_rank * new_chunk, min(numel, (new_rank + 1) * new_chunk))
    start = 0 if new_rank is None else lo
    out = []
    for k in range(lo // chunk if chunk else 0, world):
        a, b = max(lo, k * chunk), min(hi, (k + 1) * chunk)
        if a >= b:
            break
        out.append((k, (base + a - k * chunk) * size, (new_base + a - start) * size, (b - a) * size))
    return out


def merged(items: List[Tuple[int, int, int, int]]) -> List[Tuple[int, int, int, int]]:
    """Consecutive pieces that continue each other in source and destination, as one."""
    out: List[list] = []
    for k, src, dst, n in items:
        if out and out[-1][0] == k and out[-1][1] + out[-1][3] == src and out[-1][2] + out[-1][3] == dst:
            out[-1][3] += n
        else:
            out.append([k, src, dst, n])
    return [tuple(x) for x in out]


class CheckpointReader:
    """A checkpoint on disk, read tensor by tensor without a process group (export, tools)."""

    def __init__(self, path: str, mover: Optional[Mover] = None):
        self.path = os.fspath(path)
        self.manifest = read_manifest(self.path)
        self.world = self.manifest["world_size"]
        self.dtype = DTYPES[self.manifest["dtype"]]
        self.params: Dict[str, dict] = {p["name"]: p for p in self.manifest["params"]}
        self.mover = mover or Mover()
        self._checked: set = set()
        self.blocks: Dict[str, np.ndarray] = {}

    def file(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def verify(self, rels, blocks_of=()) -> None:
        """Check the size and checksum of these files (relative paths), each once; for those
        in ``blocks_of`` also keep their 4 KiB blocks' CRC32Cs (``self.blocks``), for a clone
        back (Note [cloned checkpoints] in _clone.py)."""
        files = self.manifest["files"]
        for rel in sorted(set(rels) - self._checked):
            if rel not in files:
                raise StorageError(f"{self.file(MANIFEST)} lists no file {rel}: the checkpoint is incomplete")
            blocks = np.zeros(-(-files[rel]["bytes"] // BLOCK), dtype=np.uint32) if rel in blocks_of else None
            check_file(self.mover, self.file(rel), files[rel], blocks)
            if blocks is not None:
                self.blocks[rel] = blocks
            self._checked.add(rel)

    def read(self, name: str, array: str = "params") -> torch.Tensor:
        """The whole parameter ``name`` (shape as saved) from ``array``: params (compute
        dtype) or one of STATE_ARRAYS (fp32)."""
        p = self.params[name]
        dtype = self.dtype if array == "params" else torch.float32
        base = p["param_offset"] if array == "params" else p["opt_offset"]
        if base is None:
            raise UsageError(f"{name} is frozen in this checkpoint: it has no {array}")
        out = torch.empty(p["numel"], dtype=dtype)
        items = pieces(p, self.world, base, 0, None, 0, itemsize(dtype))
        self.verify(rank_file(k, array) for k, *_ in items)
        copy_into(self.mover, [(self.file(rank_file(k, array)), src, n) for k, src, _, n in items], out,
                  [dst for _, _, dst, _ in items])
        return out.view(p["shape"])

    def close(self) -> None:
        self.mover.close()


def now() -> float:
    return time.time()
