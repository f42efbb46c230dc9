"""The plots of docs/benchmarks.md: each a ``Figure`` (its data and the function that draws it),
drawn with matplotlib only when the page is written.

Note [plot digests]: a PNG's bytes depend on matplotlib's version and fonts, not only on the
data, so ``--check`` compares no bytes: each PNG carries in a ``Comment`` chunk a digest of its
data and of the code that draws it, which ``--check`` recomputes without matplotlib. The PNGs
are deterministic all the same (fixed size and dpi, the default style, no Software chunk).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import struct
from dataclasses import dataclass
from typing import Callable, Dict, List

FIG_SIZE, DPI = (11.0, 4.2), 100


@dataclass(frozen=True)
class Figure:
    name: str  # under docs/images
    alt: str
    data: dict
    draw: Callable[[dict], object]

    def digest(self) -> str:
        """Note [plot digests]: the data and the drawing code."""
        code = "".join(inspect.getsource(f) for f in (self.draw, _style, _bar_colors, _stacked, png_bytes))
        blob = json.dumps([self.name, self.data], sort_keys=True) + code
        return "benchmarks.report sha256:" + hashlib.sha256(blob.encode()).hexdigest()


COLORS = {"plain": "#7f7f7f", "infinity": "#1f77b4", "deepspeed": "#ff7f0e", "fsdp2": "#2ca02c"}


def _bar_colors(names: List[str]) -> List[str]:
    return [COLORS.get(name.split("-")[0], "#9467bd") for name in names]


def _style(ax, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)


def draw_peers(data: dict):
    from matplotlib.figure import Figure as MplFigure

    bars = data["bars"]
    names = [b["contender"] for b in bars]
    x = list(range(len(bars)))
    hatch = ["//" if b["separate"] else "" for b in bars]
    fig = MplFigure(figsize=FIG_SIZE, dpi=DPI)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    steps = [b["step_s"] for b in bars]
    err = [[s - b["min"] for s, b in zip(steps, bars)], [b["max"] - s for s, b in zip(steps, bars)]]
    for i, (s, color) in enumerate(zip(steps, _bar_colors(names))):
        left.bar(i, s, color=color, hatch=hatch[i], edgecolor="white" if not hatch[i] else "black", linewidth=0.5)
        top = max(s, bars[i]["max"] or s)  # above the whisker
        left.annotate(f"{s:.3g}", (i, top), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    left.errorbar(x, steps, yerr=err, fmt="none", ecolor="black", capsize=3, linewidth=0.8)
    left.set_title("step time (median, min-max)", fontsize=10)
    _style(left, "seconds a step")
    width = 0.38
    for shift, key, label, color in ((-width / 2, "gpu", "GPU peak", "#4c72b0"), (width / 2, "host", "host peak", "#dd8452")):
        values = [b[key] or 0.0 for b in bars]
        right.bar([i + shift for i in x], values, width, label=label, color=color, hatch=None)
        for i, v in enumerate(values):
            right.annotate(f"{v:.1f}", (i + shift, v), xytext=(0, 2), textcoords="offset points", ha="center",
                           fontsize=7)
    right.set_title("memory peaks over the training steps", fontsize=10)
    right.legend(fontsize=8, frameon=False)
    _style(right, "GiB")
    labels = [n + ("\n(separate run)" if b["separate"] else "") for n, b in zip(names, bars)]
    for ax in (left, right):
        ax.set_xticks(x, labels, fontsize=8, rotation=20, ha="right")
    fig.suptitle(data["title"], fontsize=11)
    fig.tight_layout()
    return fig


def _stacked(ax, bars: List[dict], parts: tuple) -> None:
    """One horizontal bar per entry of ``bars``, its ``parts`` (key, label, color) end to end."""
    start = [0.0] * len(bars)
    for key, label, color in parts:
        values = [b[key] or 0.0 for b in bars]
        ax.barh(range(len(bars)), values, left=start, label=label, color=color)
        start = [s + v for s, v in zip(start, values)]


def draw_profile(data: dict):
    from matplotlib.figure import Figure as MplFigure

    bars = data["bars"]
    labels = [b["label"] for b in bars]
    y = list(range(len(bars)))
    fig = MplFigure(figsize=(FIG_SIZE[0], 2.4 + 0.6 * len(bars)), dpi=DPI)
    left, right = fig.subplots(1, 2)
    _stacked(left, bars, (("forward_s", "forward", "#4c72b0"), ("backward_s", "backward", "#55a868"),
                          ("step_call_s", "step() call", "#c44e52")))
    left.set_title("the step's parts, each between synchronizations (s)", fontsize=10)
    _stacked(right, bars, (("gpu_busy_s", "GPU busy", "#4c72b0"), ("gpu_idle_s", "GPU idle", "#cccccc")))
    right.set_title("one profiled step (s)", fontsize=10)
    for ax in (left, right):
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.legend(fontsize=8, frameon=False, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    fig.tight_layout()
    return fig


def png_bytes(figure: Figure) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.style

    with matplotlib.style.context("default"):
        fig = figure.draw(figure.data)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None, "Comment": figure.digest()})
    return buf.getvalue()


def png_text(data: bytes) -> Dict[str, str]:
    """A PNG's tEXt chunks, read without matplotlib."""
    chunks, pos = {}, 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"tEXt":
            key, _, value = data[pos + 8:pos + 8 + length].partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return chunks
