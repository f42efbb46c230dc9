"""One spelling of each benchmark flag, one size parser, one host peak-memory reader.

Every benchmark builds its command line with ``parser``, so ``--steps``, ``--warmup``,
``--seq-len``, ``--micro-batch``, ``--nvme-path``, ``--only``, ``--smoke``, ``--out``,
``--rounds``, ``--budget`` and ``--timeout`` mean the same everywhere. In a benchmark of a
primitive a step is one timed repetition (a pass over a file, one Adam step), so its
repetitions are ``--steps`` too; ``--threads`` is torch's thread count in each contender.

Note [host peak]: "host peak" in every benchmark record is the process's peak resident set
(Linux ``VmHWM``: pages of host memory it held at once, pinned and pageable alike, files mapped
in included), in bytes, since the process started or since the last ``reset_host_peak``. A
contender resets it after its set-up, so ``host_peak_gib`` is the peak over the training steps;
the peak of the set-up (building the model whole, the engine's initialization) is recorded
beside it. ``ru_maxrss`` is not used: it cannot be reset.
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from typing import List, Optional

_BINARY_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"3e9"``, ``"64K"``, ``"256MiB"``, ``"1.5g"`` or ``"2GB"``: a number
    and an optional unit K, M, G or T, always binary (1G = 2**30), with or without ``i``/``B``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ValueError(f"not a size: {text!r} (a number with an optional K, M, G or T: 64K, 256MiB, 1.5G)")
    return int(float(match.group(1)) * _BINARY_UNITS[match.group(2)])


def parse_list(text: str) -> List[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parser(description: str, *, steps: int, warmup: int, seq_len: Optional[int] = None,
           micro_batch: Optional[int] = None, only: Optional[str] = None, rounds: int = 1, budget: float = 3600.0,
           timeout: float = 1200.0) -> argparse.ArgumentParser:
    """The flags every benchmark has, with this benchmark's defaults; it adds its own to the result.
    ``--seq-len``, ``--micro-batch`` and ``--only`` are there where the benchmark gives a default."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="timed steps after the warm-ups, per round (median)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps first, per round")
    if seq_len is not None:
        p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    if micro_batch is not None:
        p.add_argument("--micro-batch", type=int, default=micro_batch, help="sequences per step")
    p.add_argument("--nvme-path", default=os.environ.get("GPU_CHECK_DISK", tempfile.gettempdir()),
                   help="a directory; each NVMe contender makes its own temporary folder under it and removes it")
    if only is not None:
        p.add_argument("--only", default=only, help="comma-separated contenders (or cells), run in this order")
    p.add_argument("--smoke", action="store_true", help="the smallest size, a few steps: a check that runs on a CPU")
    p.add_argument("--out", metavar="FILE", help="also append each JSON record to FILE")
    p.add_argument("--rounds", type=int, default=rounds,
                   help="rounds; each runs every contender once, the order rotated "
                        "(Note [contender rounds] in _harness.py)")
    p.add_argument("--budget", type=float, default=budget, help="seconds for the whole benchmark")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds one contender's process may take")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def load_note() -> str:
    """The load average, which moves every timing on a shared machine."""
    return "load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + \
        f" on {os.cpu_count()} cores"


def host_peak_bytes() -> Optional[int]:
    """This process's host peak (Note [host peak]), or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None


def reset_host_peak() -> bool:
    """Restart the host peak from the present resident set; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
