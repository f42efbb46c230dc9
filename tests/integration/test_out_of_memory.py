"""Out of device memory in forward or backward is recovered, and the batch size is found for the user.

On the emulated device with a capacity (it raises ``torch.OutOfMemoryError`` as CUDA does,
inside a backward too: Note [errors inside backward] in _emulated.py): a batch too big for the
device fails in forward (in the first gather of parameters, then in the model's own operators),
then in backward; after each, once the caller dropped the exception
and called ``zero_grad()``, the device's allocated bytes are back to their level before the
failed step (Note [aborted forward] in infinity/_zero/_engine.py), and training goes on with
smaller batches exactly as plain PyTorch trained on those batches alone. On the CPU the same
with the engine's own ``device_memory_limit`` (activation checkpoints brought back for
backward past it). Then accelerate's
``find_executable_batch_size`` around a plain loop on infinity, and the Trainer's
``auto_find_batch_size`` on ``InfinityTrainer`` (Note [batch size retries] in
infinity/integrations/transformers.py), each start at 8, fail at 8, 7, 6 and 5, and train at 4
exactly as plain PyTorch and the plain Trainer do at 4: the failed tries left the model's
parameters and optimizer states untouched.

The capacity is set from peaks measured on the same engine (a forward and backward whose
gradients are discarded), so the failures fall where the test says whatever the model's sizes.
"""
from __future__ import annotations

import faulthandler

import pytest
import torch
from _configs import zero_config
from _models import VOCAB, gpt2

import infinity
from infinity._runtime._accelerator import _emulated
from infinity.testing import device_memory_settled, wait_device_memory

HANG_GUARD = 300  # seconds: a test that hangs kills the process with every thread's stack
WAIT_S = HANG_GUARD / 10  # the longest wait for the device's bytes to come back (never a timing asserted)
LR, WEIGHT_DECAY = 1e-3, 0.01
TOL, WEIGHTS_TOL = 1e-6, 1e-5  # against plain PyTorch (the native CPU Adam's last bits: test_failed_steps.py)
SEQ = 32


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def config(stage: int, nvme: str) -> dict:
    extra = {"prefetch": {"persistence_threshold": 0}} if stage == 3 else {}
    return zero_config(stage, param="cpu" if stage == 3 else None, optim="cpu", nvme=nvme, lr=LR,
                       weight_decay=WEIGHT_DECAY, adam="adamw", **extra)


def rows(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def peaks(model, opt, ids) -> tuple:
    """Bytes above the level before it that the forward, then the forward and backward, of
    ``ids`` reach on the device; the gradients are discarded. (The first backward of an engine
    also allocates its reduce bucket, kept after: measure after one.)"""
    base = device_memory_settled()
    _emulated.reset_peak_memory_stats()
    loss = loss_of(model, ids)
    forward = _emulated.max_memory_allocated() - base
    loss.backward()
    whole = _emulated.max_memory_allocated() - base
    del loss
    opt.zero_grad()
    return forward, whole


def plain_run(batches, layers: int = 2) -> tuple:
    """Plain AdamW on the CPU over ``batches``: the losses and the final weights."""
    model = gpt2(layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for ids in batches:
        loss = loss_of(model, ids)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def weights(model) -> dict:
    with infinity.GatheredParameters(list(model.parameters())):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def assert_same_run(losses, params, ref) -> None:
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=TOL, atol=TOL)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=WEIGHTS_TOL, atol=WEIGHTS_TOL, msg=lambda m: f"{name}: {m}")


def step(model, opt, ids, losses) -> None:
    loss = loss_of(model, ids)
    losses.append(loss.item())
    loss.backward()
    opt.step()
    opt.zero_grad()
    opt.wait_step()


def fails_in(model, opt, ids, capacity: int) -> str:
    """A step on ``ids`` with the device's capacity at ``capacity``: where it ran out of memory."""
    where = "forward"
    _emulated.set_capacity(capacity)
    try:
        loss = loss_of(model, ids)
        where = "backward"
        loss.backward()
        where = "nowhere"
    except torch.OutOfMemoryError as e:
        assert " out of memory. Tried to allocate" in str(e)
    finally:
        _emulated.set_capacity(1 << 40)
    loss = None
    opt.zero_grad()  # what the caller does after a failed micro-batch (Note [aborted backward] in _backward.py)
    return where


@pytest.mark.filterwarnings("error:module forward hook")  # the engine's hooks themselves did not fail in the abort
@pytest.mark.parametrize("stage", [2, 3])
def test_out_of_memory_in_forward_and_backward_is_recovered_exactly(stage, emulated, tmp_path):
    small, big = rows(6).split(2), rows(16, seed=2)
    model, opt = infinity.initialize(gpt2(), config(stage, str(tmp_path)))
    losses, engine, big = [], opt.engine, big.to(emulated)
    try:
        before = device_memory_settled()  # the first forward has no trace to prefetch by: it fails in the first unit's acquire
        assert fails_in(model, opt, big, before + 64) == "forward"
        assert wait_device_memory(before, timeout=WAIT_S) == before, "the failed gather left device memory held"
        assert not [u.module_name for u in engine.units if engine.ledger.count(u)], "a failed acquire kept its hold"
        step(model, opt, small[0].to(emulated), losses)
        before = device_memory_settled()
        forward, whole = peaks(model, opt, big)
        assert wait_device_memory(before, timeout=WAIT_S) == before
        assert forward < whole
        before = device_memory_settled()
        assert fails_in(model, opt, big, before + 64) == "forward"  # in the gathers the prefetcher starts
        assert wait_device_memory(before, timeout=WAIT_S) == before, "the failed prefetch left device memory held"
        assert fails_in(model, opt, big, before + forward // 2) == "forward"
        assert wait_device_memory(before, timeout=WAIT_S) == before, "the failed forward left device memory held"
        assert fails_in(model, opt, big, before + (forward + whole) // 2) == "backward"
        assert wait_device_memory(before, timeout=WAIT_S) == before, \
            f"the failed backward left {device_memory_settled() - before} bytes of device memory held"
        assert engine.live_elems == 0 and not opt.sink.got_grad.any()
        for ids in small[1:]:
            step(model, opt, ids.to(emulated), losses)
        params = weights(model)
    finally:
        opt.engine.close()
    assert_same_run(losses, params, plain_run(small))


@pytest.mark.filterwarnings("error:module forward hook")  # the engine's hooks themselves did not fail in the abort
def test_out_of_memory_at_each_early_allocation_of_a_forward_leaves_nothing(emulated, tmp_path):
    """Stage 3, the capacity a little higher each time, so that the big batch's forward fails at
    each of its first allocations in turn (shards staged to the device, the gathers the
    prefetcher starts, the first activations): after each, no unit is held, nothing of the
    forward is left on the device, and the steps between go on exactly as plain PyTorch's."""
    small, big = rows(2), rows(16, seed=2).to(emulated)
    model, opt = infinity.initialize(gpt2(layers=3), config(3, str(tmp_path)))
    engine, losses, caps = opt.engine, [], range(4000, 40001, 4000)
    try:
        for _ in range(2):  # the trace recorded: the prefetcher runs ahead
            step(model, opt, small.to(emulated), losses)
        for cap in caps:
            before = device_memory_settled()
            assert fails_in(model, opt, big, before + cap) == "forward"
            assert wait_device_memory(before, timeout=WAIT_S) == before, \
                f"capacity +{cap}: {device_memory_settled() - before} bytes of the failed forward left"
            held = [u.module_name for u in engine.units if engine.ledger.count(u)]
            assert not held, f"capacity +{cap}: {held} still held"
            step(model, opt, small.to(emulated), losses)
        params = weights(model)
    finally:
        engine.close()
    assert_same_run(losses, params, plain_run([small] * (2 + len(caps)), layers=3))


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_the_engines_budget_on_the_cpu_is_recovered_exactly(mode, tmp_path):
    """On the CPU (no accelerator), ``device_memory_limit`` with activation checkpoints offloaded
    to host memory: a batch whose checkpoints brought back for backward pass the limit raises
    ``DeviceOutOfMemory`` (a ``torch.OutOfMemoryError``) inside backward (Note [device budget]
    in infinity/_runtime/_accelerator/__init__.py); after ``zero_grad`` the budget holds what it
    held before the step, and training goes on exactly as plain PyTorch, checkpointing the same
    way, on the small batches."""
    from _hf_models import _hf_checkpointing

    from infinity._runtime._accelerator import DeviceOutOfMemory

    small, big = rows(6).split(2), rows(64, seed=2)
    cfg = {**config(3, str(tmp_path)), "activation_checkpointing": {"offload": "cpu"}, "device_memory_limit": 400_000}
    model, opt = infinity.initialize(_hf_checkpointing(gpt2(), mode), config=cfg)
    budget, losses = opt.engine.ledger.budget, []
    try:
        step(model, opt, small[0], losses)
        before = budget.stats().allocated
        loss = loss_of(model, big)
        with pytest.raises(DeviceOutOfMemory, match=r"out of memory\. Tried to allocate .* activation checkpoint"):
            loss.backward()
        loss = None
        opt.zero_grad()
        assert budget.stats().allocated == before, "the failed backward left bytes charged to the budget"
        for ids in small[1:]:
            step(model, opt, ids, losses)
        params = weights(model)
    finally:
        opt.engine.close()
    plain = _hf_checkpointing(gpt2(), mode)
    adamw = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ref = []
    for ids in small:
        loss = loss_of(plain, ids)
        ref.append(loss.item())
        loss.backward()
        adamw.step()
        adamw.zero_grad()
    assert_same_run(losses, params, (ref, {n: p.detach() for n, p in plain.named_parameters()}))


def test_find_executable_batch_size_finds_the_batch_and_trains_exactly(emulated, tmp_path):
    """accelerate's loop around a plain training loop on infinity: it starts at 8, each try
    runs out of device memory until 4, which trains exactly as plain PyTorch does at 4."""
    from accelerate.utils import find_executable_batch_size

    data, steps = rows(24, seed=3), 3
    model, opt = infinity.initialize(gpt2(), config(3, str(tmp_path)))
    try:
        peaks(model, opt, data[:4].to(emulated))
        fit4 = peaks(model, opt, data[:4].to(emulated))[1]
        fit5 = peaks(model, opt, data[:5].to(emulated))[1]
        idle = device_memory_settled()
        capacity = idle + (fit4 + fit5) // 2
        tries = []

        @find_executable_batch_size(starting_batch_size=8)
        def fit(batch_size):
            tries.append(batch_size)
            opt.zero_grad()  # what a failed try left (plain PyTorch's partial .grad as much as infinity's)
            assert wait_device_memory(idle, timeout=WAIT_S) == idle, "a failed try left device memory held"
            losses = []
            for ids in data.split(batch_size)[:steps]:
                step(model, opt, ids.to(emulated), losses)
            return losses

        _emulated.set_capacity(capacity)
        try:
            losses = fit()
        finally:
            _emulated.set_capacity(1 << 40)
        params = weights(model)
    finally:
        opt.engine.close()
    assert tries == [8, 7, 6, 5, 4]
    assert_same_run(losses, params, plain_run(data.split(4)[:steps]))


def test_trainer_auto_find_batch_size_trains_as_the_plain_trainer_at_the_batch_found(emulated, tmp_path):
    """``InfinityTrainer(auto_find_batch_size=True)`` from 8 on a device that holds 4: the
    engine is built once, the failed tries leave the model as they found it, and every loss
    is the plain Trainer's at batch size 4 (both in the data's order)."""
    from _trainer_job import dataset, losses, tiny_llama, training_args
    from transformers import Trainer, TrainerCallback

    from infinity.integrations.transformers import InfinityTrainer

    # a small reduce bucket: the first backward allocates it, and a big one would leave the first try room for a step
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                    "prefetch": {"persistence_threshold": 0}, "reduce_bucket_size": 10_000},
           "precision": {"dtype": "fp32"}}
    over = dict(gradient_accumulation_steps=1, max_steps=3, train_sampling_strategy="sequential")
    data = dataset(seq=SEQ)
    start = device_memory_settled()
    probe, probe_opt = infinity.initialize(tiny_llama(), config=cfg)
    batch = torch.stack([r["input_ids"] for r in data[:5]]).to(emulated)
    fit = []
    for n in (4, 5):  # the device's peak over steps of n rows (the first without a trace, the next prefetched)
        _emulated.reset_peak_memory_stats()
        for _ in range(3):
            step(probe, probe_opt, batch[:n], [])
        fit.append(_emulated.max_memory_allocated() - start)
    idle = device_memory_settled() - start  # the engine between steps, its reduce bucket allocated
    probe_opt.engine.close()
    del probe, probe_opt, batch
    assert device_memory_settled() == start

    engines = []

    class EachTry(TrainerCallback):
        """At the start of each try: the engine it trains, and the device memory back to what
        the engine holds between steps."""

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            engines.append(optimizer.engine)
            assert wait_device_memory(start + idle, at_most=True, timeout=WAIT_S) <= start + idle, \
                "a failed try left device memory held"

    plain = Trainer(model=tiny_llama(), args=training_args(str(tmp_path / "plain"), optim="adamw_torch",
                                                          per_device_train_batch_size=4, **over),
                    train_dataset=data)
    plain.train()
    ours = InfinityTrainer(model=tiny_llama(), train_dataset=data, infinity_config=cfg, callbacks=[EachTry()],
                           args=training_args(str(tmp_path / "ours"), per_device_train_batch_size=8,
                                              auto_find_batch_size=True, **over))
    _emulated.set_capacity(start + sum(fit) // 2)
    try:
        ours.train()
    finally:
        _emulated.set_capacity(1 << 40)
    try:
        assert ours.state.train_batch_size == 4
        assert len(engines) == 5 and all(e is engines[0] for e in engines), "tries at 8, 7, 6, 5, 4 on one engine"
        expected, got = losses(plain), losses(ours)
        assert len(expected) == len(got) == 3
        assert got == pytest.approx(expected, rel=0, abs=2e-5)
    finally:
        ours.optimizer.engine.close()


def test_the_gpu_checks_out_of_memory_phase_runs_on_the_emulated_device():
    """scripts/gpu_check/oom.py, the GPU check's phase, at its CPU size on the emulated device:
    out of memory in backward, the allocated bytes back, and the losses of plain PyTorch; on
    the CPU it says it skipped."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "INFINITY_ACCELERATOR": "emulated"}
    run = subprocess.run([sys.executable, str(root / "scripts/gpu_check/oom.py"), "--tiny"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=HANG_GUARD)
    assert run.returncode == 0, run.stdout[-2000:]
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record["ok"] and record["where"] == "backward", record
    assert record["allocated_after"] == record["allocated_before"]
    assert len(record["losses"]) == len(record["plain_losses"]) == 3
    assert record["max_loss_diff"] <= TOL  # the steps after the failure exactly plain PyTorch's on the same device
    env["INFINITY_ACCELERATOR"] = "cpu"
    run = subprocess.run([sys.executable, str(root / "scripts/gpu_check/oom.py"), "--tiny"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=HANG_GUARD)
    assert run.returncode == 0 and "skipped" in json.loads(run.stdout.strip().splitlines()[-1])
