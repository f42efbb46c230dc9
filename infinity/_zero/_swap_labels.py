"""What each byte of a swap file holds, for the messages of CorruptionError (Note [swap
checksums] in aio/_checksum.py): the fetch unit of a parameter shard, the optimizer state
array, chunk and unit of an optimizer range, and the step at which it was read."""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, List

from .._offload._nvme_optimizer_store import NvmeOptimizerStore

if TYPE_CHECKING:
    from ._unit import FetchUnit
    from ._zero_optimizer import ZeroOptimizer


def _unit_at(units: List["FetchUnit"], starts: List[int], element: int, attr: str):
    i = bisect.bisect_right(starts, element) - 1
    return units[i] if i >= 0 and getattr(units[i], attr) <= element else None


def _unit_words(unit: "FetchUnit") -> str:
    names = [info.name for info in unit.infos]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"fetch unit {unit.index} '{unit.module_name or '<root>'}' ({shown})"


def label_swap_files(opt: "ZeroOptimizer") -> None:
    """Give every checksummed swap file of ``opt``'s stores its ``describe`` and ``when``."""
    ops = opt.ops  # Note [the optimizer's engine] in _zero_optimizer.py

    def when() -> str:
        return f"at optimizer step {opt._step} on rank {ops.rank}"

    if opt.param_store is not None:
        units = sorted(ops.units, key=lambda u: u.param_offset)
        starts = [u.param_offset for u in units]
        itemsize, first = opt.param_store.itemsize, opt.param_store.own_from  # params.swp's first element

        def describe_param(offset: int) -> str:
            element = first + offset // itemsize
            unit = _unit_at(units, starts, element, "param_offset")
            if unit is None:
                return f"parameter shards, element {element}"
            return f"the parameter shard of {_unit_words(unit)}, element {element - unit.param_offset} of it"

        for sums in opt.param_store.checksums().values():
            sums.describe, sums.when = describe_param, when
    store = opt.store
    if isinstance(store, NvmeOptimizerStore):
        trainable = sorted((u for u in ops.units if u.trainable), key=lambda u: u.opt_offset)
        starts = [u.opt_offset for u in trainable]
        for name, sums in store.checksums().items():
            sums.describe, sums.when = _describe_optimizer(name, store, trainable, starts), when


def _describe_optimizer(name: str, store, units, starts):
    chunk = store.chunk

    def describe(offset: int) -> str:
        element = store.element_of(name, offset)  # compressed moments: the record's chunk
        lo = element // chunk * chunk
        unit = _unit_at(units, starts, element, "opt_offset")
        where = f", inside {_unit_words(unit)}" if unit is not None and element < unit.opt_offset + unit.shard_numel \
            else ""
        return f"optimizer state '{name}', element {element} (optimizer range [{lo}, {lo + chunk})){where}"

    return describe
