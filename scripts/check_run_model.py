"""Know before you run, checked: the run model's predictions (Note [run model] in infinity/_apps/_runmodel.py)
against measured runs, in one run of this script.

For each model (tiny 2 x 256, GPT-2 124M, and with --big a 1B GPT) and each placement (cpu: parameters
and optimizer in host memory; nvme: both on NVMe), stage 3, fp32, one rank on the CPU, a child process
trains --steps steps after a warm-up and reports its peak RSS (VmHWM), its median step time and the
NVMe bytes its stores moved per step; the parent measures this machine's rates (FLOP/s at the
model's MLP shape, native Adam elements/s, O_DIRECT bandwidth under --nvme-path) beside them and
prints predicted vs measured with the ratio. The targets: peak RSS within 20%, step time within 25%.
Timings are only meaningful on an idle machine; the load average is printed.

    python scripts/check_run_model.py [--models tiny,124m] [--big] [--steps 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from benchmarks import _harness, _models  # noqa: E402 - after the path insert

GiB = 2**30
VOCAB = _models.VOCAB
MODELS = {"tiny": (2, 256, 4, 128), "124m": (12, 768, 4, 256), "1b": (18, 2048, 1, 256)}  # layers, hidden, batch, seq


def measure(spec: dict) -> dict:
    import torch

    import infinity
    from benchmarks._trainers import infinity_config
    from infinity.testing import Run, adam_rate, compute_rate, peak_rss

    torch.set_num_threads(2)
    torch.manual_seed(0)
    tier = spec["tier"]
    cfg = infinity_config(tier, "fp32", spec["nvme"], clip=None, optimizer={"lr": 1e-4})
    with infinity.Init(config=cfg):
        model = _models.build(_models.Shape.of(spec["layers"], spec["hidden"]))
    model, opt = infinity.initialize(model, cfg)
    gen = torch.Generator().manual_seed(1)
    shape = Run(params=sum(p.numel() for p in model.parameters()), layers=spec["layers"], hidden=spec["hidden"],
                heads=spec["hidden"] // 64, vocab=VOCAB, micro_batch=spec["batch"], seq_len=spec["seq"])
    flops, adam = [], []

    def rates():  # under the load of the steps: just before and just after them, in this process
        flops.append(compute_rate(shape))
        adam.append(adam_rate())

    n = spec["warmup"] + spec["steps"]
    starts, moved = [], []
    for i in range(n + 1):
        if i == spec["warmup"]:
            opt.wait_step()
            rates()
        if i == n:
            opt.wait_step()  # the last step's overlapped update ends here
        tel = infinity.telemetry(model, reset=True)  # the NVMe bytes since the previous boundary
        starts.append(time.perf_counter())
        moved.append({d: sum(v for k, v in tel.items() if k.startswith("nvme_") and k.endswith(f"_{d}_bytes"))
                      for d in ("read", "write")})
        if i == n:
            break
        ids = torch.randint(VOCAB, (spec["batch"], spec["seq"]), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    rates()
    # Step i is start(i) .. start(i + 1): its forward and backward, the wait for the previous step's
    # overlapped update (which ran beside them) and the start of its own.
    timed = range(spec["warmup"], n)
    out = {"params": shape.params, "step": statistics.median(starts[i + 1] - starts[i] for i in timed),
           "read": statistics.median(moved[i + 1]["read"] for i in timed),
           "write": statistics.median(moved[i + 1]["write"] for i in timed),
           "peak_rss": peak_rss(), "flops": statistics.median(flops), "adam": statistics.median(adam)}
    infinity.close(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,124m")
    ap.add_argument("--big", action="store_true", help="also the 1B model")
    ap.add_argument("--tiers", default="cpu,nvme")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # prints the result as JSON where the spec names no result_path (tests/integration/test_memory_model.py)
        _harness.child_main(measure, args.child)
    from infinity.testing import Rates, Run, host_memory, step_time

    models = args.models.split(",") + (["1b"] if args.big else [])
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for name in models:
        layers, hidden, batch, seq = MODELS[name]
        shape = Run(params=0, layers=layers, hidden=hidden, heads=hidden // 64, vocab=VOCAB, micro_batch=batch,
                       seq_len=seq)
        here = Rates.measure(args.nvme_path, shape)  # the disk and its overlap with computation
        for tier in args.tiers.split(","):
            nvme = tempfile.mkdtemp(prefix="runmodel_", dir=args.nvme_path)
            spec = dict(layers=layers, hidden=hidden, batch=batch, seq=seq, tier=tier, nvme=nvme,
                        steps=args.steps, warmup=args.warmup)
            try:
                got = _harness.spawn(os.path.abspath(__file__), spec, 7200)
            finally:
                subprocess.run(["rm", "-rf", nvme])
            if "error" in got:
                print(f"{name} {tier}: {got['status']}: {got['error']} {got['where']}")
                continue
            rates = dataclasses.replace(here, flops=got["flops"], adam=got["adam"])  # the child's, beside its steps
            run = Run(params=got["params"], layers=layers, hidden=hidden, heads=hidden // 64, vocab=VOCAB,
                         micro_batch=batch, seq_len=seq, param_tier=tier, optimizer_tier=tier)
            mem = sum(host_memory(run).values())
            st = step_time(run, rates)
            rows.append((name, tier, st["predicted"], got["step"], st["bottleneck"], mem, got["peak_rss"],
                         st["nvme_bytes"], got))
            print(f"{name:5s} {tier:4s} step predicted {st['predicted']:7.2f} s measured {got['step']:7.2f} s "
                  f"({got['step'] / st['predicted']:.2f}x, bottleneck {st['bottleneck']}) | peak RSS predicted "
                  f"{mem / GiB:5.2f} GiB measured {got['peak_rss'] / GiB:5.2f} GiB ({got['peak_rss'] / mem:.2f}x) | "
                  f"NVMe read {st['nvme_bytes']['read'] / GiB:.2f}/{got['read'] / GiB:.2f} GiB, write "
                  f"{st['nvme_bytes']['write'] / GiB:.2f}/{got['write'] / GiB:.2f} GiB (predicted/measured) | "
                  f"rates {rates.flops / 1e9:.0f} GFLOP/s, Adam {rates.adam / 1e6:.0f} M/s, "
                  f"disk r/w {rates.nvme_read / 1e9:.2f}/{rates.nvme_write / 1e9:.2f} GB/s, overlap {rates.overlap:.2f} | "
                  + ", ".join(f"{k} {st.get(k, 0):.2f} s" for k in ("compute", "adam", "nvme_read", "nvme_write", "hidden_io")),
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    bad = [r for r in rows if not (0.8 <= r[6] / r[5] <= 1.2 and 0.75 <= r[3] / r[2] <= 1.25)]
    print(f"{len(rows) - len(bad)} of {len(rows)} within the targets (RSS 20%, step time 25%)")


if __name__ == "__main__":
    main()
