"""Where each unit's shard lives in the two flat spaces of a rank.

Note [frozen parameters]: the parameter store holds the compute-dtype shard of every unit;
the optimizer's flat fp32 space (master weights, gradient shards, Adam moments) holds those
of trainable units only, so a frozen parameter costs its low-precision shard and nothing
else (LoRA: the optimizer's bytes scale with the adapters, not with the model). The engine
never puts trainable and frozen parameters in one unit (a module with both gets two units),
so a unit is in the optimizer's space whole or not at all. Each unit has a *slot* in each
space: its shard rounded up to ``align`` elements (NVMe transfers stay aligned); a trainable
unit's two slots have the same length. The parameter store's space holds the trainable units
first, in unit order, then the frozen ones: a trainable unit's slot is at the same offset in
both spaces, so the first ``opt_total`` elements of the parameter store's space are the
optimizer's space, and the master weights can hold the trainable units' shards while the
frozen ones sit after them, apart (Note [parameters from the master] in _placement.py).
``Layout.param_pieces`` maps a range of the optimizer's space to the parameter store's.
"""
from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import List, Tuple

import torch

from .._runtime._tiers import Tier
from ..errors import UsageError

ALIGN_ELEMS = 2048  # unit offsets on NVMe: 4 KiB for 2-byte dtypes, 8 KiB for fp32


def padded(numel: int, world_size: int) -> int:
    """Note [shard layout] in _unit.py: a parameter's elements rounded up to a multiple of the world size."""
    return -(-numel // world_size) * world_size


def shard_rows(full: torch.Tensor, world_size: int) -> torch.Tensor:
    """Note [shard layout] in _unit.py: the (N, shard) view of one parameter's values,
    flattened and padded with zeros; row r is rank r's shard of it. A fetch unit's shards and
    gradients and Init's shards are all cut by it."""
    flat = full.reshape(-1)
    numel = flat.numel()
    pad = padded(numel, world_size) - numel
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(world_size, (numel + pad) // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> Tuple[int, int]:
    """The elements [lo, hi) of a parameter of ``numel`` elements that lie in ``rank``'s
    shard of ``shard_rows`` (the rest of the shard, if any, is padding)."""
    shard = padded(numel, world_size) // world_size
    return min(rank * shard, numel), min((rank + 1) * shard, numel)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class Layout:
    """Offsets of every unit in both spaces, computed once by ``assign``."""

    param_total: int
    opt_total: int
    opt_starts: Tuple[int, ...]  # per trainable unit, in order: its slot in the optimizer's space ...
    param_starts: Tuple[int, ...]  # ... and in the parameter store's
    slots: Tuple[int, ...]  # slot lengths
    param_ranges: Tuple[Tuple[int, int], ...]  # (param_offset, shard_numel) of every unit
    opt_ranges: Tuple[Tuple[int, int], ...]  # (opt_offset, shard_numel) of every trainable unit
    opt_offsets: Tuple[int, ...]  # every unit's offset in the optimizer's space (a frozen one's: where it would go)

    @classmethod
    def assign(cls, specs, align: int) -> "Layout":
        """The offsets of units with these ``shard_numel`` and ``trainable`` (``UnitSpec``s),
        in order, each slot rounded up to ``align`` elements."""
        opt_total = 0
        opt_starts, slots, opt_offsets = [], [], []
        for spec in specs:
            opt_offsets.append(opt_total)
            if spec.trainable:
                opt_starts.append(opt_total)
                slots.append(round_up(spec.shard_numel, align))
                opt_total += slots[-1]
        param_total, param_ranges = opt_total, []  # the trainable units first (Note [frozen parameters])
        for spec, opt_offset in zip(specs, opt_offsets):
            if spec.trainable:
                param_ranges.append((opt_offset, spec.shard_numel))
            else:
                param_ranges.append((param_total, spec.shard_numel))
                param_total += round_up(spec.shard_numel, align)
        param_starts = opt_starts
        opt_ranges = tuple((o, s.shard_numel) for o, s in zip(opt_offsets, specs) if s.trainable)
        return cls(param_total, opt_total, tuple(opt_starts), tuple(param_starts), tuple(slots),
                   tuple(param_ranges), opt_ranges, tuple(opt_offsets))

    @property
    def max_shard(self) -> int:
        """Elements of the largest unit's shard."""
        return max((n for _, n in self.param_ranges), default=0)

    @property
    def same_spaces(self) -> bool:
        """No frozen unit: the two spaces coincide."""
        return self.param_total == self.opt_total

    @property
    def frozen_total(self) -> int:
        """Elements of the frozen units' slots: the parameter store's space after the optimizer's."""
        return self.param_total - self.opt_total

    def param_slots(self) -> List[Tuple[int, int]]:
        """(start, length) of every trainable unit's slot in the parameter store."""
        return list(zip(self.param_starts, self.slots))

    def param_pieces(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """(opt start, opt end, param start) of the pieces of [lo, hi) of the optimizer's space."""
        out = []
        i = max(0, bisect.bisect_right(self.opt_starts, lo) - 1)
        while i < len(self.opt_starts) and self.opt_starts[i] < hi:
            a, b = max(lo, self.opt_starts[i]), min(hi, self.opt_starts[i] + self.slots[i])
            if a < b:
                out.append((a, b, self.param_starts[i] + (a - self.opt_starts[i])))
            i += 1
        return out

    def to_opt(self, p: int) -> int:
        """The optimizer-space offset of parameter-space offset ``p`` (inside a trainable
        unit's slot, or at its end)."""
        i = max(0, bisect.bisect_right(self.param_starts, p) - 1)
        if i < len(self.param_starts) and p > self.param_starts[i] + self.slots[i]:
            raise UsageError(f"offset {p} of the parameter store is not in a trainable unit's slot")
        return self.opt_starts[i] + (p - self.param_starts[i]) if self.param_starts else 0


def states_in_host(opt_tier: Tier, device_is_host: bool) -> bool:
    """The optimizer's states are in host memory: its tier is the host, or the device where
    the device is the host (no accelerator)."""
    return opt_tier is Tier.CPU or (opt_tier is Tier.DEVICE and device_is_host)


class ParamSource(enum.Enum):
    """Where stage 3's parameter store keeps the compute-dtype shards: one fact, read by the
    stores, the units, the engine, the optimizer, the preflight and the run model (Note
    [parameters from the master] in _placement.py gives the rules; ``of`` applies them)."""

    OWN = "own"  # the parameter tier keeps its own shards (params.swp on NVMe); also stages 1-2 (no store)
    MASTER = "master"  # fp32, master weights in memory: the parameter store is a view of the master tensor
    MASTER_FILE = "master_file"  # fp32, both on NVMe: the trainable units' shards are master.swp's

    @classmethod
    def of(cls, *, partitioned: bool, fp32: bool, same_spaces: bool, opt_tier: Tier, param_tier: Tier,
           device_is_host: bool) -> "ParamSource":
        """The source a placement gets: the master's only in fp32 at stage 3; master.swp where
        both tiers are NVMe, and the master tensor where it is in memory on the parameter tier,
        frozen units or not (theirs are kept apart, after the trainable ones); the master
        tensor in host memory under an NVMe parameter tier only with no frozen unit (the two
        flat spaces coincide: a frozen unit's shard would need the NVMe tier)."""
        if not (partitioned and fp32):
            return cls.OWN
        if param_tier is Tier.NVME and opt_tier is Tier.NVME:
            return cls.MASTER_FILE
        if opt_tier.resident and param_tier is opt_tier \
                or same_spaces and param_tier is Tier.NVME and states_in_host(opt_tier, device_is_host):
            return cls.MASTER
        return cls.OWN

    @property
    def from_master(self) -> bool:
        """The parameter shards are the master weights' values: nothing to write at
        partition, no params.swp, no parameter file to load a checkpoint into."""
        return self is not ParamSource.OWN
