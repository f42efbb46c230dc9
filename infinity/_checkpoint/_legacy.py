"""Checkpoints of format versions 1 and 2, whose ``extra.pt`` and ``rank<r>/rng.pt`` are pickles.

Reading a pickle runs whatever its writer put in it (Note [data, never code] in _files.py), so
this module is the one place in infinity that unpickles, and only where the caller said
``trust_pickle=True`` (``--trust-pickle`` on the command lines): ``load_pickle`` is called by
nothing else. ``convert`` rewrites such a checkpoint in place as version 3 once, after which it
loads with no opt-in: the pickles are read (trusted) and their contents written as JSON and
safetensors, the manifest replaced atomically (a crash before that leaves the old checkpoint as
it was), then the pickles removed.
"""
from __future__ import annotations

import json
import os
from typing import Any, List

import torch

from ..errors import UsageError
from ._files import BUFFERS, RNG, client_state_files, rng_bytes, tensor_bytes, write_small
from ._format import MANIFEST, VERSION, CheckpointReader, complete_checkpoints, read_manifest, write_atomic

EXTRA, OLD_RNG = "extra.pt", "rng.pt"  # a version 1 or 2 checkpoint's pickles
TRUST_PICKLE = ("trust_pickle=True reads a checkpoint of format version 1 or 2, whose extra.pt and "
                "rank<r>/rng.pt are pickles: reading them runs any code their writer put in them")


def is_legacy(manifest: dict) -> bool:
    return manifest["version"] < VERSION


def refuse(path: str, manifest: dict, what: str) -> UsageError:
    """The refusal of an old checkpoint read without ``trust_pickle=True``, with the remedies."""
    return UsageError(
        f"{what}: checkpoint {path} is format version {manifest['version']}, which holds pickles (extra.pt, "
        f"rank<r>/rng.pt): reading them runs any code their writer put in them, so infinity reads them only when "
        f"told to. If you trust whoever could write that directory, convert it once with `python -m infinity.export "
        f"--convert-old {path} --trust-pickle` (then it loads as any other), or pass trust_pickle=True "
        f"(--trust-pickle on infinity.train and infinity.export) to read it as it is")


def load_pickle(path: str, *, trust_pickle: bool) -> Any:
    """The one unpickling read in infinity: an old checkpoint's ``extra.pt`` / ``rng.pt``,
    verified against the manifest by the caller first."""
    if trust_pickle is not True:
        raise UsageError(f"{path} is a pickle; pass trust_pickle=True to read it ({TRUST_PICKLE})")
    return torch.load(path, weights_only=False)


def convert(checkpoint: str, *, trust_pickle: bool = False) -> List[str]:
    """Rewrite every checkpoint of format version 1 or 2 at ``checkpoint`` (one checkpoint, or
    a run's directory of them) as version 3; return the paths converted."""
    if trust_pickle is not True:
        raise UsageError(f"converting {checkpoint} reads its pickles: pass trust_pickle=True (--trust-pickle) if "
                         f"you trust whoever could write it ({TRUST_PICKLE})")
    paths = [checkpoint] if os.path.exists(os.path.join(checkpoint, MANIFEST)) else \
        [os.path.join(checkpoint, tag) for _, tag in complete_checkpoints(checkpoint)]
    if not paths:
        raise UsageError(f"no checkpoint at {checkpoint}: pass a checkpoint directory or a run's directory of them")
    return [p for p in paths if is_legacy(read_manifest(p)) and _convert_one(p)]


def _convert_one(path: str) -> bool:
    reader = CheckpointReader(path)
    try:
        files = dict(reader.manifest["files"])
        reader.verify(files)  # every file, pickles included, is the one the manifest describes
        saved = load_pickle(reader.file(EXTRA), trust_pickle=True)
        try:
            new = client_state_files(saved["extra"])
        except UsageError as e:
            raise UsageError(f"cannot convert {path}: {e}. Load it with trust_pickle=True and save it again with a "
                             f"client_state of data instead") from None
        new[BUFFERS] = tensor_bytes(saved["buffers"])
        rngs = [f"rank{r}/{OLD_RNG}" for r in range(reader.world)]
        for r, rel in enumerate(rngs):
            new[f"rank{r}/{RNG}"] = rng_bytes(load_pickle(reader.file(rel), trust_pickle=True))
    finally:
        reader.close()
    for rel, data in new.items():
        files[rel] = write_small(os.path.join(path, rel), data)
    for rel in [EXTRA] + rngs:
        del files[rel]
    manifest = dict(reader.manifest, version=VERSION, files=dict(sorted(files.items())))
    write_atomic(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1), "convert")
    for rel in [EXTRA] + rngs:
        os.remove(os.path.join(path, rel))
    return True
