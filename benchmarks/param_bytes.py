"""NVMe bytes per step of the parameter tier, this checkout against another, in one run.

The other checkout is, say, the commit before Note [parameters from the master] in _placement.py
and Note [parameter cache] in _nvme_param_store.py. GPT-2 (GPT2Config's 768 wide, ``--layers`` deep:
124M at 12) in fp32, one rank, parameters on NVMe with the optimizer states on NVMe (size
``optim-nvme``) or in host memory (``optim-cpu``), 1 x 16 tokens; contenders ``this`` and, with
``--baseline DIR``, ``baseline`` (infinity imported from DIR), each in a process of its own,
rounds rotated. After the warm-up steps, the NVMe bytes of every timed step are read from the
engine's telemetry by store (parameters, optimizer): ``extra`` holds their medians in MiB and
the swap files the run made. Byte counts are exact; the step times are beside them. Ratios: this
/ baseline, bytes included.

    python -m benchmarks.param_bytes --baseline DIR_OF_OTHER_CHECKOUT [--steps 2] [--layers 12]
"""
from __future__ import annotations

import os
import statistics
import sys

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "param_bytes"
COUNTERS = ("nvme_params_read_bytes", "nvme_params_write_bytes", "nvme_optimizer_read_bytes",
            "nvme_optimizer_write_bytes")
MIB = tuple(k.replace("_bytes", "_mib") for k in COUNTERS)


def measure(spec: dict) -> dict:
    _harness.use_tree(spec.get("tree"))
    import torch

    import infinity

    from ._trainers import infinity_config

    torch.manual_seed(0)
    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    model = _models.build(shape)
    cfg = infinity_config("nvme", "fp32", spec["scratch"], optimizer_tier=spec["optim"], clip=None,
                          optimizer={"lr": 1e-4})  # an older checkout reads it too
    model, opt = infinity.initialize(model, cfg)
    ids = _models.batches(shape, 1, 16, 1)[0]
    times, rows = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        seconds = _harness.timed(lambda: (model(input_ids=ids, labels=ids).loss.backward(), opt.step(),
                                          opt.zero_grad(), opt.wait_step()))
        t = opt.engine.telemetry()
        if step >= spec["warmup"]:
            times.append(seconds)
            rows.append({k: t.get(k, 0) for k in COUNTERS})
    swap = sorted(f for d in opt.engine.swap_dirs.values() for f in os.listdir(d.path) if f.endswith(".swp"))
    params = sum(p.numel() for p in model.parameters())
    opt.engine.close()
    extra = {m: round(statistics.median(r[k] for r in rows) / 2**20, 1) for k, m in zip(COUNTERS, MIB)}
    return _harness.sample(times, params=params, tokens_per_step=16, dtype="fp32", extra=dict(extra, swap_files=swap))


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=2, warmup=1, timeout=3600.0)
    p.add_argument("--baseline", help="another checkout of infinity (its native libraries built)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.steps = 1, 64, 1
    names = ["this"] + (["baseline"] if args.baseline else [])
    cells = [Cell(name, f"optim-{optim}") for optim in ("cpu", "nvme") for name in names]
    records = _harness.run_cells(BENCH, "benchmarks.param_bytes", cells, lambda cell, scratch: {
        "optim": cell.size.split("-")[1], "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
        "warmup": args.warmup, "scratch": scratch, "tree": args.baseline if cell.contender == "baseline" else None},
        args, dtype="fp32")
    return _harness.finish(BENCH, records, args, (("this", "baseline"),), extra=MIB, ratio_extra=MIB)


if __name__ == "__main__":
    sys.exit(main())
