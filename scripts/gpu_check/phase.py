"""Runs one phase of scripts/gpu_check.sh and keeps its records; prints the summary at the end.

    phase.py run OUT NAME TIMEOUT [--needs FILE] [--skip REASON] [-- COMMAND...]
    phase.py summary OUT

``run`` starts COMMAND in a process group of its own, appends everything it prints to
OUT/log.txt under a header, and every line of its output that is a JSON object to
OUT/results.jsonl with ``"phase": NAME`` added; then one status line for the phase
(``{"phase", "status": ok|failed|timeout|missing|skipped, "rc", "seconds"}``). The time it
gets is TIMEOUT, cut to what is left of the whole check (``GPU_CHECK_DEADLINE``, epoch
seconds); at the limit the group gets SIGTERM, then SIGKILL 5 s later. It exits 0 whatever
the command did, so one phase's failure never stops the next.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from benchmarks._harness import stop_group  # noqa: E402 - one way to stop a process group: the benchmarks'

MIN_SECONDS = 10  # a phase that would get less than this is skipped


def append(out: str, record: dict) -> None:
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def log(out: str, text: str) -> None:
    with open(os.path.join(out, "log.txt"), "a") as f:
        f.write(text)


def as_record(line: str):
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def run(args) -> None:
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + args.timeout))
    limit = min(args.timeout, deadline - time.time())
    status = {"phase": args.name, "status": "skipped", "rc": None, "seconds": 0.0}
    if args.needs and not os.path.exists(args.needs):
        status.update(status="missing", reason=f"{args.needs} does not exist")
    elif args.skip:
        status["reason"] = args.skip
    elif limit < MIN_SECONDS:
        status["reason"] = f"the overall budget is spent ({limit:.0f} s left)"
    else:
        try:
            status.update(execute(args, limit))
        except OSError as e:  # the command could not start
            status.update(status="failed", reason=f"{type(e).__name__}: {e}")
    append(args.out, status)
    extra = f" ({status['reason']})" if "reason" in status else ""
    print(f"[gpu_check] {args.name}: {status['status']} in {status['seconds']:.1f} s{extra}", flush=True)


def execute(args, limit: float) -> dict:
    cmd = args.command
    log(args.out, f"\n===== {args.name}: {' '.join(cmd)} (limit {limit:.0f} s)\n")
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", start_new_session=True)
    fired = threading.Event()
    timer = threading.Timer(limit, lambda: (fired.set(), stop_group(proc)))
    timer.start()
    records, last = 0, ""
    with open(os.path.join(args.out, "log.txt"), "a") as logf:
        for line in proc.stdout:
            logf.write(line)
            logf.flush()
            last = line.strip() or last
            record = as_record(line.strip())
            if record is not None:
                append(args.out, {"phase": args.name, **record})
                records += 1
    rc = proc.wait()
    timer.cancel()
    timed_out = fired.is_set()
    seconds = round(time.time() - start, 1)
    log(args.out, f"===== {args.name}: exit {rc} after {seconds} s{' (timed out)' if timed_out else ''}\n")
    status = "timeout" if timed_out else "ok" if rc == 0 else "failed"
    out = {"status": status, "rc": rc, "seconds": seconds, "records": records}
    if status != "ok" and not as_record(last):
        out["reason"] = last[-200:]  # a traceback's last line, usually
    return out


# ------------------------------------------------------------------ summary


QUIET = {"phase", "path", "steps_s", "min_gbps", "max_gbps", "block_size", "queue_depth", "reps", "setup_s",
         "tokens_per_step", "device", "peak_rss_gib", "loss_first", "disk_free_gib", "kernel", "precision",
         "tflops_is", "bench", "kind", "steps", "rounds", "params", "dtype", "extra", "stall_s", "gb_per_step",
         "step_call_parts_s", "run_model_terms_s", "rates", "torch_threads", "cpus", "loss_last",
         "profiled_step_s", "gpu_copy_s"}  # in results.jsonl only


def short(value, limit: int = 60) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def digest(records: list) -> list:
    """Lines for one phase: test counts and failures, or each record's fields in brief."""
    tests = [r for r in records if "test" in r]
    lines = []
    if tests:
        counts: dict = {}
        for r in tests:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        bad = [r for r in tests if r["outcome"] in ("failed", "error")]
        for r in bad[:12]:
            lines.append(f"{r['outcome'].upper()} {r['test'].split('::', 1)[-1]}  {r.get('where', '')}  "
                         f"{short(r.get('error', ''), 120)}")
        if len(bad) > 12:
            lines.append(f"... and {len(bad) - 12} more (results.jsonl)")
    for r in records:
        if "test" not in r:
            fields = [f"{k}={short(v)}" for k, v in r.items() if k not in QUIET and v is not None]
            lines.append("  ".join(fields)[:240])
    return lines


def summary(args) -> None:
    by_phase: dict = {}
    order = []
    with open(os.path.join(args.out, "results.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["phase"] not in by_phase:
                by_phase[r["phase"]] = {"records": [], "status": None}
                order.append(r["phase"])
            if "status" in r and "seconds" in r:
                by_phase[r["phase"]]["status"] = r
            else:
                by_phase[r["phase"]]["records"].append(r)
    total = sum((by_phase[name]["status"] or {}).get("seconds", 0) for name in order)
    print(f"\n==== gpu_check summary: {total:.0f} s in the phases; records in {args.out}/results.jsonl")
    for name in order:
        st = by_phase[name]["status"] or {"status": "?", "seconds": 0}
        reason = f"  ({st['reason']})" if st.get("reason") else ""
        print(f"{name:<10} {st['status']:<8} {st['seconds']:>6.1f} s{reason}")
        for line in digest(by_phase[name]["records"]):
            print(f"    {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("name")
    r.add_argument("timeout", type=float)
    r.add_argument("--needs", help="a file the phase needs; without it the phase is recorded as missing")
    r.add_argument("--skip", help="record the phase as skipped for this reason")
    s = sub.add_parser("summary")
    s.add_argument("out")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.command = argv[cut + 1:]
    run(args) if args.what == "run" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
