"""One rank of a two-rank job that trains a tiny GPT-2 and ends (tests/integration/test_exit.py,
scripts/stress_ranks.py). Started like torchrun starts a rank (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment). argv: the ZeRO stage, and who makes the process group:
``infinity`` (initialize does, from the environment) or ``user`` (the script does, then
imports ``torch.distributed.nn`` as transformers does while it builds a model). Prints one
JSON line: the gloo worker threads left after ``destroy_process_group`` (none may be)."""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import zero_config  # noqa: E402
from _models import batches, gpt2  # noqa: E402

import infinity  # noqa: E402


def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while we listed them
            pass
    return sorted(n for n in names if "gloo" in n)


def main():
    stage, who = int(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if who == "user":
        dist.init_process_group("gloo")
        import torch.distributed.nn as _dist_nn  # noqa: F401 - after the group, as transformers imports it
    model, opt = infinity.initialize(gpt2(seed=0), config=zero_config(stage, lr=1e-3))
    for ids in batches(3):
        part = ids.chunk(2)[rank]
        model(input_ids=part, labels=part).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.engine.close()
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    print(json.dumps({"rank": rank, "gloo_threads_after_destroy": gloo_threads()}), flush=True)


if __name__ == "__main__":
    main()
