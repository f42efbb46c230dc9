"""The summary of ``python -m infinity.train``: rank 0's closing table (the run, memory per
tier, step time by phase, disk traffic and SSD writes, the engine's telemetry, what was saved)
from every rank's figures, and the telemetry's summary event."""
from __future__ import annotations

import resource
import socket
from typing import Dict, List, Optional

from .._offload._drives import configured_drives
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._telemetry import TIER_SECONDS, StepStats, fmt_bytes, fmt_count, fmt_rate, is_level, mean, render_table
from .._runtime._topology import current as placed_share
from ..config.validate import split_fractions
from ._train_loop import Run


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _state_rows(per_rank: List[dict]) -> List[tuple]:
    """Bytes each tier holds for model states, staging pools included, summed over ranks."""
    rows = [("bytes per tier", "device", "cpu", "nvme")]
    totals = {t: sum(r["tiers"].get(t, 0) for r in per_rank) for t in ("device", "host", "nvme")}
    rows.append(("  model states, all ranks", *(fmt_bytes(totals[t]) for t in ("device", "host", "nvme"))))
    return rows


def _time_rows(stats: StepStats) -> List[tuple]:
    recs = stats.measured()
    step = mean(r["step_s"] for r in recs) or 1e-12
    rows = [("step time (mean)", "s/step", "share")]
    parts = [("forward", "forward_s"), ("backward", "backward_s"), ("optimizer", "optimizer_s")]
    accounted = 0.0
    for label, key in parts:
        value = mean(r[key] for r in recs)
        accounted += value
        rows.append((f"  {label}", f"{value:.4f}", f"{100 * value / step:.0f}%"))
    stall = mean(r["stall_s"] for r in recs)
    rows.append(("  other (data, logging)", f"{step - accounted:.4f}", f"{100 * (step - accounted) / step:.0f}%"))
    rows.append(("  stall (inside the above)", f"{stall:.4f}", f"{100 * stall / step:.0f}%"))
    rows.append(("  total", f"{step:.4f}", "100%"))
    return rows


def _disk_rows(run: Run, per_rank: List[dict]) -> List[tuple]:
    elapsed = sum(r["step_s"] for r in run.stats.records) or 1e-12
    rows = [("disk bandwidth (nvme)", "achieved", "measured")]
    for direction in ("read", "write"):
        moved = sum(r["nvme"].get(direction, 0.0) for r in per_rank)
        achieved = fmt_rate(moved / elapsed) if moved else "no traffic"
        measured = fmt_rate(run.disk[direction]) if run.disk else "not probed"
        rows.append((f"  {direction}", achieved, measured))
    moved = sum(r["nvme"].get("total", 0.0) for r in per_rank)
    rows.append(("  moved in training", f"{fmt_bytes(moved)} ({fmt_bytes(moved / max(1, len(run.stats.records)))} per step)"))
    rows += drive_rows(per_rank, elapsed)
    steps = max(1, len(run.stats.records))
    tbw = run.cfg.aio.endurance_tbw
    for path in sorted({p for r in per_rank for p in r.get("ssd", {})}):
        written = sum(r["ssd"].get(path, 0) for r in per_rank)
        share = f", {100 * written / (tbw * 1e12):.2g}% of aio.endurance_tbw" if tbw else ""
        rows.append((f"  SSD writes to {path}", f"{fmt_bytes(written)} this run, initialize and checkpoints "
                                                f"included ({fmt_bytes(written / steps)} per step{share})"))
    return rows


def drive_traffic(run: Run) -> Dict[str, Dict[str, float]]:
    """This rank's bytes read and written on each drive over its steps (the engine's
    ``drive<k>_*_bytes``; Note [many drives] in _offload/_drives.py)."""
    out = {}
    for k, drive in enumerate(configured_drives(run.cfg)):
        read, write = (sum(run.stats.column(f"engine.drive{k}_{d}_bytes")) for d in ("read", "write"))
        if read or write:
            out[drive] = {"read": read, "write": write}
    return out


def drive_totals(per_rank: List[dict]) -> Dict[str, Dict[str, float]]:
    """Bytes read and written on each drive in training, every rank's together."""
    drives = sorted({d for r in per_rank for d in r.get("drives", {})})
    return {d: {k: sum(r.get("drives", {}).get(d, {}).get(k, 0.0) for r in per_rank) for k in ("read", "write")}
            for d in drives}


def drive_rows(per_rank: List[dict], elapsed: float) -> List[tuple]:
    """Bytes and GB/s of each drive in training, every rank's together (none with one drive
    and one rank: the lines above say it)."""
    totals = drive_totals(per_rank)
    if len(totals) < 2 and len(per_rank) < 2:
        return []
    rows: List[tuple] = [("  per drive, all ranks (all swap-file I/O)", "read", "write", "moved")]
    for d, t in totals.items():
        rows.append((f"    {d}", fmt_rate(t["read"] / elapsed), fmt_rate(t["write"] / elapsed),
                     fmt_bytes(t["read"] + t["write"])))
    return rows


def _tier_words(section) -> str:
    """An offload section's tier, with its split (Note [split tiers] in _offload/_split.py)."""
    fr = split_fractions(section.split)
    if fr is None:
        return section.device
    return section.device + " (split " + ", ".join(f"{t} {v:g}" for t, v in fr.items() if v) + ")"


def summary_text(run: Run, per_rank: List[dict]) -> str:
    cfg, stats = run.cfg, run.stats
    losses = stats.column("loss")
    tail = losses[-max(1, len(losses) // 10):]
    comm_step = mean(r["comm_bytes"] for r in stats.measured())
    head = [
        ("model", run.spec.description),
        ("parameters", f"{fmt_count(run.n_params)} ({run.n_params:,})"),
        ("run", f"{len(losses)} steps, {comm.world_size()} rank(s), ZeRO stage {cfg.zero.stage}, "
                f"{cfg.precision.dtype}, offload param={_tier_words(cfg.zero.offload_param)} "
                f"optimizer={_tier_words(cfg.zero.offload_optimizer)}"),
        ("batch", f"{run.batches.global_batch} x {cfg.train.seq_len} tokens per step"),
        ("loss", f"{losses[0]:.4f} -> {losses[-1]:.4f} (mean of last {len(tail)}: {mean(tail):.4f})"),
        ("throughput", f"{stats.median('tokens_per_s'):.0f} tokens/s (median step {stats.median('step_s'):.3f} s)"),
        ("communication", f"{fmt_bytes(comm_step)} per step"),
    ]
    skipped = sum(1 for r in stats.records if r.get("skipped"))
    if skipped:
        why = "fp16 overflow" if cfg.precision.dtype == "fp16" else "inf/NaN loss or gradients"
        head.append(("skipped steps", f"{skipped} of {len(losses)} ({why}; parameters left unchanged)"))
    rss = [r["peak_rss"] for r in per_rank]
    memory = _state_rows(per_rank) + [
        ("peak RSS", f"{fmt_bytes(max(rss))} (max of {len(rss)} rank(s); rank 0 {fmt_bytes(rss[0])})"),
        ("engine device peak", fmt_bytes(max(r["device_peak"] for r in per_rank))),
    ] + ([("device allocator peak", f"{fmt_bytes(max(r['allocator_peak'] for r in per_rank))} (all of the device's "
                                     f"memory the run used, activations included)")]
         if acc.has_accelerator() else [])
    sections = [head, placement_rows(per_rank), memory, _time_rows(stats), _disk_rows(run, per_rank)] + \
        tier_rows(stats) + engine_rows(stats, per_rank)
    sections.append([("saved", _saved_text(run)), ("telemetry", run.telemetry.path or "off (no output_dir)")])
    return render_table("infinity.train summary", sections)


PLACEMENT_ROWS = 16  # ranks listed in the table at most; the summary event has them all


def placement_rows(per_rank: List[dict]) -> List[tuple]:
    """Where each rank runs: its threads, CPUs and NUMA node (Note [rank placement] in _topology.py)."""
    rows = [("where each rank runs", "")]
    for rank, r in enumerate(per_rank[:PLACEMENT_ROWS]):
        rows.append((f"  rank {rank} on {r['host']}", r["placement"]))
    if len(per_rank) > PLACEMENT_ROWS:
        rows.append((f"  {len(per_rank) - PLACEMENT_ROWS} more rank(s)", "in the telemetry's summary event"))
    return rows


# The engine's bytes of a state on a tier, where it counts them: the stores' swap-file traffic, the
# fetches from a split's host share (an optimizer's host share is updated in place: no bytes move)
STATE_TIER_BYTES = {("optimizer", "nvme"): ("nvme_optimizer_read_bytes", "nvme_optimizer_write_bytes"),
                    ("params", "nvme"): ("nvme_params_read_bytes", "nvme_params_write_bytes"),
                    ("params", "cpu"): ("bytes.param_host",)}


def tier_rows(stats: StepStats) -> List[List[tuple]]:
    """Each state on each of its tiers: rank 0's bytes and seconds per step, and the tier's share of
    the state's seconds (``tier_seconds``: Note [engine telemetry keys] in _telemetry.py); none
    without them."""
    prefix = f"engine.{TIER_SECONDS}."
    seconds = {tuple(k[len(prefix):].split(".")): mean(stats.column(k))
               for k in sorted({k for r in stats.records for k in r if k.startswith(prefix)})}
    if not seconds:
        return []
    rows = [("per state and tier, rank 0", "bytes/step", "s/step", "time share")]
    for (state, tier), s in seconds.items():
        of_state = sum(v for (st, _), v in seconds.items() if st == state)
        counted = [k for k in STATE_TIER_BYTES.get((state, tier), ()) if stats.column(f"engine.{k}")]
        moved = fmt_bytes(sum(mean(stats.column(f"engine.{k}")) for k in counted)) if counted else "-"
        rows.append((f"  {state} on {tier}", moved, f"{s:.4f}", f"{100 * s / of_state:.0f}%" if of_state else "-"))
    return [rows]


def engine_rows(stats: StepStats, per_rank: List[dict]) -> List[List[tuple]]:
    """The engine's telemetry (Note [engine telemetry keys] in _telemetry.py): rank 0's counts per step and over
    the run; levels and peaks with their largest value over the steps and every rank."""
    keys = sorted({k for r in stats.records for k in r if k.startswith("engine.")})
    counts = [k for k in keys if not is_level(k[7:])]
    levels = [k for k in keys if is_level(k[7:])]
    sections = []
    if counts:
        sections.append([("engine telemetry, rank 0", "mean/step", "total")] +
                        [(f"  {k[7:]}", f"{mean(stats.column(k)):.4g}", f"{sum(stats.column(k)):.4g}") for k in counts])
    if levels:
        sections.append([("engine levels and peaks", "rank 0 mean", "max, ranks")] +
                        [(f"  {k[7:]}", f"{mean(stats.column(k)):.4g}",
                          f"{max(r['levels'].get(k, float('-inf')) for r in per_rank):.4g}") for k in levels])
    return sections


def _levels(stats: StepStats) -> dict:
    """This rank's largest value of each level over its steps (Note [engine telemetry keys] in _telemetry.py)."""
    keys = {k for r in stats.records for k in r if k.startswith("engine.") and is_level(k[7:])}
    return {k: max(stats.column(k)) for k in keys}


def _saved_text(run: Run) -> str:
    if run.export is None:
        stopped = getattr(run.checkpoints, "stopped_by", None)
        if stopped is not None:  # Note [preemption] in _checkpoint/_train.py: the checkpoint resumes the run
            return f"not saved (stopped by {stopped}: the run resumes from its checkpoint)"
        return "not saved (--no-save or no output_dir)"
    return (f"{run.export.directory} ({len(run.export.files)} safetensors file(s), "
            f"{fmt_bytes(run.export.total_bytes)}, {run.export_s:.1f} s)")


def finish(run: Run) -> Optional[str]:
    engine, share = run.optimizer.engine, placed_share()
    mine = {"peak_rss": _peak_rss(), "tiers": engine.tier_bytes(),
            "device_peak": engine.device_budget.stats().peak, "allocator_peak": acc.max_memory_allocated(),
            "nvme": run.stats.tier_totals().get("nvme", {}), "ssd": run.ssd.written() if run.ssd is not None else {},
            "levels": _levels(run.stats), "host": socket.gethostname(),
            "placement": share.describe() if share is not None else "not placed"}
    mine["drives"] = drive_traffic(run)  # Note [many drives] in _offload/_drives.py
    per_rank = comm.all_gather_object(mine)
    if not run.rank0:
        return None
    text = summary_text(run, per_rank)
    elapsed = sum(r["step_s"] for r in run.stats.records) or 1e-12  # as the disk rows take it
    run.telemetry.event({"event": "summary", "peak_rss_per_rank": [r["peak_rss"] for r in per_rank],
                         "disk_probe": run.disk, "tier_totals": run.stats.tier_totals(),
                         "drive_bytes": drive_totals(per_rank),
                         "drive_gb_per_s": {d: {k: v / elapsed / 1e9 for k, v in t.items()}
                                            for d, t in drive_totals(per_rank).items()},
                         "ssd_written_bytes": {p: sum(r["ssd"].get(p, 0) for r in per_rank)
                                               for p in sorted({p for r in per_rank for p in r["ssd"]})},
                         "placement_per_rank": [{"host": r["host"], "placement": r["placement"]} for r in per_rank],
                         "skipped_steps": sum(1 for r in run.stats.records if r.get("skipped")),
                         "export": run.export.__dict__ if run.export else None})
    return text
