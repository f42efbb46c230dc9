"""Engines in a loop: initialize a GPT-2 (4 x 512, fp32, everything on NVMe), train one step,
let go of the model and the optimizer without ``close``, and print after each iteration the
resident set above the start and the files left under ``nvme_path``. With this tree both stay
flat (Note [parameter side objects] in infinity/_zero/_param.py, Note [hooks the collector cannot
see] in infinity/_zero/_engine.py); ``--tree`` runs another checkout (e.g. an earlier commit with its
native libraries copied in) in the same way.

    python scripts/check_engine_loop.py [--iterations 8] [--tree DIR]
"""
import argparse
import gc
import os
import shutil
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--tree", help="a checkout to import infinity from instead of the installed one")
    ap.add_argument("--nvme-path", default=None)
    args = ap.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel  # imported before the start is measured

    import infinity
    from infinity.testing import rss_now

    torch.set_num_threads(2)
    torch.manual_seed(0)
    nvme = tempfile.mkdtemp(prefix="engine-loop-", dir=args.nvme_path)
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}, "precision": {"dtype": "fp32"}}
    base = rss_now()
    try:
        for i in range(args.iterations):
            model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_layer=4, n_embd=512, n_head=8, use_cache=False))
            model, opt = infinity.initialize(model, cfg)
            ids = torch.randint(8192, (2, 64))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            opt.wait_step()
            del model, opt  # no close: letting go must free the engine
            gc.collect()
            files = sum(len(f) for _, _, f in os.walk(nvme))
            print(f"iteration {i}: resident set {(rss_now() - base) / 2**20:.0f} MiB above the start, "
                  f"{files} file(s) under nvme_path", flush=True)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)


if __name__ == "__main__":
    main()
