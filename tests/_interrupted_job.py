"""A one-rank training script that tests/integration/test_interrupts.py interrupts with a real
SIGINT (Note [interrupted step] in infinity/_zero/_step_gate.py).

argv: ``MODE PHASE NVME CHECKPOINTS ENDING``.
- MODE ``interrupted``: train a tiny GPT-2 at stage 3 with every state on NVMe, streamed chunk by
  chunk, the update overlapped with the next forward; save a checkpoint after step 2; in step 3,
  with every read of the swap file PHASE reads stalled (so requests are in flight when the
  signal lands), print ``READY PHASE`` and wait there for the signal: ``forward`` (in a block's
  forward), ``backward`` (in a block's backward), ``step`` (the update running on its thread,
  the main thread in the next forward waiting for it), ``update`` (in ``optimizer.step()`` on the
  main thread, the overlap off). ENDING ``close``: the loop is inside ``try: ... finally:
  infinity.close(model)`` (twice: the second finds nothing to do); ``plain``: nothing closes the
  engine.
- MODE ``resume``: load the latest checkpoint and train steps 3 and 4.
- MODE ``whole``: train steps 1 to 4 without interruption.
At exit (after every thread is joined) it prints one JSON line: the losses, and how many reads
of ``exp_avg.swp`` step 3's update made (the ``interrupted`` run's: it stopped early; the
``whole`` run's: all of them).
"""
import atexit
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import streamed_nvme_config  # noqa: E402
from _models import batches, gpt2  # noqa: E402

import infinity  # noqa: E402
from infinity.testing import inject_io_fault  # noqa: E402

STEPS, SAVED, AT = 4, 2, 3
WAIT_S = 120  # the test sends the signal long before; a run that outlives this reports it
report = {"losses": {}, "update_reads": None, "waited_out": False}
rules = {}


def _report():
    if "update" in rules:
        report["update_reads"] = rules["update"].hits
    print(json.dumps(report), flush=True)


atexit.register(_report)  # registered before infinity's: runs after them, after the threads were joined


def _ready(phase: str) -> None:
    print(f"READY {phase}", flush=True)
    start = time.monotonic()
    while time.monotonic() - start < WAIT_S:
        time.sleep(0.02)
    report["waited_out"] = True


class _Backward(torch.autograd.Function):
    """Identity whose backward waits for the signal in step 3."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Backward.armed:
            _Backward.armed = False
            _ready("backward")
        return grad


def _swap_file(opt, name: str) -> str:
    (swap,) = opt.engine.swap_dirs.values()
    return os.path.join(swap.path, name)


def main():
    mode, phase, nvme, checkpoints, ending = sys.argv[1:6]
    torch.set_num_threads(1)
    cfg = streamed_nvme_config(nvme)
    cfg["zero"]["offload_optimizer"]["overlap_step"] = "off" if phase == "update" else "on"
    model, opt = infinity.initialize(gpt2(seed=0, layers=3), config=cfg)
    block = model.transformer.h[1]
    state = {"step": 0}

    def forward_waits(module, args):
        if mode == "interrupted" and phase == "forward" and state["step"] == AT:
            _ready("forward")

    block.register_forward_pre_hook(forward_waits)
    block.register_forward_hook(lambda m, a, out: _Backward.apply(out) if torch.is_tensor(out)
                                else (_Backward.apply(out[0]),) + tuple(out[1:]))
    first = 1
    if mode == "resume":
        first = infinity.load_checkpoint(checkpoints, model, opt)["step"] + 1
    try:
        for step, ids in enumerate(batches(STEPS), start=1):
            if step < first:
                continue
            state["step"] = step
            if step == AT and mode != "resume":
                stalled = "master.swp" if phase in ("forward", "backward") else "exp_avg.swp"
                rules["update"] = inject_io_fault(_swap_file(opt, "exp_avg.swp"), "read", "stall", count=0,
                                                  arg=400 if mode == "interrupted" else 0)
                if stalled == "master.swp" and mode == "interrupted":  # the fetches' reads in flight
                    inject_io_fault(_swap_file(opt, stalled), "read", "stall", count=0, arg=400)
                _Backward.armed = mode == "interrupted" and phase == "backward"
            loss = model(input_ids=ids, labels=ids).loss
            report["losses"][step] = loss.item()
            loss.backward()
            if step == AT and mode == "interrupted" and phase == "update":
                print("READY update", flush=True)  # the signal lands in step(), in a stalled read's wait
            opt.step()
            if step == AT and mode == "interrupted" and phase == "step":
                print("READY step", flush=True)  # the update goes on on its thread; the next forward waits for it
            opt.zero_grad()
            if step == AT and mode == "whole":  # every read of step 3's update
                opt.wait_step()
                report["update_reads"] = rules.pop("update").hits
            if step == SAVED and mode == "interrupted":
                infinity.save_checkpoint(checkpoints, model, opt, tag=f"step{step}", client_state={"step": step})
        opt.wait_step()
    finally:
        if ending == "close":
            infinity.close(model)
            infinity.close(model)


if __name__ == "__main__":
    main()
