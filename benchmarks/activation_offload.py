"""Activation checkpoint offload (paper 002 Fig. 6e): the checkpoints' device bytes and the step
time, offload off against on.

Off and on side by side in one process, fp32 (Note [contenders side by side] in _harness.py). A
stack of ``--layers`` GPT-style blocks (``_blocks.CheckpointedStack``), each checkpointed with
torch.utils.checkpoint (non-reentrant), trained with ZeRO stage 3 with
``activation_checkpointing.offload`` none (contender ``offload-none``) and cpu
(``offload-cpu``), one cell per hidden size. ``extra.checkpoint_device_mib``: the device bytes of
activation checkpoints at their peak (off: every tensor autograd keeps across the
forward->backward gap, alive from the end of forward until backward reaches it, counted with a
saved-tensor hook; on: those the offloader holds on the device, the one in use plus its prefetch
window, from its counters); the step times are medians of ``--steps`` steps taken in turns.

Without a GPU the device tier is host memory, so the offloaded copies also live in RAM and the
"device" figures are the bytes held in the device role; on CUDA those are device memory.

    python -m benchmarks.activation_offload [--hidden 256,512,1024] [--layers 8] [--steps 5]
                                            [--micro-batch 4 --seq-len 128] [--threads 1]
"""
from __future__ import annotations

import os
import sys

from . import _flags, _harness
from ._harness import Cell

BENCH = "activation_offload"
CONTENDERS = ("offload-none", "offload-cpu")


class SavedBytes:
    """Bytes autograd keeps across the forward->backward gap outside the checkpointed regions
    (the same tensors the offloader would take), each storage counted once."""

    def __init__(self):
        self.seen, self.nbytes = set(), 0

    def pack(self, t):
        from infinity.testing import is_parameter_like

        if not is_parameter_like(t):
            key = t.untyped_storage().data_ptr()
            if key not in self.seen:
                self.seen.add(key)
                self.nbytes += t.untyped_storage().nbytes()
        return t


def offload_engine(h: int, layers: int, offload: str):
    import torch

    import infinity

    from ._blocks import CheckpointedStack
    from ._trainers import infinity_config

    torch.manual_seed(0)
    cfg = infinity_config("none", "fp32", clip=0.0, activation_checkpointing={"offload": offload})
    return infinity.initialize(CheckpointedStack(h, layers), cfg)


def offload_step(model, opt, x, counter=None) -> float:
    import time

    import torch

    t0 = time.perf_counter()
    if counter is not None:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = model(x)
    else:
        loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def measure(spec: dict) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: spinning OpenMP threads distort a shared machine's timings
    import torch

    import infinity

    torch.set_num_threads(spec["threads"])
    infinity.logger.setLevel("WARNING")
    h = spec["hidden"]
    x = torch.randn(spec["micro_batch"], spec["seq_len"], h, generator=torch.Generator().manual_seed(1))
    built = {"offload-none": offload_engine(h, spec["layers"], "none"), "offload-cpu": offload_engine(h, spec["layers"], "cpu")}
    counter = SavedBytes()
    offload_step(*built["offload-none"], x, counter)  # warm-up of both; the counter sees one forward
    offload_step(*built["offload-cpu"], x)
    offloader = built["offload-cpu"][1].engine.activation_offload
    offloader.reset_peak()
    times = {name: [] for name in built}
    for _ in range(spec["steps"]):
        for name, (model, opt) in built.items():
            times[name].append(offload_step(model, opt, x))
    device = {"offload-none": counter.nbytes, "offload-cpu": offloader.stats()["peak_device_bytes"]}
    for model, _ in built.values():
        infinity.close(model)
    return _harness.side_by_side({name: _harness.sample(ts, dtype="fp32", extra={
        "checkpoint_device_mib": round(device[name] / 2**20, 3), "layers": spec["layers"]}) for name, ts in times.items()})


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=5, warmup=1, seq_len=128, micro_batch=4, timeout=1800.0)
    p.add_argument("--hidden", default="256,512,1024", help="hidden sizes, comma-separated")
    p.add_argument("--layers", type=int, default=8, help="checkpointed blocks")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared machine: 1)")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.hidden, args.layers, args.steps, args.micro_batch, args.seq_len = "64", 2, 2, 2, 16
    hidden = [int(h) for h in _flags.parse_list(args.hidden)]
    cells = [Cell("activations", f"h{h}-l{args.layers}", side_by_side=CONTENDERS) for h in hidden]
    records = _harness.run_cells(BENCH, "benchmarks.activation_offload", cells, lambda cell, scratch: {
        "hidden": int(cell.size[1:].split("-")[0]), "layers": args.layers, "steps": args.steps,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len, "threads": args.threads}, args, dtype="fp32")
    return _harness.finish(BENCH, records, args, (("offload-cpu", "offload-none"),), extra=("checkpoint_device_mib",),
                           ratio_extra=("checkpoint_device_mib",))


if __name__ == "__main__":
    sys.exit(main())
