"""An engine lives as long as its user holds it (Note [parameter side objects] in
infinity/_zero/_param.py, Note [hooks the collector cannot see] in infinity/_zero/_engine.py).

A user who lets go of the model and the optimizer, closed or not, gets back everything the
engine held: the model and its parameters, the engine, its swap files and its hold on the
block cache. Until then nothing is lost: the model holds its engine, so a model whose
optimizer was dropped still runs its forward and backward and gathers its parameters, at
every stage, and a model passed to initialize once is refused a second time.
"""
import gc
import os
import weakref

import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, train_losses

import infinity
from infinity._offload import _memory_plan
from infinity._zero._engine import engine_of
from infinity._zero._param import info_of
from infinity.errors import EngineError

CASES = {  # name -> (stage, parameter tier, optimizer tier, built under infinity.Init)
    "stage1": (1, None, "none", False),
    "stage2-cpu": (2, None, "cpu", False),
    "stage2-nvme": (2, None, "nvme", False),
    "stage3": (3, "none", "none", False),
    "stage3-nvme": (3, "nvme", "nvme", False),
    "stage3-nvme-init": (3, "nvme", "nvme", True),
}


def _train_and_let_go(case, nvme, close):
    stage, param, optim, under_init = CASES[case]
    cfg = zero_config(stage, param=param if stage == 3 else None, optim=optim, nvme=nvme, chunk=2048,
                      host_allocator="release")
    if under_init:
        with infinity.Init(config=cfg):
            model = build("gpt2")
    else:
        model = build("gpt2")
    model, opt = infinity.initialize(model, cfg)
    train_losses(model, opt, "gpt2", 2)
    opt.wait_step()  # the overlapped step's thread holds the engine until it lands
    if close:
        opt.engine.close()
    return weakref.ref(model), weakref.ref(opt.engine)


def _swap_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


@pytest.mark.parametrize("close", [False, True], ids=["unclosed", "closed"])
@pytest.mark.parametrize("case", list(CASES))
def test_letting_go_frees_the_engine(case, close, tmp_path):
    gc.collect()
    users = _memory_plan._BLOCK_USERS[0]
    model, engine = _train_and_let_go(case, str(tmp_path), close)
    gc.collect()
    assert model() is None, "the model outlived every reference of the user's"
    assert engine() is None, "the engine outlived every reference of the user's"
    assert _swap_files(tmp_path) == [], "a collected engine left swap files behind"
    assert _memory_plan._BLOCK_USERS[0] == users, "a collected engine kept its hold on the block cache"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_model_holds_its_engine(stage, tmp_path):
    """The optimizer dropped, the model still finds its engine (GatheredParameters, a forward
    and backward through it), and the engine goes only with the model."""
    cfg = zero_config(stage, param="nvme" if stage == 3 else None, optim="nvme", nvme=str(tmp_path), chunk=2048)
    model, opt = infinity.initialize(build("gpt2"), cfg)
    train_losses(model, opt, "gpt2", 1)
    opt.wait_step()
    engine = weakref.ref(opt.engine)
    del opt
    gc.collect()
    assert engine() is not None and engine_of(model) is engine()
    with infinity.GatheredParameters(list(model.parameters())):
        want = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(model, "gpt2", batches(1)[0])
    loss.backward()
    assert torch.isfinite(loss)
    with infinity.GatheredParameters(list(model.parameters())):
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)  # no step: nothing moved
    del model, loss, p  # a parameter held keeps its engine: its side object reaches it
    gc.collect()
    assert engine() is None
    assert _swap_files(tmp_path) == []


@pytest.mark.parametrize("stage", [1, 3])
def test_initialize_twice_refused_after_close(stage, tmp_path):
    """Closed and its optimizer dropped, the model may not be initialized again."""
    cfg = zero_config(stage, param="nvme" if stage == 3 else None, optim="nvme", nvme=str(tmp_path), chunk=2048)
    model, opt = infinity.initialize(build("gpt2"), cfg)
    opt.engine.close()
    del opt
    gc.collect()
    with pytest.raises(EngineError, match="already passed to infinity.initialize"):
        infinity.initialize(model, cfg)


def test_copies_of_managed_parameters_are_not_managed(tmp_path):
    """The side object stays with its parameter: a deep copy or a pickle of a gathered
    parameter is a plain tensor of the same values."""
    import copy
    import io

    cfg = zero_config(3, param="cpu", optim="none")
    model, opt = infinity.initialize(build("gpt2"), cfg)
    p = model.transformer.wte.weight
    with infinity.GatheredParameters([p]):
        want = p.detach().clone()
        copied = copy.deepcopy(p)
        buf = io.BytesIO()
        torch.save(p, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for q in (copied, loaded):
        assert info_of(q) is None
        torch.testing.assert_close(q.detach(), want, rtol=0, atol=0)
        assert torch.equal(q * 2, want * 2)  # ops run on it as on any tensor
    opt.engine.close()


@pytest.mark.parametrize("optim", ["nvme", "cpu"])
def test_close_frees_the_buffers_of_a_kept_model(optim, tmp_path):
    """Note [closed engines] in _engine.py: a stage-3 model kept after close keeps none of the engine's buffers."""
    from infinity._offload._memory_plan import host_account

    cfg = zero_config(3, param="nvme", optim=optim, nvme=str(tmp_path), chunk=2048)
    gc.collect()
    before = host_account()["mapped"]
    model, opt = infinity.initialize(build("gpt2"), cfg)
    train_losses(model, opt, "gpt2", 2)
    opt.wait_step()
    during = host_account()["mapped"]
    assert during != before
    master = -(-opt.store.master.numel() * 4 // 4096) * 4096 if optim == "cpu" else 0
    opt.engine.close()
    del opt
    gc.collect()
    after = host_account()["mapped"]
    if optim == "nvme":
        assert after == before, "the closed engine's buffers outlived close"
    else:  # the master weights in host memory are the parameters' own shards: they alone stay
        kept = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        assert kept == {"optimizer_states": master}, kept
    assert model.transformer.wte.weight.shape == (96, 32)


def test_a_copy_of_the_model_has_no_engine(tmp_path):
    """Stage 1 keeps parameters whole: a deep copy of the model is a plain model (its engine
    stays with the original), and the original still trains."""
    import copy

    model, opt = infinity.initialize(build("gpt2"), zero_config(1, optim="none"))
    twin = copy.deepcopy(model)
    assert engine_of(twin) is None and engine_of(model) is opt.engine
    train_losses(model, opt, "gpt2", 1)
    opt.engine.close()
