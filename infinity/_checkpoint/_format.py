"""The checkpoint format on disk, readable without a process group.

Note [checkpoint layout]: format "infinity-checkpoint", version 3 (Note [manifest versions]).
A run's directory holds one subdirectory per tag and a ``latest`` file naming the newest
complete one:

    <dir>/latest                      the tag of the newest complete checkpoint (one line)
    <dir>/<tag>/manifest.json         written last: what is below, every file's size and CRC-32
                                      ("crc32"; "crc32c" for a file cloned from a swap file)
    <dir>/<tag>/rank<r>/params.bin    rank r's compute-dtype shards, the parameter store's flat
                                      space (every unit, frozen ones too)
    <dir>/<tag>/rank<r>/master.bin    rank r's fp32 master weights, the optimizer's flat space
    <dir>/<tag>/rank<r>/exp_avg.bin   ... the first Adam moments, same offsets
    <dir>/<tag>/rank<r>/exp_avg_sq.bin  ... the second moments, same offsets
    <dir>/<tag>/rank<r>/rng.safetensors  rank r's RNG states (torch, its device, python, numpy)
    <dir>/<tag>/client_state.json     the caller's ``client_state`` (rank 0), its tensors in
    <dir>/<tag>/client_state.safetensors
    <dir>/<tag>/buffers.safetensors   the model's persistent buffers (rank 0)
    <dir>/<tag>/hf/                   the Hugging Face config files (JSON) of the model, if it has them

Nothing else: every file is raw flat bytes, JSON or safetensors (Note [data, never code] in
_files.py), and a reader refuses a file the manifest lists that is of no such kind, or a flat
file whose size is not the one the layout gives it. Every flat space is the shard layout (Note
[shard layout] in _unit.py): a parameter of ``numel`` elements is padded to ``chunk *
world_size`` and rank r holds elements [r * chunk, (r + 1) * chunk) of it at the same offset
in every rank's file (``param_offset`` in params.bin, ``opt_offset`` in the fp32 files; frozen
parameters have no ``opt_offset``). The manifest lists every parameter (name, shape, numel,
chunk, offsets, its own step count and parameter group), so a loader at any world size
computes the global element range each of its new chunks needs and reads it from the ranks
that hold it (``pieces``); the placement (device, cpu, nvme) only decides where the bytes go.

Note [manifest versions]: version 1 gives every file a CRC-32 (``crc32``). Version 2 lets a
file give a CRC32C (``crc32c``) instead: a file cloned from a swap file (Note [cloned
checkpoints] in _clone.py), whose checksum comes from the swap file's CRC32C block sums; a
reader of version 1 only refuses it by its version instead of failing on a missing key.
Versions 1 and 2 hold the client state, the buffers and the RNG states as pickles
(``extra.pt``, ``rank<r>/rng.pt``). Version 3 holds no pickle (Note [data, never code] in
_files.py) and may give CRC32Cs as version 2 does; every save writes it, since a reader of
version 1 or 2 would look for the pickles. A reader accepts the versions in ``VERSIONS`` and
refuses any other, naming it and the release to upgrade to; versions 1 and 2 it reads only
with ``trust_pickle=True`` (``_legacy.py``), or once converted to version 3.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..aio._checksum import BLOCK
from ..errors import StorageError, UsageError
from ._files import BUFFERS, CLIENT_JSON, CLIENT_TENSORS, parse_kind, read_checked
from ._io import Mover, check_file, copy_into

FORMAT = "infinity-checkpoint"
VERSION = 3  # the manifest version a save writes (Note [manifest versions])
VERSIONS = (1, 2, 3)  # the manifest versions this infinity reads (1 and 2 only with trust_pickle=True)
MANIFEST, LATEST = "manifest.json", "latest"
STATE_ARRAYS = ("master", "exp_avg", "exp_avg_sq")  # fp32, the optimizer's flat space
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
_RANK_FILE = re.compile(r"rank(0|[1-9][0-9]*)/([a-z_]+)\.(bin|safetensors|pt)")
_HF_FILE = re.compile(r"hf/[\w.-]+\.json")


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
        with open(os.path.join(directory, LATEST), "rb") as f:
            line = f.read(4096)
        try:
            name = line.decode().strip()
        except UnicodeDecodeError:
            raise UsageError(f"{os.path.join(directory, LATEST)} does not name a checkpoint tag (it is not text); "
                             f"pass tag= to choose one, or remove it to load the newest complete one") from None
        try:
            return os.path.join(directory, check_tag(name))
        except UsageError as e:
            raise UsageError(f"{os.path.join(directory, LATEST)} does not name a checkpoint: {e}") from None
    except FileNotFoundError:
        found = complete_checkpoints(directory)
        if not found:
            raise UsageError(f"no complete checkpoint in {directory}: save one with infinity.save_checkpoint "
                             f"or pass the directory that holds the run's checkpoints") from None
        return os.path.join(directory, found[-1][1])


def pieces(param: dict, world: int, base: int, new_shard: int, new_rank: Optional[int], new_base: int,
           size: int) -> List[Tuple[int, int, int, int]]:
    """(source rank, source byte offset, destination byte offset, bytes) that fill a
    parameter's new shard ``new_rank`` (None: the whole parameter, from element 0) from a
    checkpoint saved at ``world`` ranks, where the parameter starts at element ``base`` of
    every rank's file and at ``new_base`` of the destination; ``size`` bytes per element."""
    numel, shard = param["numel"], param["chunk"]  # the manifest's name for the elements of a rank's shard
    lo, hi = (0, numel) if new_rank is None else (new_rank * new_shard, min(numel, (new_rank + 1) * new_shard))
    start = 0 if new_rank is None else lo
    out = []
    for k in range(lo // shard if shard else 0, world):
        a, b = max(lo, k * shard), min(hi, (k + 1) * shard)
        if a >= b:
            break
        out.append((k, (base + a - k * shard) * size, (new_base + a - start) * size, (b - a) * size))
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


def over_parts(dest, items: List[Tuple[int, int, int, int]], size: int) -> List[tuple]:
    """(destination, items) for each part of ``dest``: a state split over tiers (Note [split
    tiers] in _offload/_split.py) is a list of (tensor or swap file, elements), one after the
    other in the flat space; each item cut where a part ends, its destination offset made the
    part's own. Any other ``dest`` is one part."""
    if not isinstance(dest, list):
        return [(dest, items)]
    out, start = [], 0
    for place, numel in dest:
        end = start + numel * size
        mine = [(k, src + max(0, start - dst), max(dst, start) - start, min(dst + n, end) - max(dst, start))
                for k, src, dst, n in items if dst < end and dst + n > start]
        out.append((place, mine))
        start = end
    return out


class CheckpointReader:
    """A checkpoint on disk, read tensor by tensor without a process group (export, tools)."""

    def __init__(self, path: str, mover: Optional[Mover] = None):
        self.path = os.fspath(path)
        self.manifest = read_manifest(self.path)
        self.world = self.manifest["world_size"]
        self.dtype = DTYPES[self.manifest["dtype"]]
        self.params: Dict[str, dict] = {p["name"]: p for p in self.manifest["params"]}
        self.mover = mover or Mover()
        self.version = self.manifest["version"]
        self._checked: set = set()
        self._small: Dict[str, tuple] = {}
        self.blocks: Dict[str, np.ndarray] = {}

    def file(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def verify(self, rels, blocks_of=()) -> None:
        """Check these files (relative paths), each once, before anything reads them: their kind
        and, for a flat file, its size as the layout gives it; then their size and checksum
        against the manifest; a small file is parsed too (``small``). For those in ``blocks_of``
        also keep their 4 KiB blocks' CRC32Cs (``self.blocks``), for a clone back (Note [cloned
        checkpoints] in _clone.py)."""
        files = self.manifest["files"]
        for rel in sorted(set(rels) - self._checked):
            if rel not in files:
                raise StorageError(f"{self.file(MANIFEST)} lists no file {rel}: the checkpoint is incomplete")
            kind = self.kind(rel)
            if kind == "small":
                self.small(rel)
                continue
            if kind == "flat" and files[rel]["bytes"] != self.flat_bytes(rel):
                raise StorageError(f"checkpoint file {self.file(rel)}: the manifest says {files[rel]['bytes']} bytes, "
                                   f"the layout it describes {self.flat_bytes(rel)}: the checkpoint was changed; load "
                                   f"another tag or the previous checkpoint")
            blocks = np.zeros(-(-files[rel]["bytes"] // BLOCK), dtype=np.uint32) if rel in blocks_of else None
            check_file(self.mover, self.file(rel), files[rel], blocks)
            if blocks is not None:
                self.blocks[rel] = blocks
            self._checked.add(rel)

    def kind(self, rel: str) -> str:
        """"flat", "small" (JSON, safetensors) or "pickle" (versions 1 and 2 only); StorageError
        for a file no checkpoint of this version holds (Note [checkpoint layout])."""
        m = _RANK_FILE.fullmatch(rel)
        if m is not None and int(m.group(1)) < self.world:
            if m.group(2) in ("params",) + STATE_ARRAYS and m.group(3) == "bin":
                return "flat"
            if (m.group(2), m.group(3)) == ("rng", "safetensors" if self.version >= VERSION else "pt"):
                return "small" if self.version >= VERSION else "pickle"
        if _HF_FILE.fullmatch(rel) or (self.version >= VERSION and rel in (CLIENT_JSON, CLIENT_TENSORS, BUFFERS)):
            return "small"
        if self.version < VERSION and rel == "extra.pt":
            return "pickle"
        raise StorageError(f"{self.file(MANIFEST)} lists {rel!r}, which no checkpoint of format version "
                           f"{self.version} holds (Note [checkpoint layout] in _checkpoint/_format.py): the manifest "
                           f"was changed or is not infinity's; load another tag or the previous checkpoint")

    def flat_bytes(self, rel: str) -> int:
        """The size of a flat file, from the layout the manifest records."""
        if rel.endswith("/params.bin"):
            return self.manifest["param_total"] * itemsize(self.dtype)
        return self.manifest["opt_total"] * 4

    def small(self, rel: str):
        """The small file ``rel`` parsed (JSON: its value; safetensors: (tensors, metadata)),
        read once into memory and checked against the manifest on those bytes before it is
        parsed (Note [data, never code] in _files.py)."""
        if rel not in self._small:
            if self.kind(rel) != "small":
                raise StorageError(f"checkpoint file {self.file(rel)} is not JSON or safetensors")
            if rel not in self.manifest["files"]:
                raise StorageError(f"{self.file(MANIFEST)} lists no file {rel}: the checkpoint is incomplete")
            data = read_checked(self.file(rel), self.manifest["files"][rel])
            self._small[rel] = (data, parse_kind(rel, data, self.file(rel)))
            self._checked.add(rel)
        return self._small[rel][1]

    def small_bytes(self, rel: str) -> bytes:
        """The checked bytes of the small file ``rel`` (``small``), e.g. to copy them."""
        self.small(rel)
        return self._small[rel][0]

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
