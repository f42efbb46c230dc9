"""Where a partition lives: one enum for the engine, the preflight and the estimator.

The config names the tiers ``none`` (device memory), ``cpu`` and ``nvme``; the estimator and
the accounting call them ``device``, ``cpu``/``host`` and ``nvme``. ``Tier.of`` accepts
either spelling; ``Tier.memory`` is the key of a tier in byte accounting.
"""
from __future__ import annotations

import enum


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
