"""The threads of a rank while the interpreter finalizes, from a core dump taken there (Note
[process group at exit] in infinity/_runtime/_comm.py: the abort at exit was a gloo worker
thread releasing a collective's tensors during ``Py_FinalizeEx``).

    python scripts/threads_at_exit.py [--stage 3] [--who infinity|user] [--keep-core DIR]

Runs tests/_exit_rank.py on two gloo ranks (GPT-2, 3 steps, then ``destroy_process_group``),
rank 0 under gdb with a breakpoint on ``Py_FinalizeEx``. At the breakpoint gdb writes a core
dump of the rank (``gcore``) and lists its threads; the script then reads the thread names back
from the core and prints them, and exits 1 if any is a gloo thread. Needs gdb.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = os.path.join(ROOT, "tests", "_exit_rank.py")
sys.path.insert(0, ROOT)
from infinity.testing import free_port  # noqa: E402

THREAD = re.compile(r'^\*?\s+\d+\s+(?:Thread 0x[0-9a-f]+ \()?LWP (\d+)\)?\s*(?:"([^"]*)")?', flags=re.M)


def threads_listed(gdb_output: str) -> list:
    """(LWP, name) of each thread in gdb's ``info threads`` (a name only where gdb shows one)."""
    return [(int(lwp), name or "") for lwp, name in THREAD.findall(gdb_output)]


def threads_in_core(core: str) -> list:
    """(LWP, name) of each thread a core file holds."""
    out = subprocess.run(["gdb", "-q", "-batch", "-ex", "info threads", os.path.realpath(sys.executable), core],
                         capture_output=True, text=True, timeout=300).stdout
    return threads_listed(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--who", choices=("infinity", "user"), default="infinity")
    ap.add_argument("--keep-core", help="a directory to keep the core dump in (default: removed after reading)")
    args = ap.parse_args()
    if shutil.which("gdb") is None:
        print("gdb is not installed (apt-get install gdb)")
        return 2
    work = tempfile.mkdtemp(prefix="threads_at_exit_")
    core = os.path.join(args.keep_core or work, f"rank0_stage{args.stage}_{args.who}.core")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = [RANK, str(args.stage), args.who]
    gdb = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "set breakpoint pending on",
           "-ex", "handle SIGPIPE SIGUSR1 SIGUSR2 nostop noprint", "-ex", "break Py_FinalizeEx", "-ex", "run",
           "-ex", "echo THREADS\\n", "-ex", "info threads", "-ex", "echo END\\n", "-ex", f"gcore {core}",
           "-ex", "continue", "--args", os.path.realpath(sys.executable)] + job
    try:
        ranks = [subprocess.Popen(gdb, env=dict(env, RANK="0", LOCAL_RANK="0"), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True),
                 subprocess.Popen([sys.executable] + job, env=dict(env, RANK="1", LOCAL_RANK="1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        outputs = [p.communicate(timeout=900)[0] for p in ranks]
        codes = [p.returncode for p in ranks]
        if not os.path.exists(core):
            print(f"no core was written at Py_FinalizeEx (exit codes {codes}); rank 0's output:\n{outputs[0][-3000:]}")
            return 1
        live = outputs[0].split("THREADS\n", 1)[-1].split("END\n", 1)[0]
        listed, in_core = threads_listed(live), threads_in_core(core)
        names = [name or f"LWP {lwp}" for lwp, name in listed]
        gloo = [n for n in names if "gloo" in n]
        print(f"stage {args.stage}, group made by {args.who}: exit codes {codes}")
        print(f"rank 0 at Py_FinalizeEx: {len(listed)} threads ({', '.join(names)}); the core dump holds {len(in_core)}")
        print(f"gloo threads alive in finalization: {len(gloo)}" + (f" ({', '.join(gloo)})" if gloo else ""))
        if args.keep_core:
            print(f"core dump: {core}")
        return 1 if gloo or any(codes) or not listed else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
