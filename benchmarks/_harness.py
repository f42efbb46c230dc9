"""The benchmarks' harness: contenders in processes of their own, rounds, one record schema.

A benchmark names its cells (a contender at a model size), says how to build one cell's child
spec, and gives the function its child runs (``measure``); ``run_cells`` does the rest:

- each cell runs in a process of its own (``python -m benchmarks.<name> --child SPEC``), so its
  memory peaks, threads and process group are its own, under a time limit (``--timeout``, cut to
  what is left of ``--budget``); a crash or a timeout becomes the cell's record with its error
  and the next cell still runs; a cell that cannot run here (``Cell.skip``) is recorded as
  skipped with the reason, not as a failure;
- Note [contender rounds]: machines drift (GPU clocks, page cache, other tenants), so with
  ``--rounds N`` every cell runs once per round, the order rotated by one each round, and a
  cell's figures are taken over all its rounds: the median step time with the fastest and the
  slowest step, the largest peaks. Only one child runs at a time. A cell that failed is not
  run again;
- each cell's record is printed as one JSON line once its last round is done (and appended to
  ``--out``); the child's own output goes to stderr, so stdout holds only records and the
  closing table with the ratios (``finish``).

Note [contenders side by side]: where a comparison needs one process (the same buffers, one
file, the machine at the same moment: ours against fio, CPU Adam against torch's, checksums on and
off), a cell names its contenders in ``Cell.side_by_side`` and its child measures them in turns
and returns ``side_by_side({name: sample})``; each contender still gets a record of its own.

Record schema (``RESULT_FIELDS``), one per contender and size: ``bench``, ``kind`` ("result"),
``contender``, ``size``, ``status`` (ok, error, timeout, skipped), ``step_s`` (median of the
timed steps, seconds, each step timed between device synchronizes; in a benchmark of a primitive
a step is one timed repetition of what it measures: one pass over a file, one Adam step),
``step_s_min``, ``step_s_max``, ``steps`` (timed steps in all rounds), ``rounds``, ``tflops`` (6 x
params x tokens per step / step_s / 1e12: the dense-matmul estimate, no attention term; None
where nothing trains), ``gpu_peak_gib`` (the device's peak allocated bytes over the training
steps, None without a GPU), ``host_peak_gib`` (Note [host peak] in _flags.py: over the training
steps), ``first_loss`` (the loss of the first batch, before any update), ``last_loss``,
``params``, ``tokens_per_step``, ``device``, ``dtype``, ``error`` (None when ok; the reason when
skipped), ``extra`` (the benchmark's own figures, a dict). Ratio lines (``RATIO_FIELDS``):
``bench``, ``kind`` ("ratio"), ``size``, ``contender``, ``vs``, the quotients ``step``,
``gpu_peak``, ``host_peak`` (contender over vs) and ``extra`` (quotients of the two records'
``extra`` figures the benchmark names, such as bytes or GB/s). Transcribed records
(``TRANSCRIBED_FIELDS``, kind "transcribed") are figures measured before the harness, copied
from the page that held them: ``section``, ``run`` (the command, as spelt now, and the
conditions), ``machine``, ``measured`` (when), ``source`` (the page and commit copied from) and
``body``, the section's paragraphs (strings) and tables (``{"header": [...], "rows": [[...]]}``)
in order; ``python -m benchmarks.report`` renders them as docs/measured.md.
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import _flags

GiB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_CELL_SECONDS = 15.0  # a cell that would get less is skipped (not in --smoke)


def disk_probe_bytes(smoke: bool) -> int:
    """Bytes the run model's disk probe moves (``Rates.measure``): a smoke's figures are checked
    for shape, not value, so a few MiB do."""
    return (8 if smoke else 256) << 20
_NUMBER = (int, float, type(None))
RESULT_FIELDS = {
    "bench": str, "kind": str, "contender": str, "size": str, "status": str, "step_s": _NUMBER,
    "step_s_min": _NUMBER, "step_s_max": _NUMBER, "steps": int, "rounds": int, "tflops": _NUMBER,
    "gpu_peak_gib": _NUMBER, "host_peak_gib": _NUMBER, "first_loss": _NUMBER, "last_loss": _NUMBER,
    "params": _NUMBER, "tokens_per_step": int, "device": (str, type(None)), "dtype": str,
    "error": (str, type(None)), "extra": dict,
}
RATIO_FIELDS = {"bench": str, "kind": str, "size": str, "contender": str, "vs": str, "step": _NUMBER,
                "gpu_peak": _NUMBER, "host_peak": _NUMBER, "extra": dict}
TRANSCRIBED_FIELDS = {"bench": str, "kind": str, "section": str, "run": str, "machine": str, "measured": str,
                      "source": str, "body": list}
FIELDS = {"result": RESULT_FIELDS, "ratio": RATIO_FIELDS, "transcribed": TRANSCRIBED_FIELDS}
STATUSES = ("ok", "error", "timeout", "skipped")
WRAPPER_FIELDS = ("phase",)  # scripts/gpu_check/phase.py adds the phase to every record it keeps


def check_record(record: dict) -> List[str]:
    """What is wrong with ``record`` against its schema (empty when nothing); the GPU check's
    ``phase`` beside the record is not the record's."""
    record = {k: v for k, v in record.items() if k not in WRAPPER_FIELDS}
    fields = FIELDS.get(record.get("kind"))
    if fields is None:
        return [f"kind: {record.get('kind')!r} is not one of {', '.join(FIELDS)}"]
    problems = [f"{k}: missing" for k in fields if k not in record]
    problems += [f"{k}: unknown field" for k in record if k not in fields]
    problems += [f"{k}: {type(record[k]).__name__} is not {fields[k]}" for k in fields
                 if k in record and not isinstance(record[k], fields[k])]
    if record.get("kind") == "result" and record.get("status") not in STATUSES:
        problems.append(f"status: {record.get('status')!r} is not one of {STATUSES}")
    return problems


# ------------------------------------------------------------------ a contender's process


def sync_device() -> None:
    """Wait for everything queued on the GPU (nothing to wait for without one)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peaks() -> bool:
    """Restart the device's and the host's peaks (Note [host peak] in _flags.py)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return _flags.reset_host_peak()


def peaks() -> dict:
    """``{"gpu": bytes or None, "host": bytes or None}`` since the last ``reset_peaks``."""
    import torch

    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"gpu": gpu, "host": _flags.host_peak_bytes()}


def timed_steps(trainer, batches: list, warmup: int, steps: int, at_timed: Callable[[], None] = lambda: None) -> dict:
    """``warmup`` untimed steps, then ``steps`` steps each timed from a device synchronize before
    it to one after; the last also waits for the trainer's overlapped work (``finish``), which
    belongs to it. Losses are read after each step's clock stopped. ``at_timed`` runs before the
    first timed step (counters start there)."""
    times, losses = [], []
    for i, ids in enumerate(batches[:warmup + steps]):
        sync_device()
        if i == warmup:
            at_timed()
        start = time.perf_counter()
        loss = trainer.step(ids)
        if i == warmup + steps - 1:
            trainer.finish()
        sync_device()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return {"times": times, "losses": losses}


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes, by the host's clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sample(times: Sequence[float], *, losses: Sequence[float] = (), extra: Optional[dict] = None, **fields) -> dict:
    """What a child returns for one contender: its timed steps' seconds, the losses if it
    trained, its own figures (``extra``) and any of ``params``, ``tokens_per_step``, ``device``,
    ``dtype``, ``gpu_peak``, ``host_peak`` (bytes)."""
    return {"times": list(times), "losses": list(losses), "extra": dict(extra or {}), **fields}


def skipped(reason: str) -> dict:
    """A contender of a side-by-side cell that could not run here (Note [contenders side by side])."""
    return {"skipped": reason}


def side_by_side(samples: Dict[str, dict]) -> dict:
    """A side-by-side cell's child result: one sample per contender (Note [contenders side by side])."""
    return {"contenders": samples}


def use_tree(path: Optional[str]) -> None:
    """Import infinity from another checkout (an earlier commit, its native libraries built) in
    this child: before anything imported infinity."""
    if path:
        if "infinity" in sys.modules:
            raise RuntimeError("use_tree: infinity is already imported from this checkout")
        sys.path.insert(0, os.path.abspath(path))


def child_main(measure: Callable[[dict], dict], spec_json: str) -> None:
    """In the child: run ``measure(spec)``, write what it returns where the parent reads it (or
    print it as JSON where the spec names no ``result_path``), and exit at once: the
    interpreter's teardown (freeing pinned host memory buffer by buffer, a CUDA context, process
    groups) is no part of any figure and takes seconds of the budget."""
    spec = json.loads(spec_json)
    result = measure(spec)
    if "result_path" in spec:
        with open(spec["result_path"], "w") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse(parser, measure: Callable[[dict], dict], argv=None):
    """The benchmark's command line; with ``--child`` this process is one cell's child: it runs
    ``measure`` and exits (``child_main``)."""
    args = parser.parse_args(argv)
    if args.child:
        child_main(measure, args.child)
    return args


def _error_line(lines) -> str:
    """The line that names the error: the last ``SomethingError: ...`` line (a rank's prefix
    such as ``[rank0]:`` dropped), else the last line printed."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in lines if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*", line)]
    return (named or lines or [""])[-1]


def _innermost_frame(output: str) -> str:
    frames = re.findall(r'File "([^"]*/(?:infinity|benchmarks|deepspeed|torch)/[^"]+)", line (\d+)', output)
    if not frames:
        return ""
    path, line = frames[-1]
    cut = max(path.rfind(f"/{top}/") for top in ("infinity", "benchmarks", "deepspeed", "torch"))
    return f"{path[cut + 1:]}:{line}"


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's whole group (torchrun's workers, a benchmark's children), SIGKILL
    5 s later; scripts/gpu_check/phase.py stops its phases with it too."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass


def spawn(target: str, spec: dict, timeout: float, env: Optional[dict] = None, python: str = sys.executable) -> dict:
    """Run one cell's child, ``python -m target --child SPEC`` (``target`` a module) or ``python
    target --child SPEC`` (a script's path); its result, or ``{"status": error|timeout, "error",
    "where"}``. What the child prints is copied to this process's stderr as it comes."""
    fd, result_path = tempfile.mkstemp(prefix="bench_result_", suffix=".json")
    os.close(fd)
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))  # its lines reach the log as they come
    child_env["PYTHONPATH"] = ROOT + (os.pathsep + child_env["PYTHONPATH"] if child_env.get("PYTHONPATH") else "")
    how = [target] if target.endswith(".py") else ["-m", target]
    cmd = [python, *how, "--child", json.dumps(dict(spec, result_path=result_path))]
    tail: collections.deque = collections.deque(maxlen=60)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    fired = threading.Event()
    timer = threading.Timer(timeout, lambda: (fired.set(), stop_group(proc)))
    timer.start()
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line.rstrip())
        rc = proc.wait()
    finally:
        timer.cancel()
        stop_group(proc)  # whatever the child left behind in its group
    try:
        with open(result_path) as f:
            text = f.read()
    finally:
        os.unlink(result_path)
    if rc == 0 and text:
        return json.loads(text)
    output = "\n".join(tail)
    if fired.is_set():
        return {"status": "timeout", "error": f"timed out after {timeout:.0f} s", "where": _innermost_frame(output)}
    return {"status": "error", "error": f"exit {rc}: {_error_line(tail)[-300:]}", "where": _innermost_frame(output)}


# ------------------------------------------------------------------ the parent


@dataclass(frozen=True)
class Cell:
    contender: str
    size: str
    skip: Optional[str] = None  # why this cell cannot run here
    side_by_side: Tuple[str, ...] = ()  # the contenders its one process measures (Note [contenders side by side])

    @property
    def names(self) -> Tuple[str, ...]:
        return self.side_by_side or (self.contender,)


def rotated(cells: List[Cell], rounds: int) -> Iterable[tuple]:
    """(round, cell) in the order Note [contender rounds] runs them."""
    for r in range(rounds):
        shift = r % len(cells) if cells else 0
        for cell in cells[shift:] + cells[:shift]:
            yield r, cell


def gib(n) -> Optional[float]:
    return None if n is None else round(n / GiB, 3)


def _finite(x) -> Optional[float]:
    return float(f"{x:.6g}") if isinstance(x, (int, float)) and math.isfinite(x) else None


def result_record(bench: str, cell: Cell, samples: List[dict], failure: Optional[dict], skip: Optional[str],
                  dtype: str) -> dict:
    """The contender's one record from its rounds' samples (and its failure, if any)."""
    reasons = [s["skipped"] for s in samples if "skipped" in s]
    samples = [s for s in samples if "skipped" not in s]
    skip = skip if skip is not None or samples or not reasons else reasons[-1]
    times = [t for s in samples for t in s["times"]]
    first = samples[0] if samples else {}
    record = {"bench": bench, "kind": "result", "contender": cell.contender, "size": cell.size,
              "status": "ok", "step_s": None, "step_s_min": None, "step_s_max": None, "steps": len(times),
              "rounds": len(samples), "tflops": None, "gpu_peak_gib": None, "host_peak_gib": None,
              "first_loss": None, "last_loss": None, "params": first.get("params"),
              "tokens_per_step": first.get("tokens_per_step", 0), "device": first.get("device"),
              "dtype": first.get("dtype", dtype), "error": None, "extra": {}}
    if skip is not None:
        return dict(record, status="skipped", error=skip)
    if samples:
        gpu = [s["gpu_peak"] for s in samples if s.get("gpu_peak") is not None]
        host = [s["host_peak"] for s in samples if s.get("host_peak") is not None]
        losses = [s["losses"] for s in samples if s.get("losses")]
        record.update(gpu_peak_gib=gib(max(gpu)) if gpu else None, host_peak_gib=gib(max(host)) if host else None,
                      first_loss=_finite(losses[0][0]) if losses else None,
                      last_loss=_finite(losses[-1][-1]) if losses else None, extra=samples[-1].get("extra", {}))
    if times:
        step = statistics.median(times)
        work = 6 * record["params"] * record["tokens_per_step"] if record["params"] else 0
        record.update(step_s=round(step, 5), step_s_min=round(min(times), 5), step_s_max=round(max(times), 5),
                      tflops=_finite(work / step / 1e12) if work and step else None)
    if failure is not None:
        record.update(status=failure["status"], error=failure["error"])
        if failure.get("where"):
            record["extra"] = dict(record["extra"], where=failure["where"])
    return record


def cell_records(bench: str, cell: Cell, samples: List[dict], failure: Optional[dict], skip: Optional[str],
                 dtype: str) -> List[dict]:
    """One record per contender of the cell (Note [contenders side by side])."""
    if not cell.side_by_side:
        return [result_record(bench, cell, samples, failure, skip, dtype)]
    return [result_record(bench, Cell(name, cell.size), [s["contenders"][name] for s in samples
                                                          if name in s["contenders"]], failure, skip, dtype)
            for name in cell.side_by_side]


def _quotient(a, b) -> Optional[float]:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return round(a / b, 3) if ok and a and b else None


def ratio_record(bench: str, a: dict, b: dict, extra: Sequence[str] = ()) -> Optional[dict]:
    """``a`` over ``b`` (two ok records of one size): the step time, the peaks and the ``extra``
    figures named; None when neither the step times nor any of those figures give a quotient."""
    quotients = {k: _quotient(a["extra"].get(k), b["extra"].get(k)) for k in extra}
    quotients = {k: v for k, v in quotients.items() if v is not None}
    if (a.get("step_s") is None or b.get("step_s") is None) and not quotients:
        return None
    return {"bench": bench, "kind": "ratio", "size": a["size"], "contender": a["contender"], "vs": b["contender"],
            "step": _quotient(a.get("step_s"), b.get("step_s")),
            "gpu_peak": _quotient(a.get("gpu_peak_gib"), b.get("gpu_peak_gib")),
            "host_peak": _quotient(a.get("host_peak_gib"), b.get("host_peak_gib")), "extra": quotients}


def ratios(bench: str, records: List[dict], pairs: Sequence[Tuple[str, str]], extra: Sequence[str] = ()) -> List[dict]:
    """The ratio lines of ``pairs`` (contender, vs) at every size where both are ok, by size."""
    ok = {(r["contender"], r["size"]): r for r in records if r.get("kind") == "result" and r["status"] == "ok"}
    out = []
    for size in dict.fromkeys(size for _, size in ok):
        for a, b in pairs:
            if (a, size) in ok and (b, size) in ok:
                out.append(ratio_record(bench, ok[a, size], ok[b, size], extra))
    return [q for q in out if q is not None]


def emit(record: dict, out: Optional[str]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _text(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


COLUMNS = (("contender", "contender"), ("size", "size"), ("step s", "step_s"),
           ("min-max", lambda r: "-" if r["step_s"] is None else f"{r['step_s_min']:.4g}-{r['step_s_max']:.4g}"))


def table(records: List[dict], columns: Sequence[tuple] = COLUMNS, extra: Sequence[str] = ()) -> str:
    """The result records as a table: ``columns`` (title, a field's name or a function of the
    record), then the ``extra`` figures named, then the status."""
    cols = list(columns) + [(k, lambda r, k=k: r["extra"].get(k)) for k in extra]
    cols.append(("status", lambda r: r["status"] + (f": {r['error']}"[:90] if r["error"] else "")))
    rows = [[_text(get(r) if callable(get) else r.get(get)) for _, get in cols]
            for r in records if r.get("kind") == "result"]
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, (title, _) in enumerate(cols)]
    lines = ["  ".join(title.ljust(w) for (title, _), w in zip(cols, widths))]
    return "\n".join(lines + ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows])


def ratio_text(q: dict) -> str:
    figures = [f"{name} x{_text(q[key])}" for name, key in (("step", "step"), ("GPU peak", "gpu_peak"),
                                                            ("host peak", "host_peak")) if q[key] is not None]
    figures += [f"{k} x{_text(v)}" for k, v in q["extra"].items()]
    return f"{q['size']}: {q['contender']} / {q['vs']}: " + ", ".join(figures)


def finish(bench: str, records: List[dict], args, pairs: Sequence[Tuple[str, str]] = (), extra: Sequence[str] = (),
           columns: Sequence[tuple] = COLUMNS, ratio_extra: Sequence[str] = ()) -> int:
    """The closing table, then each ratio of ``pairs`` as a record (and to ``--out``) and as a
    line; the exit status: 1 when a contender failed or timed out."""
    print(table(records, columns, extra), flush=True)
    quotients = ratios(bench, records, pairs, ratio_extra)
    for q in quotients:
        emit(q, args.out)
    for q in quotients:
        print(ratio_text(q), flush=True)
    return 1 if any(r.get("status") in ("error", "timeout") for r in records) else 0


def run_cells(bench: str, module: str, cells: List[Cell], spec_of: Callable[[Cell, str], dict], args,
        env_of: Callable[[Cell], dict] = lambda cell: {}, dtype: str = "",
        prepare: Callable[[Cell, float], None] = lambda cell, deadline: None,
        python_of: Callable[[Cell], str] = lambda cell: sys.executable) -> List[dict]:
    """Run every cell for ``args.rounds`` rounds (Note [contender rounds]); returns the records,
    printed as they are done. ``spec_of(cell, scratch)`` is the child's spec: ``scratch`` a
    fresh directory under ``--nvme-path``, removed after the child. ``prepare(cell, deadline)``
    runs before each cell's time is counted (to wait for what the cell needs, by ``deadline``);
    ``python_of(cell)`` is the interpreter its child runs in."""
    deadline = time.time() + args.budget
    rounds = max(1, args.rounds)
    samples: Dict[Cell, List[dict]] = {cell: [] for cell in cells}
    failures: Dict[Cell, dict] = {}
    records: List[dict] = []
    done = set()
    for r, cell in rotated(cells, rounds):
        if cell in done:
            continue
        skip = cell.skip
        if skip is None:
            prepare(cell, deadline)
            left = min(args.timeout, deadline - time.time())
            if left < (1 if args.smoke else MIN_CELL_SECONDS):
                skip = f"no time left ({max(left, 0):.0f} s of --budget {args.budget:.0f} s)"
            else:
                sample = run_cell(bench, module, cell, (spec_of, env_of, python_of), args.nvme_path, r, left)
                if "error" in sample:
                    failures[cell] = sample
                else:
                    samples[cell].append(sample)
        if skip is not None or cell in failures or r == rounds - 1:
            done.add(cell)
            skip = None if samples[cell] else skip  # out of time after some rounds: what it has
            for record in cell_records(bench, cell, samples[cell], failures.get(cell), skip, dtype):
                records.append(record)
                emit(record, args.out)
    return records


def run_cell(bench: str, module: str, cell: Cell, how: tuple, nvme_path: str, r: int, left: float) -> dict:
    spec_of, env_of, python_of = how
    print(f"[{bench}] round {r}: {cell.contender} at {cell.size} (limit {left:.0f} s)", file=sys.stderr, flush=True)
    os.makedirs(nvme_path, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"{bench}_{cell.contender}_", dir=nvme_path)
    try:
        return spawn(module, spec_of(cell, scratch), left, env_of(cell), python_of(cell))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
