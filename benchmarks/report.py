"""docs/benchmarks.md and its plots, and docs/measured.md, generated from the records in benchmarks/records/.

    python -m benchmarks.report            # write docs/benchmarks.md, docs/images/bench-*.png, docs/measured.md
    python -m benchmarks.report --check    # exit 1 if any would change (tests/unit runs it)

Every figure of docs/benchmarks.md comes from a record: the head-to-head (``peers`` result
records), where a step's time goes (``step_profile``), every other benchmark's results and
ratios (a section each), and for each record file the machine (the ``env`` phase of a GPU
check), its host-device and disk bandwidths (``device_primitives``), its test phases' pass
counts (``matrix``, ``ordering``, ``train``) and what ran (the file's row in
benchmarks/records/README.md, which every record file must have); the list of benchmarks comes
from their modules' docstrings. docs/measured.md is the transcribed records (``_measured.py``):
figures measured before the harness.

Note [merged cells]: the head-to-head table is one run's, the main one (the file with the most
ok ``peers`` cells), and a cell that run lacks or could not measure is taken from another
file's ok record of the same contender and size. Such a cell was measured at another time, so
its row, its bars (hatched) and every ratio it enters say that it comes from a separate run.

The plots and their digests are in ``_plots.py`` (Note [plot digests] in _plots.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from . import _harness, _headline, _measured, _models, peers
from ._measured import markdown_table
from ._plots import Figure, draw_peers, draw_profile, png_bytes, png_text  # noqa: F401 - png_text: tests read it

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "records"
PAGE = ROOT / "docs" / "benchmarks.md"
MEASURED = ROOT / "docs" / "measured.md"
IMAGES = ROOT / "docs" / "images"
PREFIX = "bench-"  # the PNGs under docs/images that this generator owns
SEPARATE = "separate run"


# ------------------------------------------------------------------ the records


@dataclass(frozen=True)
class Run:
    """One record file: one run of a benchmark, or of the GPU check with its phases."""
    path: Path
    records: tuple
    what_ran: str  # its row in benchmarks/records/README.md

    @property
    def name(self) -> str:
        return self.path.name

    def phase(self, name: str) -> List[dict]:
        return [r for r in self.records if r.get("phase") == name]

    def env(self) -> Dict[str, dict]:
        return {r["topic"]: r for r in self.phase("env") if "topic" in r}

    def bench(self, bench: str, kind: Optional[str] = None) -> List[dict]:
        return [r for r in self.records if r.get("bench") == bench and (kind is None or r.get("kind") == kind)]


def readme_rows(readme: Path) -> Dict[str, str]:
    """``{file name: what ran}`` from the README's table rows ``| `file.jsonl` | what ran |``."""
    rows = {}
    for line in readme.read_text().splitlines():
        match = re.match(r"\|\s*`([^`]+\.jsonl)`\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def load_runs(records: Path = RECORDS) -> List[Run]:
    readme = records / "README.md"
    described = readme_rows(readme)
    runs = []
    for path in sorted(records.glob("*.jsonl")):
        if path.name not in described:
            raise SystemExit(f"{path.name}: no row of {readme} says what ran; add one")
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs.append(Run(path, tuple(lines), described[path.name]))
    return runs


@dataclass(frozen=True)
class Entry:
    """One cell of the head-to-head: its record and the run it comes from."""
    record: dict
    run: Run
    separate: bool  # Note [merged cells]

    @property
    def key(self) -> tuple:
        return self.record["contender"], self.record["size"]


def _ok(record: dict) -> bool:
    return record.get("status") == "ok" and record.get("step_s") is not None


def main_run(runs: List[Run]) -> Optional[Run]:
    """The run whose head-to-head the table shows (Note [merged cells])."""
    with_peers = [r for r in runs if r.bench("peers", "result")]
    if not with_peers:
        return None
    return max(with_peers, key=lambda r: (sum(map(_ok, r.bench("peers", "result"))), len(r.bench("peers", "result"))))


def _cell_order(key: tuple) -> tuple:
    contender, size = key
    sizes, names = list(_models.SHAPES), list(peers.CONTENDERS)
    return (sizes.index(size) if size in sizes else len(sizes), size,
            names.index(contender) if contender in names else len(names), contender)


def merged_cells(runs: List[Run]) -> List[Entry]:
    """The head-to-head's cells: the main run's, a missing or failed one taken from another
    run's ok record (Note [merged cells])."""
    main = main_run(runs)
    if main is None:
        return []
    chosen: Dict[tuple, Entry] = {}
    for run in [main] + [r for r in runs if r is not main]:
        for record in run.bench("peers", "result"):
            entry = Entry(record, run, run is not main)
            have = chosen.get(entry.key)
            if have is None or (not _ok(have.record) and _ok(record)):
                chosen[entry.key] = entry
    return [chosen[key] for key in sorted(chosen, key=_cell_order)]


# ------------------------------------------------------------------ formatting


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading (as tests/unit/test_docs_links.py spells it)."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def run_heading(run: Run) -> str:
    return f"`{run.name}`"


def run_link(run: Run) -> str:  # to the run's section
    return f"[{run.path.stem}](#{anchor(run_heading(run))})"


def sig(x, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, "-" for None."""
    return "-" if x is None else f"{x:.{digits}g}"


def fixed(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def cell_text(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return text.replace("|", "\\|")


# ------------------------------------------------------------------ the head-to-head


def peers_row(entry: Entry) -> List[str]:
    r = entry.record
    source = f"**{SEPARATE}**: {run_link(entry.run)}" if entry.separate else run_link(entry.run)
    if not _ok(r):
        reason = f"{r['status']}" + (f": {cell_text(r['error'], 80)}" if r.get("error") else "")
        return [r["contender"], r["size"], reason, "-", "-", "-", "-", "-", source]
    span = f"{sig(r['step_s_min'])}-{sig(r['step_s_max'])}"
    losses = f"{fixed(r['first_loss'], 4)} → {fixed(r['last_loss'], 4)}"
    return [r["contender"], r["size"], sig(r["step_s"]), span, fixed(r["tflops"], 1), fixed(r["gpu_peak_gib"], 2),
            fixed(r["host_peak_gib"], 2), losses, source]


PEERS_HEADER = ["contender", "size", "step s (median)", "min-max", "TFLOP/s", "GPU peak GiB", "host peak GiB",
                "loss first → last", "run"]


def ratio_lines(cells: List[Entry]) -> List[str]:
    """infinity against DeepSpeed at the same placement, then every contender against plain, by size."""
    ok = [e for e in cells if _ok(e.record)]
    by_key = {e.key: e for e in ok}
    ratios = _harness.ratios(peers.BENCH, [e.record for e in ok], peers.PAIRS)
    order = {key: _cell_order(key) for key in by_key}  # (size, contender): vs DeepSpeed first, then vs plain
    ratios.sort(key=lambda q: (order[q["contender"], q["size"]][:2], q["vs"] == "plain", order[q["contender"], q["size"]]))
    lines = []
    for q in ratios:
        a, b = by_key[(q["contender"], q["size"])], by_key[(q["vs"], q["size"])]
        apart = [e.record["contender"] for e in (a, b) if e.separate]
        note = f" ({', '.join(apart)} from a {SEPARATE}: measured at another time)" if apart else ""
        faster = f" ({1 / q['step']:.2f}x faster)" if q["step"] and q["step"] < 1 else ""
        lines.append(f"- {q['size']}: **{q['contender']}** vs {q['vs']}: step time x{sig(q['step'])}{faster}; "
                     f"GPU peak x{sig(q['gpu_peak'])}; host peak x{sig(q['host_peak'])}{note}")
    return lines


def peers_figures(cells: List[Entry]) -> List["Figure"]:
    figures = []
    for size in dict.fromkeys(e.record["size"] for e in cells if _ok(e.record)):  # cells are in size order
        ok = [e for e in cells if _ok(e.record) and e.record["size"] == size]
        r = ok[0].record
        title = (f"GPT-2 {size.upper()} ({r['params'] / 1e9:.2f} B parameters), {r['dtype']}, {r['tokens_per_step']} "
                 f"tokens a step, {(r['device'] or '').replace('cuda: ', '')}")
        bars = [{"contender": e.record["contender"], "step_s": e.record["step_s"], "min": e.record["step_s_min"],
                 "max": e.record["step_s_max"], "gpu": e.record["gpu_peak_gib"], "host": e.record["host_peak_gib"],
                 "separate": e.separate} for e in ok]
        figures.append(Figure(f"{PREFIX}peers-{size}.png", f"the head-to-head at GPT-2 {size}",
                              {"title": title, "bars": bars}, draw_peers))
    return figures


def cells_line(cells: List[Entry]) -> str:
    """What the cells trained, as their records say."""
    ok = [e.record for e in cells if _ok(e.record)]
    sizes = {r["size"]: r["params"] for r in ok}
    what = ", ".join(f"{size} ({params / 1e9:.2f} B parameters)" for size, params in sizes.items())
    kinds = sorted({(r["dtype"], r["tokens_per_step"], (r["device"] or "").replace("cuda: ", "")) for r in ok})
    return f"Cells: GPT-2 {what}; " + "; ".join(f"{d}, {t} tokens a step, on {dev}" for d, t, dev in kinds) + "."


def peers_section(runs: List[Run]) -> tuple:
    cells = merged_cells(runs)
    if not cells:
        return [], []
    figures = peers_figures(cells)
    lines = ["## Head to head on one GPU", "",
             "`python -m benchmarks.peers`: every contender trains the same GPT-2 from the same weights on the same "
             "batches, each in a process of its own; the step time is the median of the timed steps (min-max "
             "beside it), TFLOP/s the dense-matmul estimate (6 x parameters x tokens / step time), the peaks are "
             "over the training steps. A row marked **separate run** was measured by another run, not beside the "
             "others: see its section under [the runs](#the-runs).", "", cells_line(cells), ""]
    lines += markdown_table(PEERS_HEADER, [peers_row(e) for e in cells]) + [""]
    for figure in figures:
        lines += [f"![{figure.alt}](images/{figure.name})", ""]
    ratios = ratio_lines(cells)
    if ratios:
        lines += ["### Ratios", "", "A quotient below 1 is the contender's figure smaller than the one it is "
                  "compared with (for the step time: faster).", ""] + ratios + [""]
    return lines, figures


# ------------------------------------------------------------------ where a step's time goes


PROFILE_COLUMNS = (("variant", "variant"), ("size", "size"), ("offload", "offload"), ("step s", "step_s"),
                   ("forward", "forward_s"), ("backward", "backward_s"), ("step() call", "step_call_s"),
                   ("update", "update_s"), ("update in background", "update_background_s"),
                   ("GPU busy", "gpu_busy_s"), ("GPU idle", "gpu_idle_s"), ("predicted", "predicted_step_s"),
                   ("GPU peak GiB", "gpu_peak_gib"))


def figure_of(record: dict, key: str):
    """A record's field, or its benchmark's own figure of that name."""
    return record[key] if key in record else record["extra"].get(key)


def profile_row(record: dict, run: Run) -> List[str]:
    cells = []
    for _, key in PROFILE_COLUMNS:
        value = figure_of(record, key)
        cells.append(value if isinstance(value, str) else sig(value))
    stalls = record["extra"].get("stall_s", {})
    cells.append(", ".join(f"{k} {sig(v)}" for k, v in sorted(stalls.items()) if v) or "-")
    if record["status"] != "ok":
        cells.append(f"{record['status']}: {cell_text(record.get('error') or '', 80)}")
    else:
        cells.append(f"{fixed(record['first_loss'], 4)} → {fixed(record['last_loss'], 4)}")
    return cells + [run_link(run)]


def profile_section(runs: List[Run]) -> tuple:
    rows = [(r, run) for run in runs for r in run.bench("step_profile", "result")]
    if not rows:
        return [], []
    header = [title for title, _ in PROFILE_COLUMNS] + ["stalls s", "loss first → last", "run"]
    parts = ("forward_s", "backward_s", "step_call_s", "gpu_busy_s", "gpu_idle_s")
    data = {"bars": [{"label": f"{r['size']} {r['extra']['offload']} {r['extra']['variant']}",
                      **{k: r["extra"].get(k) for k in parts}} for r, _ in rows if r["status"] == "ok"]}
    figure = Figure(f"{PREFIX}step-profile.png", "where a step's time goes", data, draw_profile)
    lines = ["## Where a step's time goes", "",
             "`python -m benchmarks.step_profile`: infinity's step split into forward, backward and the step() "
             "call, each part timed between device synchronizations (so the step here is longer than the "
             "head-to-head's), seconds a step, the median of the timed steps; GPU busy and idle are of one "
             "profiled step; stalls are the engine's waits by stage.", ""]
    lines += markdown_table(header, [profile_row(r, run) for r, run in rows]) + [""]
    return lines + [f"![{figure.alt}](images/{figure.name})", ""], [figure]


# ------------------------------------------------------------------ every other benchmark


SECTIONS = ("peers", "step_profile", "device_primitives")  # the benchmarks with sections of their own


def benchmark_list() -> List[str]:
    """Each benchmark module with the first line of its docstring, read without importing it."""
    import ast

    lines = []
    for path in sorted((ROOT / "benchmarks").glob("[!_]*.py")):
        if path.stem != "report":
            doc = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0].replace("``", "`")
            lines.append(f"- `python -m benchmarks.{path.stem}`: {' '.join(doc.split())}")
    return lines


def figures_text(extra: dict) -> str:
    """A record's own scalar figures, in brief."""
    return cell_text(", ".join(f"{k} {sig(v) if isinstance(v, float) else v}" for k, v in extra.items()
                               if isinstance(v, (int, float, str, bool)) and k != "where"), 120) or "-"


def other_sections(runs: List[Run]) -> List[str]:
    """A section per benchmark without one of its own: its result records and ratios, by run."""
    found: Dict[str, list] = {}
    for run in runs:
        for r in run.records:
            if r.get("kind") in ("result", "ratio") and r.get("bench") not in SECTIONS:
                found.setdefault(r["bench"], []).append((r, run))
    lines = []
    for bench, rows in sorted(found.items()):
        results = [(r, run) for r, run in rows if r["kind"] == "result"]
        lines += [f"### `{bench}`", "", f"`python -m benchmarks.{bench}`:", ""]
        lines += markdown_table(["contender", "size", "step s (median)", "min-max", "figures", "status", "run"], [
            [r["contender"], r["size"], sig(r["step_s"]),
             "-" if r["step_s"] is None else f"{sig(r['step_s_min'])}-{sig(r['step_s_max'])}", figures_text(r["extra"]),
             r["status"] + (f": {cell_text(r['error'], 80)}" if r.get("error") else ""), run_link(run)]
            for r, run in results]) + [""]
        lines += [f"- {cell_text(_harness.ratio_text(q), 200)} ({run_link(run)})" for q, run in rows
                  if q["kind"] == "ratio"]
        lines += [""] if lines[-1] else []
    return lines


# ------------------------------------------------------------------ the runs


def machine_line(run: Run) -> str:
    env = run.env()
    if not env:
        devices = sorted({r["device"] for r in run.records if r.get("device")})
        named = f"; the device its records name: {', '.join(d.replace('cuda: ', '') for d in devices)}" if devices else ""
        return f"- Machine: not recorded in this file (no `env` records){named}."
    gpu, tor, host = env.get("gpu", {}), env.get("torch_info", {}), env.get("host", {})
    libs = env.get("libraries", {})
    return (f"- Machine: {gpu.get('gpus', '?')} x {gpu.get('name', tor.get('device', '?'))} ({gpu.get('memory', '?')}), "
            f"driver {gpu.get('driver', '?')}; torch {tor.get('torch', '?')}, CUDA {tor.get('cuda', '?')}, "
            f"NCCL {tor.get('nccl', '?')}, Python {host.get('python', '?')}, transformers "
            f"{libs.get('transformers', '?')}; host: {host.get('cpu', '?')}, {host.get('cpus', '?')} cores "
            f"({host.get('cpus_usable', '?')} usable), {host.get('ram_gib', '?')} GiB RAM, kernel "
            f"{host.get('kernel', '?')}; aio backend {env.get('aio', {}).get('aio_backend', '?')}.")


def bandwidth_lines(run: Run) -> List[str]:
    prims = [r for r in run.bench("device_primitives", "result") if r["status"] == "ok"]
    copies = {(r["contender"].split("-")[0], r["extra"]["host"]): r["extra"] for r in prims
              if r["contender"].startswith(("h2d-", "d2h-"))}
    lines = []
    if copies:
        hosts = list(dict.fromkeys(host for _, host in copies))
        size = next(iter(copies.values()))["bytes"] / 2**20

        def gbps(x):
            return f"{x['gbps']:.1f} ({x['min_gbps']:.1f}-{x['max_gbps']:.1f})" if x else "-"

        rows = [[host, gbps(copies.get(("h2d", host))), gbps(copies.get(("d2h", host)))] for host in hosts]
        lines += [f"- PCIe, copies of {size:.0f} MiB (GB/s, median and min-max):", ""]
        lines += ["  " + line for line in markdown_table(["host memory", "host → device", "device → host"], rows)] + [""]
    for r in (r for r in prims if r["contender"].startswith("aio-")):
        x = r["extra"]
        lines.append(f"- Disk, {r['contender'].split('-')[1]}: {x['gbps']:.2f} GB/s ({x['min_gbps']:.2f}-"
                     f"{x['max_gbps']:.2f}), {x['bytes'] / 2**30:.0f} GiB through `infinity.aio` ({x['backend']}, "
                     f"{'O_DIRECT, ' if x.get('o_direct') else ''}{x['fs']}, {x['block_size'] // 2**20} MiB blocks, "
                     f"queue depth {x['queue_depth']})")
    return lines


def tested_lines(run: Run) -> List[str]:
    """The pass counts of the check's test phases, the losses of its training run."""
    lines = []
    for phase in ("matrix", "ordering"):
        tests = [r for r in run.phase(phase) if "outcome" in r]
        if tests:
            counts = collections.Counter(r["outcome"] for r in tests)
            failed = [r["test"].split("::")[-1] for r in tests if r["outcome"] not in ("passed", "skipped")]
            lines.append(f"- `{phase}` tests on the device: {len(tests)}, "
                         + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                         + (f" (not passed: {', '.join(failed)})" if failed else ""))
    for r in (r for r in run.phase("train") if "losses" in r):
        losses = [step["loss"] for step in r["losses"]]
        lines.append(f"- `train` ({r.get('backend', '?')}): exit {r['rc']}, {len(losses)} steps, loss "
                     f"{losses[0]:.4f} → {losses[-1]:.4f}")
    return lines


def phase_rows(run: Run) -> List[List[str]]:
    done = [r for r in run.records if r.get("phase") and "status" in r and "seconds" in r]
    return [[r["phase"], r["status"], f"{r['seconds']:.1f}", str(r.get("records", "-")),
             cell_text(r.get("reason", ""), 100) or "-"] for r in done]


def replaced_lines(run: Run, cells: List[Entry]) -> List[str]:
    """The run's peers cells the table shows from another run (Note [merged cells])."""
    shown = {id(e.record) for e in cells}
    lines = []
    for r in run.bench("peers", "result"):
        if id(r) not in shown:
            other = next(e for e in cells if e.key == (r["contender"], r["size"]))
            lines.append(f"- `peers` cell not in the table: {r['contender']} at {r['size']}, {r['status']} "
                         f"({cell_text(r.get('error') or '', 120)}); the table shows {run_link(other.run)}'s")
    return lines


def run_section(run: Run, cells: List[Entry]) -> List[str]:
    lines = [f"### {run_heading(run)}", "", f"[records](../benchmarks/records/{run.name}); what ran: {run.what_ran}", ""]
    transcribed = [r for r in run.records if r.get("kind") == "transcribed"]
    if transcribed:
        return lines + [f"- Transcribed figures, measured before the harness on the machines each names: "
                        f"{len(transcribed)} sections, in [measured figures](measured.md)", ""]
    lines += [machine_line(run)] + bandwidth_lines(run) + tested_lines(run) + replaced_lines(run, cells)
    others = collections.Counter(r["bench"] for r in run.records if r.get("kind") == "result"
                                 and r["bench"] not in SECTIONS)
    lines += [f"- `{bench}` results: {n}, in [{bench}](#{anchor(f'`{bench}`')})" for bench, n in sorted(others.items())]
    n_peers, n_profile = len(run.bench("peers", "result")), len(run.bench("step_profile", "result"))
    if n_peers:
        lines.append(f"- `peers` cells: {n_peers}, in the [head-to-head](#head-to-head-on-one-gpu)"
                     + (f" as a **{SEPARATE}**" if any(e.run is run and e.separate for e in cells) else ""))
    if n_profile:
        lines.append(f"- `step_profile` cells: {n_profile}, in [where a step's time goes](#where-a-steps-time-goes)")
    rows = phase_rows(run)
    if rows:
        lines += ["", "Phases of the check:", ""] + markdown_table(["phase", "status", "seconds", "records", "reason"], rows)
    return lines + [""]


# ------------------------------------------------------------------ the page


def benchmarks_page(runs: List[Run]) -> tuple:
    """(the page's text, its figures)."""
    head = ["# Benchmarks", "",
            "<!-- Generated by `python -m benchmarks.report` from benchmarks/records/*.jsonl: do not edit; "
            "`python -m benchmarks.report --check` (a unit test) fails when this page or its plots are stale. -->",
            "", "Every figure on this page comes from the JSON records of the benchmarks in `benchmarks/` (one "
            "record schema, `benchmarks/_harness.py`), kept as measured in "
            "[benchmarks/records](../benchmarks/records/README.md). To add a run, put its records file there "
            "with a row in that README saying what ran, then regenerate this page. Older figures, measured "
            "before the harness, are in [measured figures](measured.md).", ""]
    peers_lines, peers_figs = peers_section(runs)
    profile_lines, profile_figs = profile_section(runs)
    others = ["## Every benchmark", "", "Each runs from the repository root as `python -m benchmarks.<name>` "
              "(`--smoke`: seconds on a CPU, which the tests run, most under `-m slow`), its contenders measured in the "
              "same run and the ratios printed; a benchmark's records, once in benchmarks/records, get a section here.", ""]
    others += benchmark_list() + [""] + other_sections(runs)
    cells = merged_cells(runs)
    runs_lines = ["## The runs", "", "One section per records file: what ran, on which machine, and what else "
                  "that run measured.", ""]
    main = main_run(runs)
    for run in sorted(runs, key=lambda r: (r is not main, r.name)):
        runs_lines += run_section(run, cells)
    text = "\n".join(head + peers_lines + profile_lines + others + runs_lines).rstrip("\n") + "\n"
    return text, peers_figs + profile_figs


# ------------------------------------------------------------------ write or check


def _orphans(figures: List[Figure], images: Path) -> List[Path]:
    """The PNGs of this generator (``PREFIX``) that no figure of the page is drawn to."""
    names = {f.name for f in figures}
    return [path for path in sorted(images.glob(PREFIX + "*.png")) if path.name not in names]


def stale(text: str, figures: List[Figure], page: Path = PAGE, images: Path = IMAGES) -> List[str]:
    """What would change: the page, a figure missing or drawn from other data, a PNG no figure owns."""
    problems = []
    if not page.exists() or page.read_text() != text:
        problems.append(f"{page.name}: not what the records give")
    for figure in figures:
        path = images / figure.name
        if not path.exists():
            problems.append(f"{figure.name}: missing")
        elif png_text(path.read_bytes()).get("Comment") != figure.digest():
            problems.append(f"{figure.name}: drawn from other data or code")
    return problems + [f"{path.name}: no figure of the page" for path in _orphans(figures, images)]


def write(text: str, figures: List[Figure], page: Path = PAGE, images: Path = IMAGES) -> List[str]:
    """Write what is stale; the names written or removed."""
    changed = []
    if not page.exists() or page.read_text() != text:
        page.write_text(text)
        changed.append(page.name)
    images.mkdir(parents=True, exist_ok=True)
    for figure in figures:
        path, data = images / figure.name, png_bytes(figure)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            changed.append(figure.name)
    for path in _orphans(figures, images):
        path.unlink()
        changed.append(f"{path.name} (removed)")
    return changed


def readme_with_headline(runs: List[Run], readme: Path = ROOT / "README.md") -> tuple:
    """(the README now, the README with the headline the records give; None without its markers)."""
    main, now = main_run(runs), readme.read_text()
    machine = _headline.machine_of(main.env() if main is not None else {})
    return now, _headline.apply(now, _headline.block(merged_cells(runs), machine))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page or a plot is stale")
    args = p.parse_args(argv)
    runs = load_runs()
    text, figures = benchmarks_page(runs)
    measured = _measured.measured_page(runs)
    readme_now, readme = readme_with_headline(runs)
    if args.check:
        problems = stale(text, figures) + (["README.md: its headline is not what the records give"]
                                           if readme is not None and readme != readme_now else [])
        problems += [] if MEASURED.exists() and MEASURED.read_text() == measured else \
            [f"{MEASURED.name}: not what the transcribed records give"]
        for problem in problems:
            print(f"stale: {problem} (regenerate with: python -m benchmarks.report)", file=sys.stderr)
        return 1 if problems else 0
    if readme is not None and readme != readme_now:
        (ROOT / "README.md").write_text(readme)
        print("wrote README.md (its headline)")
    for name in write(text, figures):
        print(f"wrote {name}")
    if not MEASURED.exists() or MEASURED.read_text() != measured:
        MEASURED.write_text(measured)
        print(f"wrote {MEASURED.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
