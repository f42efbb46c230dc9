"""A micro-batch that fails leaves an engine that trains on, exactly.

Backward (Note [aborted backward] in infinity/_zero/_backward.py): a tiny three-block GPT-2
whose backward raises once, inside the first block's attention, when the gradients of the
blocks above were reduced already (the last block's delivered to the optimizer store, the
middle one's in a bucket not yet launched) and the first block's MLP has its gradients in
``.grad``. The user code catches the exception, runs a forward without gradients, has
``step()`` refuse the partial gradients, calls ``zero_grad()`` and goes on. Every loss and the
final weights are bit for bit those of the same engine that skipped that batch, and match
plain PyTorch (AdamW, which fails and recovers the same way) within 1e-6 for the losses and
1e-5 for the weights (the native CPU Adam rounds a few last bits differently from torch's, a
run without any failure differs by 2e-6), at stages 2 and 3, every tier, on the CPU and on
the emulated accelerator where gradients land by device->host copies. After ``zero_grad``
nothing of the failed backward is left (no hold, no gathered unit, no partial bucket, no copy
in flight, no gradient).

Step (Note [failed step] in infinity/_zero/_step_gate.py): with the states on NVMe, streamed
chunk by chunk, an I/O fault armed during a step, on the main thread (stage 2) and on the
overlapped step's thread (stage 3, where the error surfaces at the next wait). A fault before
the update changed a state leaves every state file bit for bit as before the step and the
engine trains on like plain PyTorch that skipped the batch; a fault after it began leaves
them between two steps, and then every step, fetch and save refuses until a checkpoint is
loaded, after which training goes on exactly.
"""
from __future__ import annotations

import errno
import faulthandler
import os
from dataclasses import dataclass

import pytest
import torch
from _configs import zero_config
from _hf_models import _hf_checkpointing
from _models import batches, gpt2

import infinity
from infinity._runtime import _accelerator as acc
from infinity._zero._grad_sink import Received
from infinity._zero._phase import Phase
from infinity._zero._step_gate import GateState
from infinity.aio import AioError
from infinity.errors import EngineError
from infinity.testing import inject_io_fault

HANG_GUARD = 300  # seconds: a test that hangs kills the process with every thread's stack
STEPS, FAIL_AT = 5, 2
LR, WEIGHT_DECAY = 1e-3, 0.01
TOL, WEIGHTS_TOL = 1e-6, 1e-5  # against plain PyTorch: its losses, its weights (the native Adam's last bits)
STATE_FILES = ("master", "exp_avg", "exp_avg_sq")


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class Boom(RuntimeError):
    pass


class _RaiseOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed``, once."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _RaiseOnce.armed:
            _RaiseOnce.armed = False
            raise Boom("backward failed on purpose")
        return grad


def _raise_in_backward(module, args, output):
    if isinstance(output, torch.Tensor):
        return _RaiseOnce.apply(output)
    return (_RaiseOnce.apply(output[0]),) + tuple(output[1:])


def model_that_fails(mode: str = "none"):
    """GPT-2 of three blocks, activation checkpointing ``mode``; backward can raise inside the
    first block's attention (inside the recomputation's backward where a mode is set)."""
    model = _hf_checkpointing(gpt2(layers=3), mode)
    model.transformer.h[0].attn.register_forward_hook(_raise_in_backward)
    return model


def bucket_of_two_blocks(model) -> int:
    """A reduce bucket that closes after [ln_f, block 2] and holds [block 1, block 0]: when
    backward fails in block 0, block 2's gradients were reduced and block 1's wait in a bucket."""
    return sum(p.numel() for i in (0, 1) for p in model.transformer.h[i].parameters())


def on_device(model, dev):
    """``model.to(dev)`` keeping each parameter object (the tied embedding stays tied)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model.to(device=dev)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ------------------------------------------------------------------ backward


@dataclass(frozen=True)
class Cell:
    stage: int
    param: str = "none"  # stage 3
    optim: str = "none"
    device: str = "cpu"  # or the emulated accelerator
    mode: str = "none"  # activation checkpointing

    @property
    def id(self) -> str:
        param = f"-param-{self.param}" if self.stage == 3 else ""
        return f"s{self.stage}{param}-opt-{self.optim}-{self.device}-{self.mode}"

    def config(self, nvme: str, bucket: int) -> dict:
        extra = {"prefetch": {"persistence_threshold": 0}} if self.stage == 3 else {}
        return zero_config(self.stage, param=self.param if self.stage == 3 else None, optim=self.optim, nvme=nvme,
                           lr=LR, weight_decay=WEIGHT_DECAY, adam="adamw", bucket=bucket, **extra)


CELLS = [Cell(2), Cell(2, optim="cpu"), Cell(2, optim="nvme"), Cell(3), Cell(3, "cpu", "cpu"), Cell(3, "nvme", "nvme"),
         Cell(2, optim="cpu", device="emulated"), Cell(3, "cpu", "cpu", device="emulated"),
         Cell(3, "nvme", "nvme", mode="reentrant"), Cell(3, "nvme", "nvme", mode="nonreentrant")]


def fit(model, opt, dev, after_failure=lambda: None, fail: bool = True) -> list:
    """STEPS steps; the backward of batch FAIL_AT raises (without ``fail``: is not run), then
    a forward without gradients, ``after_failure()`` and ``zero_grad``. The loss of every forward."""
    losses = []
    for i, ids in enumerate(batches(STEPS)):
        ids = ids.to(dev)
        loss = loss_of(model, ids)
        losses.append(loss.item())
        _RaiseOnce.armed = i == FAIL_AT
        try:
            if fail or i != FAIL_AT:
                loss.backward()
            else:
                raise Boom("skipped")
        except Boom:
            with torch.no_grad():  # stage 3 ends the failed backward here
                losses.append(loss_of(model, ids).item())
            after_failure()
            opt.zero_grad()
            continue
        finally:
            _RaiseOnce.armed = False
        opt.step()
        opt.zero_grad()
    return losses


def assert_nothing_left(model, opt) -> None:
    """Nothing of the failed backward is left anywhere (Note [aborted backward] in _backward.py)."""
    engine = opt.engine
    assert engine.calls.phase is Phase.IDLE
    held = {u.module_name: engine.ledger.describe(u) for u in engine.units if engine.ledger.count(u)}
    assert not held, held
    assert engine.live_elems == 0, "gathered parameters left behind"
    assert engine.reducer.idle, "the reducer kept a partial bucket or a unit of the failed backward"
    assert opt.sink.in_flight == 0 and opt.sink.received is Received.WHOLE and not opt.sink.got_grad.any()
    assert all(p.grad is None for p in model.parameters())


def train(cell: Cell, nvme: str, dev, fail: bool) -> tuple:
    """The cell's engine through ``fit``; where the backward fails, ``step()`` refuses before
    ``zero_grad`` and nothing is left after it. The losses and the final weights."""
    base = model_that_fails(cell.mode)
    model, opt = infinity.initialize(base, cell.config(nvme, bucket_of_two_blocks(base)))

    def refuse_then_discard():
        if fail:
            with pytest.raises(EngineError, match=r"partial.*zero_grad\(\)"):
                opt.step()

    try:
        losses = fit(model, opt, dev, refuse_then_discard, fail=fail)
        assert_nothing_left(model, opt)
        with infinity.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    finally:
        opt.engine.close()
    return losses, params


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_failed_backward_then_zero_grad_trains_on_exactly(cell, tmp_path):
    with acc.using(cell.device):
        dev = acc.device()
        plain = on_device(model_that_fails(cell.mode), dev)
        ref = fit(plain, torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY), dev)
        expected = {n: p.detach().cpu() for n, p in plain.named_parameters()}
        losses, params = train(cell, str(tmp_path / "failed"), dev, fail=True)
        skipped_losses, skipped_params = train(cell, str(tmp_path / "skipped"), dev, fail=False)
    assert losses == skipped_losses
    for name, value in skipped_params.items():
        assert torch.equal(params[name], value), f"{name}: differs from the run that skipped the batch"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=TOL, atol=TOL)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=WEIGHTS_TOL, atol=WEIGHTS_TOL, msg=lambda m: f"{name}: {m}")


def test_zero_grad_after_a_failed_backward_leaves_nothing(tmp_path):
    """The failed backward ended by ``zero_grad`` itself, at stage 3 with every state on NVMe."""
    base = model_that_fails()
    model, opt = infinity.initialize(base, Cell(3, "nvme", "nvme").config(str(tmp_path), bucket_of_two_blocks(base)))
    try:
        ids = batches(1)[0]
        _RaiseOnce.armed = True
        with pytest.raises(Boom):
            loss_of(model, ids).backward()
        assert opt.engine.calls.phase is Phase.BACKWARD and opt.engine.live_elems > 0  # what the failure left
        opt.zero_grad()
        assert_nothing_left(model, opt)
    finally:
        _RaiseOnce.armed = False
        opt.engine.close()


def test_close_after_a_failed_backward(tmp_path):
    base = model_that_fails()
    model, opt = infinity.initialize(base, Cell(3, "nvme", "nvme").config(str(tmp_path), bucket_of_two_blocks(base)))
    swap = [d.path for d in opt.engine.swap_dirs.values()]
    _RaiseOnce.armed = True
    try:
        with pytest.raises(Boom):
            loss_of(model, batches(1)[0]).backward()
    finally:
        _RaiseOnce.armed = False
    opt.engine.close()
    assert opt.engine.calls.phase is Phase.IDLE and opt.engine.live_elems == 0
    assert not any(os.path.exists(p) for p in swap)


# ------------------------------------------------------------------ step


def streamed(stage: int, nvme: str) -> dict:
    """Every optimizer state on NVMe, read chunk by chunk (no host cache), gradients in a swap file;
    stage 3's parameters on NVMe too, read from the master weights (fp32). Stage 3 overlaps the
    step with the next forward on its own thread; stage 2 runs it on the main thread."""
    cfg = zero_config(stage, param="nvme" if stage == 3 else None, optim="nvme", nvme=nvme, chunk=4096, lr=LR,
                      weight_decay=WEIGHT_DECAY, adam="adamw", optim_extra={"host_cache": 0, "gradients": "nvme"})
    if stage == 3:
        cfg["zero"]["offload_param"]["max_in_cpu"] = 0
        cfg["zero"]["prefetch"] = {"persistence_threshold": 0}
    return cfg


def plain_run(skip_step=(), skip=()) -> tuple:
    """Plain AdamW over the same batches: no forward for ``skip``, no step for ``skip_step``
    (its gradients dropped). The forwards' losses and the final weights."""
    model = gpt2(layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for i, ids in enumerate(batches(STEPS)):
        if i in skip:
            continue
        loss = loss_of(model, ids)
        losses.append(loss.item())
        loss.backward()
        if i not in skip_step:
            opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def state_bytes(opt) -> dict:
    return {name: open(opt.store.paths[name], "rb").read() for name in STATE_FILES}


def weights(model) -> dict:
    with infinity.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_run(losses, params, ref) -> None:
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=TOL, atol=TOL)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=WEIGHTS_TOL, atol=WEIGHTS_TOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [2, 3], ids=["main-thread", "overlapped"])
def test_step_failed_before_changing_a_state_is_undone(stage, tmp_path):
    """The first read of the master weights in step FAIL_AT fails: every state file is as
    before that step, and training goes on as plain PyTorch that skipped the batch. Stage 3's
    error surfaces in the next forward, whose batch is lost too."""
    model, opt = infinity.initialize(gpt2(layers=3), streamed(stage, str(tmp_path)))
    losses, failed, before = [], [], None
    try:
        for i, ids in enumerate(batches(STEPS)):
            try:
                loss = loss_of(model, ids)
                losses.append(loss.item())
                loss.backward()
                if i == FAIL_AT:
                    before = state_bytes(opt)
                    inject_io_fault(opt.store.paths["master"], "read", "errno", nth=1, count=1, arg=errno.EIO)
                opt.step()
            except AioError as e:
                failed.append(i)
                assert "master.swp" in str(e)
                assert state_bytes(opt) == before, "the failed step changed a state file"
                assert opt.gate.state is GateState.SETTLED
            opt.zero_grad()
        params = weights(model)
    finally:
        infinity.aio._inject.clear()
        opt.engine.close()
    lost = FAIL_AT + 1 if stage == 3 else FAIL_AT  # where the error surfaced
    assert failed == [lost]
    assert_same_run(losses, params, plain_run(skip_step={FAIL_AT}, skip={lost} - {FAIL_AT}))


MIDWAY = [("master", "read", 3), ("exp_avg", "write", 2)]  # after the update changed chunks; a write: one torn


@pytest.mark.parametrize("stage", [2, 3], ids=["main-thread", "overlapped"])
@pytest.mark.parametrize("name,op,nth", MIDWAY, ids=[f"{op}-{name}" for name, op, _ in MIDWAY])
def test_step_failed_midway_refuses_until_a_checkpoint_loads(stage, name, op, nth, tmp_path):
    """An I/O fault in step FAIL_AT after the update changed some chunks: step, forward
    (stage 3's fetches) and save refuse; loading the checkpoint of the step before brings
    every state back and training goes on exactly."""
    model, opt = infinity.initialize(gpt2(layers=3), streamed(stage, str(tmp_path / "nvme")))
    ckpt = str(tmp_path / "ckpt")
    losses = []
    all_batches = batches(STEPS)
    try:
        for ids in all_batches[:FAIL_AT]:
            loss = loss_of(model, ids)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        infinity.save_checkpoint(ckpt, model, opt, tag="before")
        ids = all_batches[FAIL_AT]
        loss = loss_of(model, ids)
        losses.append(loss.item())
        loss.backward()
        before = state_bytes(opt)
        inject_io_fault(opt.store.paths[name], op, "errno", nth=nth, count=1, arg=errno.EIO)
        with pytest.raises(AioError, match=f"{op} of .*{name}.swp"):
            opt.step()
            opt.wait_step()  # the overlapped step's error surfaces at the next wait
        infinity.aio._inject.clear()
        assert opt.gate.state is GateState.FAILED
        assert state_bytes(opt) != before  # between two steps: nothing may use them
        refused = r"optimizer step failed \(AioError.*load_checkpoint"
        with pytest.raises(EngineError, match=refused):
            opt.step()
        with pytest.raises(EngineError, match=refused):
            infinity.save_checkpoint(ckpt, model, opt, tag="between")
        if stage == 3:
            with pytest.raises(EngineError, match=refused), torch.no_grad():
                loss_of(model, ids)
        opt.zero_grad()
        infinity.load_checkpoint(ckpt, model, opt, tag="before")
        assert opt.gate.state is GateState.SETTLED
        for ids in all_batches[FAIL_AT + 1 :]:
            loss = loss_of(model, ids)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        params = weights(model)
    finally:
        infinity.aio._inject.clear()
        opt.engine.close()
    assert_same_run(losses, params, plain_run(skip_step={FAIL_AT}))
