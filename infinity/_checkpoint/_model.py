"""What a checkpoint records of a model and its optimizer, and the checks a load makes."""
from __future__ import annotations

from typing import List

from .. import errors
from .._runtime import _comm as comm
from .._zero._engine import engine_of
from .._zero._zero_optimizer import ZeroOptimizer
from ..errors import InfinityError, StorageError, UsageError


def engine_and_optimizer(model, optimizer, what: str):
    """The engine of ``model`` and its optimizer, both from ``infinity.initialize``."""
    engine = engine_of(model)
    if engine is None:
        raise UsageError(f"{what}: the model is not managed by infinity; pass the model returned by "
                         f"infinity.initialize(model, config=cfg)")
    if not isinstance(optimizer, ZeroOptimizer) or optimizer.engine is not engine:
        raise UsageError(f"{what}: pass the optimizer infinity.initialize returned with this model")
    return engine, optimizer


def failure(e: BaseException) -> tuple:
    """A rank's error, as ``agree`` passes it to every rank: infinity's own class, else
    StorageError for an OSError and UsageError for the rest (e.g. an unpicklable extra)."""
    name = type(e).__name__ if isinstance(e, InfinityError) else "StorageError" if isinstance(e, OSError) else "UsageError"
    return ("failed", name, f"{type(e).__name__}: {e}" if not isinstance(e, InfinityError) else str(e))


def agree(result, what: str):
    """Every rank's ``result`` (a ``failure`` is an error): raises the first failure on every
    rank, with its class where it is one of infinity's, so no rank waits in a collective for
    one that gave up."""
    results = comm.all_gather_object(result)
    for rank, x in enumerate(results):
        if isinstance(x, tuple) and len(x) == 3 and x[0] == "failed":
            cls = getattr(errors, x[1], None)
            cls = cls if isinstance(cls, type) and issubclass(cls, errors.InfinityError) else StorageError
            raise cls(f"{what}: {x[2]}" + (f" (on rank {rank})" if len(results) > 1 else ""))
    return results


def param_entries(engine, opt) -> List[dict]:
    """The manifest's record of every parameter (Note [checkpoint layout] in _format.py)."""
    group_of = {slot.index: slot.group for slot in opt.steps.slots}
    out, index = [], 0
    for unit in engine.units:
        for info in unit.infos:
            out.append({"name": info.name, "shape": list(info.shape), "numel": info.numel, "chunk": info.shard_numel,
                        "trainable": unit.trainable, "param_offset": unit.param_offset + info.shard_offset,
                        "opt_offset": unit.opt_offset + info.shard_offset if unit.trainable else None,
                        "step": opt.steps.step_of(index), "group": group_of.get(index)})
            index += 1
    return out


def check_compatible(engine, opt, manifest: dict, path: str) -> None:
    """The model and optimizer are the ones the checkpoint was saved from (any world size
    and placement), or UsageError saying what differs."""
    saved = {p["name"]: p for p in manifest["params"]}
    mine = {info.name: (list(info.shape), unit.trainable) for unit in engine.units for info in unit.infos}
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        raise UsageError(f"checkpoint {path} was saved from another model: parameters not in it: {missing[:5]}, "
                         f"in it but not in this model: {extra[:5]}; build the same model before loading")
    for name, (shape, trainable) in mine.items():
        s = saved[name]
        if shape != s["shape"]:
            raise UsageError(f"checkpoint {path}: {name} has shape {s['shape']} there and {shape} here; "
                             f"build the same model before loading")
        if trainable != s["trainable"]:
            state = "trainable" if s["trainable"] else "frozen"
            raise UsageError(f"checkpoint {path}: {name} was {state} when saved; set requires_grad="
                             f"{s['trainable']} on it as then (its optimizer states exist only if it trained)")
    if manifest["dtype"] != str(engine.dtype):
        raise UsageError(f"checkpoint {path} was saved with compute dtype {manifest['dtype']}, this run computes in "
                         f"{engine.dtype}; set precision.dtype to the saved one to resume")
    if len(manifest["groups"]) != len(opt.param_groups):
        raise UsageError(f"checkpoint {path} has {len(manifest['groups'])} parameter groups, this optimizer "
                         f"{len(opt.param_groups)}; pass the same param_groups to infinity.initialize")
