"""Per-step counters of the engine: time blocked per transfer stage, bytes moved, prefetch
hit rate, trace divergences. ``Engine.telemetry()`` hands them out and starts afresh."""
from __future__ import annotations

import collections
import contextlib
import time


class Counters:
    STAGES = ("nvme_read", "host_to_device", "all_gather", "reduce_scatter", "grad_offload", "optimizer_io")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.stall: collections.defaultdict[str, float] = collections.defaultdict(float, dict.fromkeys(self.STAGES, 0.0))
        self.bytes: collections.Counter[str] = collections.Counter()
        self.hits = 0
        self.misses = 0
        self.divergences = 0
        self.update = {"seconds": 0.0, "elements": 0, "peak_threads": 0, "background_seconds": 0.0}
        self.step_call: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds per part

    def step_part(self, part: str):
        """Time of one part of the optimizer's ``step()`` call on the caller's thread."""
        return _seconds_into(self.step_call, part)

    def note_update(self, seconds: float, elements: int, threads: int, background: bool) -> None:
        """The optimizer updated ``elements`` in ``seconds`` on ``threads`` threads (on the
        overlapped step's thread when ``background``)."""
        self.update["seconds"] += seconds
        self.update["elements"] += elements
        self.update["peak_threads"] = max(self.update["peak_threads"], threads)
        if background:
            self.update["background_seconds"] += seconds

    def blocked(self, stage: str):
        """Time spent waiting on ``stage`` on the critical path."""
        return _seconds_into(self.stall, stage)

    def snapshot(self) -> dict:
        fetches = self.hits + self.misses
        return {
            "stall_s": dict(self.stall),
            "bytes": dict(self.bytes),
            "prefetch_hits": self.hits,
            "prefetch_misses": self.misses,
            "prefetch_hit_rate": self.hits / fetches if fetches else None,
            "trace_divergences": self.divergences,
            "update": dict(self.update),
            "step_call_s": dict(self.step_call),
        }


@contextlib.contextmanager
def _seconds_into(totals, key: str):
    """Add the block's wall time to ``totals[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[key] += time.perf_counter() - start
