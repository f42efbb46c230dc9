"""No step trains on inf/NaN (Note [non-finite steps] in _zero_optimizer.py).

A poisoned batch is either a NaN gradient with a finite loss (an identity whose backward
returns NaN, as a corrupt activation would) or an inf loss with finite gradients (a constant
inf term, caught only through ``note_loss``). With ``precision.on_nonfinite: error`` the step
raises NonFiniteError naming it and nothing changes; with ``skip`` the parameters and the
optimizer states stay bit for bit what they were, training continues, and the run matches
plain ``torch.optim.AdamW`` that skipped the same step (GradScaler's semantics: the skipped
step does not count in Adam's bias correction). Stages 1-3, optimizer states in memory, on
CPU and on NVMe, one rank and two gloo ranks where only one rank's batch is poisoned.
"""
from __future__ import annotations

import glob
import logging
import os

import pytest
import torch
from _configs import zero_config
from _models import batches, gpt2

import infinity
from infinity.errors import NonFiniteError
from infinity.testing import run_ranks

STEPS, POISONED = 4, 2  # the second of four steps gets the poisoned batch
LR = 2e-3


class _NanGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward (a corrupt activation's effect)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _loss(model, ids, poison: str | None):
    loss = model(input_ids=ids, labels=ids).loss
    if poison == "grad":
        return _NanGrad.apply(loss)
    if poison == "loss":
        return loss + float("inf")  # the gradients stay finite: only the noted loss tells
    return loss


CELLS = {  # id: (stage, param tier, optimizer tier)
    "s1": (1, None, "none"),
    "s2-cpu": (2, None, "cpu"),
    "s3-cpu": (3, "cpu", "cpu"),
    "s3-nvme": (3, "nvme", "nvme"),
}


def _config(cell: str, nvme: str, mode: str) -> dict:
    stage, param, optim = CELLS[cell]
    cfg = zero_config(stage, param=param, optim=optim, nvme=nvme if "nvme" in (param, optim) else None, lr=LR,
                      optim_extra={"host_cache": 0} if optim == "nvme" else None)
    cfg["precision"]["on_nonfinite"] = mode
    return cfg


def _snapshot(model, opt) -> dict:
    """Everything a step may change: gathered parameters, in-memory states, the swap files'
    optimizer states (not the gradient files, which the next backward rewrites)."""
    opt.engine.settle_writes()
    with infinity.GatheredParameters(list(model.parameters())):
        out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    store = opt.store
    for name in ("master", "exp_avg", "exp_avg_sq"):
        t = getattr(store, name, None)
        if isinstance(t, torch.Tensor):
            out[f"state:{name}"] = t.clone()
    for d in opt.engine.swap_dirs.values():
        for path in sorted(glob.glob(os.path.join(d.path, "*.swp"))):
            if "grad" not in os.path.basename(path):
                with open(path, "rb") as f:
                    out[f"file:{os.path.basename(path)}"] = f.read()
    out["steps"] = [opt.step_count(p) for p in model.parameters()]
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} changed in a skipped step"
        else:
            assert a[k] == b[k], f"{k} changed in a skipped step"


def _train(cfg: dict, poison: str, poisoned_rank=None, world: int = 1):
    """Train STEPS steps under infinity, the POISONED one poisoned (on ``poisoned_rank``, or
    every rank); return the gathered final parameters and what happened around the skip."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    model, opt = infinity.initialize(gpt2(seed=0), config=cfg)
    out = {"skipped": []}
    try:
        for step, ids in enumerate(batches(STEPS), start=1):
            bad = poison if step == POISONED and poisoned_rank in (None, rank) else None
            loss = _loss(model, ids.chunk(world)[rank], bad)
            opt.note_loss(loss)
            loss.backward()
            if step == POISONED:
                before = _snapshot(model, opt)
            opt.step()
            opt.zero_grad()
            out["skipped"].append(opt.skipped)
            if step == POISONED:
                _assert_same(before, _snapshot(model, opt))
        with infinity.GatheredParameters(list(model.parameters())):
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["nonfinite_skipped"] = opt.nonfinite_skipped
    finally:
        opt.engine.close()
    return out


def _reference() -> dict:
    """Plain PyTorch AdamW on the whole batches, skipping the POISONED step."""
    model = gpt2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step, ids in enumerate(batches(STEPS), start=1):
        model(input_ids=ids, labels=ids).loss.backward()
        if step != POISONED:
            opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _assert_matches(params: dict, ref: dict) -> None:
    assert params.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(params[n], ref[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("poison", ["grad", "loss"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_skip_leaves_everything_and_matches_a_reference_that_skipped(cell, poison, tmp_path, reference):
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("infinity").addHandler(handler)  # infinity's logger does not propagate to caplog's
    try:
        out = _train(_config(cell, str(tmp_path), "skip"), poison)
    finally:
        logging.getLogger("infinity").removeHandler(handler)
    assert out["skipped"] == [s == POISONED for s in range(1, STEPS + 1)]
    assert out["nonfinite_skipped"] == 1
    assert any(f"step {POISONED} skipped" in r.getMessage() for r in records)
    _assert_matches(out["params"], reference)


@pytest.mark.parametrize("poison, what", [("grad", "the gradients"), ("loss", "the loss")])
@pytest.mark.parametrize("cell", ["s1", "s3-cpu", "s3-nvme"])
def test_error_names_the_step_and_changes_nothing(cell, poison, what, tmp_path):
    model, opt = infinity.initialize(gpt2(seed=0), config=_config(cell, str(tmp_path), "error"))
    try:
        for step, ids in enumerate(batches(POISONED), start=1):
            loss = _loss(model, ids, poison if step == POISONED else None)
            opt.note_loss(loss)
            loss.backward()
            if step < POISONED:
                opt.step()
                opt.zero_grad()
        before = _snapshot(model, opt)
        with pytest.raises(NonFiniteError, match=f"step {POISONED}: inf or NaN in {what}") as err:
            opt.step()
        if poison == "grad" and cell != "s3-nvme":  # gradients in memory: the parameter is named too
            assert "first in this rank's shard of" in str(err.value)
        assert "precision.on_nonfinite: skip" in str(err.value)
        opt.zero_grad()
        _assert_same(before, _snapshot(model, opt))
    finally:
        opt.engine.close()


def _two_ranks(cfg, poison):
    return _train(cfg, poison, poisoned_rank=1, world=2)


@pytest.mark.parametrize("poison", ["grad", "loss"])
def test_one_poisoned_rank_makes_every_rank_skip(poison, tmp_path, reference):
    """The verdict rides in the norm's all-reduce: rank 0's batch is clean, rank 1's is not,
    both skip the same step and stay equal to the reference."""
    outs = run_ranks(_two_ranks, 2, _config("s3-cpu", str(tmp_path), "skip"), poison, timeout=180, threads=1)
    for out in outs:
        assert out["skipped"] == [s == POISONED for s in range(1, STEPS + 1)]
        _assert_matches(out["params"], reference)


def test_fp16_keeps_its_loss_scaler(tmp_path):
    """fp16: a NaN gradient is an overflow for the loss scaler (skip, scale backed off), not
    an error, whatever on_nonfinite says."""
    cfg = _config("s3-cpu", str(tmp_path), "error")
    cfg["precision"]["dtype"] = "fp16"
    model, opt = infinity.initialize(gpt2(seed=0), config=cfg)
    try:
        ids = batches(1)[0]
        _loss(model, ids, "grad").backward()
        opt.step()
        assert opt.skipped and opt.scaler.skipped_steps == 1 and opt.nonfinite_skipped == 0
    finally:
        opt.engine.close()


def _diverging_job(tmp_path, mode: str) -> list:
    """A train-job config whose first step blows the weights up (lr 1e30): every later loss is inf/NaN."""
    import json

    cfg = {"zero": {"stage": 3}, "precision": {"dtype": "fp32", "on_nonfinite": mode},
           "optimizer": {"lr": 1e30}, "gradient_clipping": 0.0,
           "train": {"model": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 258,
                               "n_positions": 32}, "steps": 3, "seq_len": 16, "micro_batch_size": 2, "save": False}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return ["--config", str(path)]


def test_train_job_stops_with_a_message_or_counts_the_skips(tmp_path, capsys):
    from infinity import train

    assert train.main(_diverging_job(tmp_path, "error")) == 1
    err = capsys.readouterr().err
    assert "infinity.train: error: rank 0: step 2: inf or NaN in the loss" in err and "Traceback" not in err
    assert train.main(_diverging_job(tmp_path, "skip")) == 0
    out = capsys.readouterr().out
    assert "skipped steps" in out and "2 of 3 (inf/NaN loss or gradients" in out
