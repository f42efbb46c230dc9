"""Many two-rank jobs under CPU load, counting the ranks that end abnormally (Note [process
group at exit] in infinity/_runtime/_comm.py; issue: a rank aborting with SIGABRT after its
training was done).

    python scripts/stress_ranks.py --runs 200 --load 1

Each run is tests/_exit_rank.py on two gloo ranks (GPT-2, 3 steps), alternating ZeRO stage 2
and 3 and who makes the process group (infinity from the environment, or the script before
it imports torch.distributed.nn, as transformers does). ``--load N`` keeps N busy processes
beside the jobs. Prints each abnormal exit (its code, the signal for a negative one, the last
lines of stderr) and the totals; exits 1 if any rank failed or left gloo threads alive.
"""
import argparse
import multiprocessing as mp
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "integration"))
from test_exit import run_job  # noqa: E402


def _burn(stop):
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1000003


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--load", type=int, default=1, help="busy processes beside the jobs")
    args = ap.parse_args()
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    bad, threads_left, start = 0, 0, time.monotonic()
    try:
        for i in range(args.runs):
            stage, who = (2, 3)[i % 2], ("infinity", "user")[(i // 2) % 2]
            for rank, (code, report, err) in enumerate(run_job(stage, who, timeout=300)):
                if code != 0:
                    bad += 1
                    sig = f" ({signal.Signals(-code).name})" if code < 0 else ""
                    print(f"run {i} stage {stage} {who}: rank {rank} exited {code}{sig}\n{err[-1500:]}", flush=True)
                elif report and report["gloo_threads_after_destroy"]:
                    threads_left += 1
                    print(f"run {i} stage {stage} {who}: rank {rank} left {report['gloo_threads_after_destroy']}")
            if (i + 1) % 20 == 0:
                print(f"{i + 1} runs, {bad} abnormal rank exits, {threads_left} ranks with gloo threads left, "
                      f"{time.monotonic() - start:.0f} s", flush=True)
    finally:
        stop.set()
        for b in burners:
            b.join(5)
    print(f"done: {args.runs} two-rank runs under {args.load} busy process(es): {bad} abnormal rank exits, "
          f"{threads_left} ranks with gloo threads alive after destroy_process_group")
    return 1 if bad or threads_left else 0


if __name__ == "__main__":
    sys.exit(main())
