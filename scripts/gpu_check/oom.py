"""Phase (oom) of scripts/gpu_check.sh: a real out-of-memory error in backward, recovered.

GPT-2 (124M; ``--tiny``: a few layers, for the CPU machine) at ZeRO stage 3 with its
parameters and optimizer states in host memory. One step on a small batch, then the peaks of
a big batch's forward and backward are measured; the device is capped between them
(``torch.cuda.set_per_process_memory_fraction`` on CUDA, the capacity on the emulated device,
through ``infinity.testing.cap_device_memory``) so that the big batch runs out of memory in
backward. The script catches the ``torch.OutOfMemoryError``, calls ``zero_grad()``, reads the
allocated bytes back (they must be those before the big batch) and trains on with small
batches; plain PyTorch (AdamW on the same device) trains on the same small batches, and the
losses are compared. One JSON line: where it ran out of memory, the allocated bytes before and
after, the losses of both and their largest difference, and ``ok``. Without an accelerator
(``INFINITY_ACCELERATOR`` cpu) it prints a skip record.
"""
import argparse
import copy
import json
import sys

import torch

import infinity
from benchmarks import _models
from infinity.testing import (
    cap_device_memory,
    device_memory_peak,
    device_memory_settled,
    reset_device_memory_peak,
    wait_device_memory,
)

LR = 1e-4


def model_of(tiny: bool):
    """GPT-2 124M, or with ``tiny`` 2 x 64 (vocab 1024): the benchmarks' one builder, dropout and the cache off."""
    torch.manual_seed(0)
    return _models.build(_models.Shape(layers=2, hidden=64, heads=2, vocab=1024) if tiny else _models.SHAPES["124m"])


def on_device(model, dev):
    """``model.to(dev)`` keeping each parameter object: the tied embedding stays tied (on the
    emulated device a plain ``.to`` would untie it)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model.to(device=dev)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def fails_in(model, opt, ids, cap: int) -> str:
    where = "forward"
    cap_device_memory(cap)
    try:
        loss = loss_of(model, ids)
        where = "backward"
        loss.backward()
        where = "nowhere"
    except torch.OutOfMemoryError as e:
        print(f"out of memory in {where}: {str(e).splitlines()[0][:200]}", flush=True)
    finally:
        cap_device_memory(None)
    loss = None
    opt.zero_grad()
    return where


def train(model, opt, batches) -> list:
    losses = []
    for ids in batches:
        loss = loss_of(model, ids)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    wait = getattr(opt, "wait_step", None)
    if wait is not None:
        wait()
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a two-layer GPT-2 and short sequences (the CPU machine)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; --tiny 64)")
    p.add_argument("--small", type=int, default=2, help="sequences per small batch")
    p.add_argument("--big", type=int, default=None, help="sequences in the batch that runs out of memory "
                   "(default 16; --tiny 32)")
    p.add_argument("--steps", type=int, default=3, help="small batches, the first before the failure")
    args = p.parse_args()
    seq = args.seq or (64 if args.tiny else 1024)
    big_rows = args.big or (32 if args.tiny else 16)
    dev = infinity.device()
    if dev.type == "cpu":
        print(json.dumps({"skipped": "no accelerator (INFINITY_ACCELERATOR=cuda on a GPU, or emulated)"}), flush=True)
        return 0
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides: the losses comparable
        torch.backends.cudnn.allow_tf32 = False
    model = model_of(args.tiny)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    small = [torch.randint(0, vocab, (args.small, seq), generator=g).to(dev) for _ in range(args.steps)]
    big = torch.randint(0, vocab, (big_rows, seq), generator=g).to(dev)

    plain = on_device(copy.deepcopy(model), dev)  # plain PyTorch on the same batches, first: then freed
    plain_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0), small)
    del plain
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    cfg = {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
           "precision": {"dtype": "fp32"}, "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.0},
           "gradient_clipping": 0.0}
    model, opt = infinity.initialize(model, config=cfg)
    try:
        losses = train(model, opt, small[:1])
        before = device_memory_settled()
        reset_device_memory_peak()
        loss = loss_of(model, big)
        forward = device_memory_peak() - before
        loss.backward()
        whole = device_memory_peak() - before
        loss = None
        opt.zero_grad()
        before = wait_device_memory(before, timeout=10.0)
        where, tries = "nowhere", []
        for frac in (0.5, 0.75, 0.9):  # between the peaks; higher if the cache's rounding made it fail in forward
            cap = before + forward + int((whole - forward) * frac)
            where = fails_in(model, opt, big, cap)
            tries.append({"cap": cap, "where": where})
            if where != "forward":
                break
        after = wait_device_memory(before, timeout=10.0)
        losses += train(model, opt, small[1:])
    finally:
        infinity.close(model)
    diff = max(abs(a - b) for a, b in zip(losses, plain_losses))
    ok = where == "backward" and after == before and diff < 1e-4  # the native CPU Adam's last bits against torch's
    print(json.dumps({"device": str(dev), "where": where, "tries": tries, "forward_peak": forward, "peak": whole,
                      "allocated_before": before, "allocated_after": after, "losses": losses,
                      "plain_losses": plain_losses, "max_loss_diff": diff, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
