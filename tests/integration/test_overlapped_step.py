"""The overlapped step on an accelerator (Note [overlapped step] in _zero_optimizer.py): with
every state in host memory, the host's update of step N runs while the device computes the
forward of step N+1, unit by unit in the order that forward needs them, and training stays
exactly that of plain PyTorch.

The device is the emulated one with a time per operator (``compute_delay``: a sleep, the
host free meanwhile, as while a GPU computes), so "the update ran while the device
computed" is a fact the test counts: each update chunk (slowed by a sleep to a large model's
rate) records whether operators ran on the device while it ran. Timings are printed, not
asserted.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from _models import gpt2
from _update_pace import pace_chunks

import infinity
from infinity._offload._placement import overlap_step
from infinity._runtime import _accelerator as acc
from infinity._runtime._tiers import Tier

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")

STEPS, LR, WD, CLIP = 4, 1e-3, 0.01, 1.0
LAYERS, HIDDEN = 4, 64


def _batches(dev):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (4, 16), generator=g).to(dev) for _ in range(STEPS)]


def _config(overlap: str, accumulation: int = 1) -> dict:
    return {"gradient_accumulation_steps": accumulation, "zero": {"stage": 3, "offload_param": {"device": "cpu"},
                     "offload_optimizer": {"device": "cpu", "overlap_step": overlap, "chunk_size": 1024},
                     "prefetch": {"persistence_threshold": 0}},
            "precision": {"dtype": "fp32"}, "gradient_clipping": CLIP,
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WD}}


def _plain(dev, accumulation: int = 1):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # tied weights stay tied on the emulated device
    try:
        model = gpt2(layers=LAYERS, hidden=HIDDEN).to(device=dev, dtype=torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for ids in _batches(dev):
        for part in ids.chunk(accumulation):
            loss = model(input_ids=part, labels=part).loss
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _recording(opt, chunks: list, update_s: float):
    """Each chunk at a large model's pace (_update_pace.py), recording its thread: the main one?"""
    pace_chunks(opt, "_update_chunk", chunks, update_s, lambda args, kwargs: threading.current_thread() is
                threading.main_thread())


def _train(overlap: str, dev, delay: float, update_s: float):
    from infinity._runtime._accelerator import _emulated

    model, opt = infinity.initialize(gpt2(layers=LAYERS, hidden=HIDDEN), config=_config(overlap))
    chunks: list = []
    _recording(opt, chunks, update_s)
    losses, seconds, moved = [], [], {}
    try:
        with _emulated.compute_delay(delay):
            for ids in _batches(dev):
                start = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                seconds.append(time.perf_counter() - start)
            opt.wait_step()
        grad_bytes, total = opt.state_bytes()["grads"], opt.total
        moved = opt.engine.telemetry()["bytes"]
    finally:
        opt.engine.close()
    return losses, chunks, seconds, grad_bytes, total, moved


@pytest.fixture
def device():
    with acc.using("emulated"):
        yield acc.device()


def test_the_update_runs_while_the_device_computes_and_training_is_exact(device):
    ref = _plain(device)
    on_losses, on_chunks, on_s, grad_bytes, total, moved = _train("auto", device, delay=3e-4, update_s=0.1)
    off_losses, off_chunks, off_s, _, _, _ = _train("off", device, delay=3e-4, update_s=0.1)
    print(f"\nstep seconds, overlapped: {on_s[1:]}; in step(): {off_s[1:]}")
    torch.testing.assert_close(torch.tensor(on_losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(off_losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)

    background = [busy for main, busy in on_chunks if not main]
    assert len(background) >= (STEPS - 1) * LAYERS, on_chunks  # every block's chunk after the head, each step
    assert sum(background) >= len(background) // 2, on_chunks  # most ran while the device computed
    assert all(main for main, _ in off_chunks) and not any(busy for _, busy in off_chunks), off_chunks
    # Note [one gradient buffer] in _optimizer_store.py: no second buffer for the overlapped step
    assert grad_bytes == 4 * total
    # Note [gradients landed in place] in _grad_buffer.py: every unit's gradient was copied into its range, none added
    # on the host
    assert moved["grad_landed_in_place"] == moved["grad_offload"] > 0, moved


def test_accumulated_micro_batches_land_in_place_then_add_and_stay_exact(device):
    """The first micro-batch's gradients land in place (norm on the device), the second's
    are added on the host (norm there): the clipping norm mixes both and training is exact."""
    ref = _plain(device, accumulation=2)
    model, opt = infinity.initialize(gpt2(layers=LAYERS, hidden=HIDDEN), config=_config("auto", accumulation=2))
    losses = []
    try:
        for ids in _batches(device):
            for part in ids.chunk(2):
                loss = model(input_ids=part, labels=part).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.wait_step()
        moved = opt.engine.telemetry()["bytes"]
    finally:
        opt.engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    assert 0 < 2 * moved["grad_landed_in_place"] == moved["grad_offload"], moved  # half in place, half added


@pytest.mark.parametrize("choice,stage3,opt,param,accelerator,expected", [
    ("auto", True, Tier.CPU, Tier.CPU, True, True),  # the device computes while the host updates
    ("auto", True, Tier.CPU, Tier.DEVICE, True, True),
    ("auto", True, Tier.CPU, Tier.CPU, False, False),  # CPU alone: the forward needs the cores
    ("auto", True, Tier.NVME, Tier.CPU, False, True),  # bound by its I/O
    ("auto", True, Tier.CPU, Tier.NVME, False, True),
    ("auto", True, Tier.DEVICE, Tier.DEVICE, True, False),  # the update runs on the device
    ("auto", False, Tier.CPU, Tier.DEVICE, True, False),  # stages 1-2 gather the whole parameters in step()
    ("on", True, Tier.CPU, Tier.CPU, False, True),
    ("off", True, Tier.NVME, Tier.NVME, True, False),
])
def test_when_the_step_overlaps(choice, stage3, opt, param, accelerator, expected, monkeypatch):
    monkeypatch.setattr(acc, "has_accelerator", lambda: accelerator)
    states_in_host = opt is Tier.CPU
    assert overlap_step(choice, stage3, opt, param, states_in_host) is expected


def test_overlap_step_on_needs_stage_3_and_states_off_the_device():
    with pytest.raises(Exception, match="overlap_step"):
        infinity.Config.from_dict({"zero": {"stage": 2, "offload_optimizer": {"device": "cpu", "overlap_step": "on"}}})
    with pytest.raises(Exception, match="overlap_step"):
        infinity.Config.from_dict({"zero": {"stage": 3, "offload_optimizer": {"overlap_step": "on"}}})
