"""Where a partition lives and what a stage partitions: the two questions every reader of a
placement asks, one type each (``Tier``, ``StagePolicy``), for the engine, the preflight and the
estimator.

The config names the tiers ``none`` (device memory), ``cpu`` and ``nvme``; the estimator and
the accounting call them ``device``, ``cpu``/``host`` and ``nvme``. ``Tier.of`` accepts
either spelling; ``Tier.memory`` is the key of a tier in byte accounting.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(str, enum.Enum):
    """Where a partition lives, fastest first."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, name) -> "Tier":
        """A tier from the config's name (``none`` is the device) or the estimator's."""
        return cls.DEVICE if name == "none" else cls(name)

    @property
    def memory(self) -> str:
        """The key of this tier in byte accounting: device, host or nvme."""
        return {Tier.DEVICE: "device", Tier.CPU: "host", Tier.NVME: "nvme"}[self]

    @property
    def resident(self) -> bool:
        """Held in memory (device or host), not in a swap file."""
        return self is not Tier.NVME


@dataclass(frozen=True)
class StagePolicy:
    """What a ZeRO stage partitions beyond the optimizer states. Every "is this stage 3" asks
    ``partition_params`` of the one policy the engine holds (its placement's ``policy``)."""

    stage: int
    partition_params: bool  # stage 3: parameters live as shards between uses
    reduce_in_backward: bool  # stages 2-3: gradients reduce-scattered as backward produces them

    @classmethod
    def of(cls, stage: int) -> "StagePolicy":
        return cls(stage, partition_params=stage >= 3, reduce_in_backward=stage >= 2)
