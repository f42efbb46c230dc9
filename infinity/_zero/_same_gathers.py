"""The cross-rank check that every rank gathered the same units (stage 3).

Note [same gathers on every rank]: an all-gather is a collective, so in stage 3 every rank
must gather the same units in the same order. When ranks run different modules (an expert
routed on one rank only) the gathers pair up wrongly: with units of different sizes the
collective fails, but with units of the same size (identical experts) it succeeds and mixes
shards of different modules, silently. So the gather ledger keeps the sequence of units
gathered and, at the end of each forward and of each backward, the engine compares a hash
of it across ranks (one small all-reduce); on a mismatch it raises, naming the first unit
that differs, before anything computed from the mixed values reaches the optimizer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch

from .._runtime import _comm as comm
from ..errors import EngineError

if TYPE_CHECKING:
    from ._ledger import GatherLedger
    from ._unit import FetchUnit


def check_same_gathers(ledger: "GatherLedger[FetchUnit]", units: List["FetchUnit"], where: str, *, world_size: int,
                       rank: int, partitioned: bool) -> None:
    """Raise if the ranks gathered different units since the last check."""
    seq = ledger.take_sequence()
    if world_size == 1 or not partitioned:  # Note [one rank] in _runtime/_comm.py
        return
    h = 0
    for index in seq:
        h = (h * 1_000_003 + index + 1) % (1 << 61)
    mine = torch.tensor([h, -h, len(seq), -len(seq)], dtype=torch.int64)
    both = comm.all_reduce(mine.clone(), "max")
    if torch.equal(both, mine):
        return
    seqs = comm.all_gather_object(seq)
    r = next(r for r, other in enumerate(seqs) if other != seq)
    k = next((i for i, (a, b) in enumerate(zip(seq, seqs[r])) if a != b), min(len(seq), len(seqs[r])))
    name = {u.index: u.module_name or "<root>" for u in units}
    mine_at = name.get(seq[k], "nothing") if k < len(seq) else "nothing"
    theirs_at = name.get(seqs[r][k], "nothing") if k < len(seqs[r]) else "nothing"
    raise EngineError(
        f"ranks gathered different parameters in this {where}: all-gather {k + 1} was of {mine_at!r} on rank "
        f"{rank} and of {theirs_at!r} on rank {r}, so the gathered values mix shards of different modules "
        f"and cannot be trained on. In ZeRO stage 3 every rank must run the same modules in the same order; a "
        f"module that runs on some ranks only (e.g. an expert chosen by routing) must have its parameters "
        f"fetched by a parent that runs on all: infinity.register_external_parameter(parent, p) for each of "
        f"its parameters p")


def check_same_model_on_all_ranks(model: "torch.nn.Module") -> None:
    """Every rank built the same parameters (names, shapes, dtypes, trainable or not), before any is partitioned."""
    sig = [(n, tuple(p.shape), str(p.dtype), "trainable" if p.requires_grad else "frozen")
           for n, p in model.named_parameters()]
    sigs = comm.all_gather_object(sig)
    for r, other in enumerate(sigs):
        if other != sig:
            diff = next(((a, b) for a, b in zip(sig, other) if a != b),
                        (f"{len(sig)} parameters", f"{len(other)} parameters"))
            raise EngineError(
                f"rank {comm.rank()} and rank {r} built different models (first difference: {diff[0]} vs "
                f"{diff[1]}); every data-parallel rank must construct the same model")
