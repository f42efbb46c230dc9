"""The README's headline: the GPU head-to-head's step times, from the same merged cells as
docs/benchmarks.md (``benchmarks.report`` writes both), between the README's two markers."""
from __future__ import annotations

import re
from typing import Optional

START = "<!-- headline: from benchmarks/records by python -m benchmarks.report; no figures by hand -->"
END = "<!-- headline: end -->"

ROWS = (  # (contender, placement words)
    ("plain", "plain PyTorch, everything on the GPU"),
    ("infinity-cpu", "infinity ZeRO-3, every state on cpu"),
    ("deepspeed-cpu", "DeepSpeed ZeRO-3, every state on cpu"),
    ("fsdp2-cpu", "torch FSDP2, `CPUOffloadPolicy`"),
    ("infinity-nvme", "infinity ZeRO-3, every state on NVMe"),
    ("deepspeed-nvme", "DeepSpeed ZeRO-Infinity, every state on NVMe"),
)
SIZES = ("124m", "1.5b")
VERSUS = {"infinity-cpu": "deepspeed-cpu", "infinity-nvme": "deepspeed-nvme"}


def _cell(cells: dict, contender: str, size: str) -> str:
    entry = cells.get((contender, size))
    if entry is None or entry.record.get("step_s") is None:
        return "-"
    text = f"{entry.record['step_s']:.3g} s"
    rival = cells.get((VERSUS.get(contender, ""), size))
    if rival is not None and rival.record.get("step_s"):
        text += f" ({entry.record['step_s'] / rival.record['step_s']:.2f}x DeepSpeed's)"
    return text + (" *" if entry.separate else "")


def block(entries: list, machine: str) -> str:
    """The headline's lines between the markers."""
    cells = {e.key: e for e in entries}
    ours = cells.get(("infinity-cpu", "1.5b")) or cells.get(("infinity-cpu", "124m"))
    clip = (ours.record.get("extra") or {}).get("clip", 1.0) if ours is not None else 1.0  # older records: 1.0
    clipping = f"clipping {clip:g}" if clip > 0 else "no clipping"
    lines = [START, "", f"GPT-2 on {machine};", f"bf16 compute with fp32 master weights, AdamW, {clipping}, "
             "8 x 1024 tokens a step,", "each contender in its own process (`python -m benchmarks.peers`), median step:", "",
             "| contender | GPT-2 124M | GPT-2 1.5B (48 x 1600) |", "| --- | --- | --- |"]
    for contender, words in ROWS:
        if any((contender, size) in cells for size in SIZES):
            lines.append(f"| {words} | " + " | ".join(_cell(cells, contender, s) for s in SIZES) + " |")
    big = cells.get(("infinity-cpu", "1.5b")), cells.get(("deepspeed-cpu", "1.5b"))
    if all(e is not None and e.record.get("gpu_peak_gib") and e.record.get("host_peak_gib") for e in big):
        ours, theirs = (e.record for e in big)
        lines += ["", f"At 1.5B with every state on cpu, infinity's GPU peak is {ours['gpu_peak_gib']:.1f} GiB "
                  f"({theirs['gpu_peak_gib']:.1f} for DeepSpeed) and its host peak {ours['host_peak_gib']:.1f} GiB "
                  f"({theirs['host_peak_gib']:.1f})."]
    if any(e.separate for e in entries):
        lines += ["", "\\* measured in a separate run on the same machine (see [docs/benchmarks.md](docs/benchmarks.md))."]
    return "\n".join(lines + ["", END])


def machine_of(env: dict) -> str:
    """"one NVIDIA H200 (driver ..., torch ...)" from a GPU check's env records."""
    gpu, torch_info = env.get("gpu", {}), env.get("torch_info", {})
    if not gpu:
        return "one GPU"
    return (f"one {gpu.get('name', 'GPU')} (driver {gpu.get('driver', '?')}, torch {torch_info.get('torch', '?')}, "
            f"CUDA {torch_info.get('cuda', '?')}, {env.get('host', {}).get('cpus', '?')}-core host)")


def apply(readme: str, text: str) -> Optional[str]:
    """``readme`` with the lines between the markers replaced by ``text``; None without the markers."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        return None
    return pattern.sub(lambda _: text, readme, count=1)

