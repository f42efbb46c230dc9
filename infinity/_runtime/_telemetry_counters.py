"""Per-step counters of the engine: time blocked per transfer stage, bytes moved, prefetch
hit rate, trace divergences. ``Engine.telemetry()`` hands them out and starts afresh.

Note [profiler ranges]: under ``torch.profiler`` the engine's work shows as named ranges, as
FSDP2's does, so that a stall in a trace is attributed to what the step waited for and to which
unit: each transfer the engine issues (``infinity::read``, the NVMe read of a unit's shard
submitted; ``infinity::copy_to_device``; ``infinity::all_gather``; ``infinity::reduce_scatter``,
named after the bucket's first units; ``infinity::copy_to_host``, a gradient shard's copy to the
host; ``infinity::grad_landing``, landed gradients added into the optimizer's store;
``infinity::update_chunk`` and ``infinity::speculative_update_chunk``, Adam over one chunk of the
flat space, named after the chunk's first unit) and each wait on the critical path
(``infinity::wait:<stage>``, the stages of ``Counters.STAGES``: the same blocks whose seconds
the telemetry's ``stall_s`` counts; ``optimizer_io`` is the step gate's), each followed by
``:<unit>``, the unit's module name (``<root>`` for the root's), where it concerns one unit
(``range_kind`` drops it). ``benchmarks.step_profile --trace DIR`` writes one step's trace and
sums its ranges by kind. ``span``
opens a range only while a profiler records (a test of one flag otherwise), so the ranges cost
the step nothing when nobody looks. The overlapped update runs on the step's own thread, which
torch's profiler records only when asked for every thread:
``profile(..., experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))``.
"""
from __future__ import annotations

import collections
import contextlib
import time

from torch.autograd import profiler as _torch_profiler
from torch.autograd.profiler import record_function


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
        # pieces updated while backward ran, and of those the ones that stood (Note [speculative update] in
        # _zero/_speculative_update.py)
        self.speculation = {"speculated": 0, "committed": 0, "kept_bytes": 0}

    def step_part(self, part: str):
        """Time of one part of the optimizer's ``step()`` call on the caller's thread."""
        return seconds_into(self.step_call, part)

    def note_update(self, seconds: float, elements: int, threads: int, background: bool) -> None:
        """The optimizer updated ``elements`` in ``seconds`` on ``threads`` threads (on the
        overlapped step's thread when ``background``)."""
        self.update["seconds"] += seconds
        self.update["elements"] += elements
        self.update["peak_threads"] = max(self.update["peak_threads"], threads)
        if background:
            self.update["background_seconds"] += seconds

    def blocked(self, stage: str, unit: str = ""):
        """Time spent waiting on ``stage`` on the critical path, for ``unit`` where one is named (a
        profiler range too: Note [profiler ranges])."""
        if _torch_profiler._is_profiler_enabled:
            return _blocked(self.stall, stage, unit)
        return seconds_into(self.stall, stage)  # the hot path when nobody profiles: no range to open

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
            "speculation": dict(self.speculation),
        }


def span(name: str, unit: str = ""):
    """A profiler range named ``name`` (``name:unit`` for a unit's) while a profiler records, else
    nothing (Note [profiler ranges]); the name is built only then."""
    # torch's flag for any profiler of the process, not the calling thread's: the overlapped step's thread is
    # recorded only by a profiler of all threads, and its own thread-local state says off even then
    if not _torch_profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return record_function(f"{name}:{unit}" if unit else name)


def range_kind(name: str) -> str:
    """The kind of an engine range, its unit left out: ``infinity::all_gather:transformer.h.0`` is
    ``infinity::all_gather``, ``infinity::wait:nvme_read:transformer.h.0`` ``infinity::wait:nvme_read``."""
    parts = name[len("infinity::"):].split(":")
    return "infinity::" + ":".join(parts[:2] if parts[0] == "wait" else parts[:1])


@contextlib.contextmanager
def _blocked(totals, stage: str, unit: str = ""):
    with record_function(f"infinity::wait:{stage}:{unit}" if unit else f"infinity::wait:{stage}"), \
            seconds_into(totals, stage):
        yield


@contextlib.contextmanager
def seconds_into(totals, key: str):
    """Add the block's wall time to ``totals[key]`` (also the stores' ``tier_seconds``: Note [engine
    telemetry keys] in _telemetry.py)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[key] += time.perf_counter() - start
