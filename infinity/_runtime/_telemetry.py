"""Telemetry of the main job: JSON lines, optional TensorBoard events, the end-of-run table.

Note [engine telemetry keys]: ``engine.telemetry()``, when the engine has it, returns a dict
(nested or flat) of numbers measured during the last step. Every number is written to the
JSON lines under ``engine.<dotted path>``. Two families are also interpreted: a path holding
``bytes`` and a tier name (``nvme``, ``cpu`` or ``host``, ``device``) counts traffic of that
tier in this step, its direction taken from ``read``/``write`` (or ``in``/``out``) in the
path; a path holding ``stall`` counts seconds a stage waited in this step. Both feed the
progress bar (bandwidth per tier) and the summary (stall time, achieved disk bandwidth).
A third, ``tier_seconds.<state>.<tier>`` (``TIER_SECONDS``; state ``optimizer`` or ``params``,
tier ``cpu``, ``nvme`` or ``device``), counts the seconds of this step that work on a state spent
on one of its tiers, so that a split state (Note [split tiers] in _offload/_split.py) shows where
its time goes: for the optimizer, the update of the chunks in memory (a split's host share, or
every chunk of a resident store) and of the chunks in the swap files (their update, the waits for
their reads and write-backs, and a host-cached chunk's write-through); for stage 3's parameters,
fetches taking shards from memory (the host share's, or a resident store's, views) and reading
them from NVMe (submitted, waited for, the range's writes and a free buffer waited for first;
shards the parameter cache or the hand-off serve count on neither tier; the NVMe store counts an
edit's reads of its shards too). A state reports the tiers it is on and no other: an all-cpu
run has no ``nvme`` key, a split both. It is the wall time of the thread doing the work (the
overlapped step's tail on its own thread), measured around work already there with no
synchronization added: neither traffic (no ``bytes``) nor a stall (a wait on the critical path
is ``stall_s``), and a count, summed over the steps.
A few numbers are levels, not counts of the step (``is_level``): the host-memory account
(``host_memory.*``, as it is now and at its peaks), where the rank runs (``placement.*``: its
threads, cores and node), peaks (a path holding ``peak``) and rates (ending in ``_rate``). The
summary adds up counts over the steps, and takes the largest of a level over the steps and the
ranks: a sum of peaks measures nothing.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Dict, Iterable, List, Optional

TIERS = ("device", "cpu", "nvme")
TIER_SECONDS = "tier_seconds"  # seconds per state and tier (Note [engine telemetry keys])
_TIER_WORDS = {"nvme": "nvme", "disk": "nvme", "cpu": "cpu", "host": "cpu", "device": "device", "gpu": "device"}


# ---------------------------------------------------------------------------------------------
# Engine counters


def flatten(obj, prefix: str = "") -> Dict[str, float]:
    """Numeric leaves of nested dicts as ``{"a.b": value}``; other leaves are dropped."""
    out: Dict[str, float] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, (int, float)) and math.isfinite(obj):
        out[prefix] = obj
    return out


def _words(path: str) -> List[str]:
    return path.lower().replace("/", ".").replace("-", "_").replace(".", "_").split("_")


def tier_traffic(flat: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """``{tier: {"read": bytes, "write": bytes, "total": bytes}}`` (Note [engine telemetry keys])."""
    out: Dict[str, Dict[str, float]] = {}
    for path, value in flat.items():
        words = _words(path)
        if "bytes" not in words:
            continue
        tier = next((_TIER_WORDS[w] for w in words if w in _TIER_WORDS), None)
        if tier is None:
            continue
        entry = out.setdefault(tier, {"read": 0.0, "write": 0.0, "total": 0.0})
        if "read" in words or "in" in words:
            entry["read"] += value
        elif "write" in words or "written" in words or "out" in words:
            entry["write"] += value
        entry["total"] += value
    return out


def is_level(path: str) -> bool:
    """A level or a peak, not a count of one step (Note [engine telemetry keys])."""
    return path.startswith(("host_memory.", "placement.")) or "peak" in path or path.endswith("_rate")


def stall_seconds(flat: Dict[str, float]) -> float:
    return sum(v for path, v in flat.items() if any(w.startswith("stall") for w in _words(path)))


# ---------------------------------------------------------------------------------------------
# Writers


class JsonLines:
    """Appends one JSON object a line; flushed after each so a crashed run keeps its records."""

    def __init__(self, path: str):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, sort_keys=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def open_tensorboard(logdir: str):
    """A SummaryWriter when the ``tensorboard`` package is installed, else None."""
    try:  # late: tensorboard is optional
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=logdir)


class Telemetry:
    """The run's sinks. Rank 0 writes; other ranks hold a Telemetry with no sinks."""

    def __init__(self, path: Optional[str], every: int = 1, tensorboard_dir: Optional[str] = None):
        self.every = every
        self.jsonl = JsonLines(path) if path else None
        self.tb = open_tensorboard(tensorboard_dir) if tensorboard_dir else None

    @property
    def path(self) -> Optional[str]:
        return self.jsonl.path if self.jsonl else None

    def event(self, record: dict) -> None:
        if self.jsonl:
            self.jsonl.write(record)

    def step(self, record: dict) -> None:
        if record["step"] % self.every and record["step"] != 1:
            return
        self.event(record)
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("event", "step") and isinstance(value, (int, float)):
                    self.tb.add_scalar(key.replace(".", "/"), value, record["step"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------------------------
# Formatting


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_rate(bytes_per_s: Optional[float]) -> str:
    return "-" if bytes_per_s is None else fmt_bytes(bytes_per_s) + "/s"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


class StepStats:
    """The per-step records of a run, kept for the summary."""

    def __init__(self):
        self.records: List[dict] = []
        self.t0 = time.perf_counter()

    def add(self, record: dict) -> None:
        self.records.append(record)

    def column(self, key: str) -> List[float]:
        return [r[key] for r in self.records if key in r]

    def measured(self) -> List[dict]:
        """Steps after the first (which records traces and allocates), unless there is only one."""
        return self.records[1:] if len(self.records) > 1 else self.records

    def median(self, key: str) -> float:
        values = [r[key] for r in self.measured() if key in r]
        return statistics.median(values) if values else 0.0

    def tier_totals(self) -> Dict[str, Dict[str, float]]:
        totals: Dict[str, Dict[str, float]] = {}
        for r in self.records:
            for tier, entry in r.get("_tiers", {}).items():
                t = totals.setdefault(tier, {"read": 0.0, "write": 0.0, "total": 0.0})
                for k in t:
                    t[k] += entry[k]
        return totals


def render_table(title: str, sections: List[List[tuple]], width: int = 78) -> str:
    """Sections of rows; a row is (label, *cells). The first row of a section with more than
    two cells is its header. Cells are right-aligned in 14-wide columns after the label."""
    label_w = 26
    lines = ["=" * width, f" {title}".ljust(width), "=" * width]
    for i, rows in enumerate(sections):
        if i:
            lines.append("-" * width)
        for row in rows:
            label, cells = row[0], row[1:]
            line = f" {label:<{label_w}}"
            if len(cells) == 1:
                lines.append(line + ("" if len(label) < label_w else "  ") + cells[0])
                continue
            for i, cell in enumerate(cells):  # each cell ends at its column; one pushed along keeps a gap
                gap = 2 if i == 0 and len(label) >= label_w else 1
                line += " " * max(gap, 1 + label_w + 14 * (i + 1) - len(line) - len(cell)) + cell
            lines.append(line)
    lines.append("=" * width)
    return "\n".join(lines)
