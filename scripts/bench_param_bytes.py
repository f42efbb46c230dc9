"""NVMe bytes per step of the parameter tier, this checkout against another (e.g. the commit
before Note [parameters from the master] in _placement.py and Note [parameter cache] in
_param_store.py), in one run.

GPT-2 (GPT2Config defaults: 124M) in fp32, one rank, parameters on NVMe with the optimizer
states on NVMe or in host memory, micro-batch 1 x 16 tokens; each contender runs in its own
process with its own checkout on PYTHONPATH, alternating; after one warm-up step, the NVMe
bytes of every later step are read from the engine's telemetry (by store: parameters,
optimizer) and the medians printed with the ratio. Byte counts are exact, not timings.

    python scripts/bench_param_bytes.py --baseline DIR_OF_OTHER_CHECKOUT [--steps 3] [--layers 12]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, sys, torch
import infinity
from transformers import GPT2Config, GPT2LMHeadModel
optim, steps, layers, nvme = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                "offload_optimizer": {"device": optim, "nvme_path": nvme}},
       "precision": {"dtype": "fp32"}, "optimizer": {"lr": 1e-4}}
model, opt = infinity.initialize(model, cfg)
ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(1))
rows = []
for step in range(steps + 1):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad(); opt.wait_step()
    t = opt.engine.telemetry()
    rows.append({k: t.get(k, 0) for k in ("nvme_params_read_bytes", "nvme_params_write_bytes",
                                          "nvme_optimizer_read_bytes", "nvme_optimizer_write_bytes")})
swap = sorted(f for d in opt.engine.swap_dirs.values() for f in __import__("os").listdir(d.path) if f.endswith(".swp"))
opt.engine.close()
print(json.dumps({"steps": rows[1:], "swap_files": swap, "params": sum(p.numel() for p in model.parameters())}))
"""


def run(code_dir: str, optim: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=code_dir)  # and cwd: "python -c" puts the working directory first
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        argv = [sys.executable, "-c", CHILD, optim, str(args.steps), str(args.layers), nvme]
        out = subprocess.run(argv, env=env, cwd=code_dir, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="another checkout of infinity (its native libraries built)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    args = ap.parse_args()
    MiB = 2**20
    for optim in ("cpu", "nvme"):
        res = {name: run(d, optim, args) for name, d in (("baseline", args.baseline), ("this", HERE))}
        print(f"\nparameters on nvme, optimizer on {optim}, GPT-2 {res['this']['params'] / 1e6:.1f}M fp32, MiB per step:")
        for key in ("nvme_params_read_bytes", "nvme_params_write_bytes", "nvme_optimizer_read_bytes",
                    "nvme_optimizer_write_bytes"):
            a, b = (statistics.median(s[key] for s in res[n]["steps"]) / MiB for n in ("baseline", "this"))
            print(f"  {key:28s} baseline {a:9.1f}   this {b:9.1f}   saved {a - b:9.1f}")
        for n in ("baseline", "this"):
            print(f"  swap files ({n}): {', '.join(res[n]['swap_files']) or 'none'}")


if __name__ == "__main__":
    main()
