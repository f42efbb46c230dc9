"""The optimizer's semantics are torch.optim.AdamW's: parameter groups with their own
hyperparameters (and an LR scheduler stepping them), parameters without a gradient left
untouched with their own step count, no partial state dicts, and GatheredParameters edits
without a modifier_rank discarded on every stage and tier."""
import copy

import pytest
import torch
from _configs import zero_config
from _logs import kept_logs
from torch import nn

import infinity
from infinity.testing import run_ranks

LR = 1e-2


class Net(nn.Module):
    """A layer used only when asked (``use``): a step without it gives it no gradient."""

    def __init__(self, dim=16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.skip = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x, use=True):
        x = torch.tanh(self.a(x))
        if use:
            x = x + self.skip(x)
        return self.head(self.norm(x)).pow(2).mean()


def _groups(model):
    """HF Trainer's split: no decay for biases and norm weights; here also another lr."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 3 * LR, "betas": (0.8, 0.99)}]


def _config(stage, param="none", optim="none", path=None, dtype="fp32", clip=0.0):
    return zero_config(stage, param=param, optim=optim, nvme=path, prefetch={"persistence_threshold": 0}, dtype=dtype,
                       adam="adamw", lr=LR, weight_decay=0.1, clip=clip)


def _schedule(step):
    return 1.0 / (1 + step)


USE = [True, False, False, True, True]  # `skip` gets no gradient in steps 1 and 2


def _steps(model, opt, steps, clip=0.0):
    """The same schedule, data and skipped steps for ours and the reference; the losses."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        loss = model(x, USE[step])
        loss.backward()
        if clip:  # the reference clips by hand; infinity clips inside step() (gradient_clipping)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _train(cfg, steps=5):
    torch.manual_seed(0)
    net = Net()
    model, opt = infinity.initialize(net, config=cfg, param_groups=_groups(net))
    losses = _steps(model, opt, steps)
    with infinity.GatheredParameters(list(model.parameters())):
        final = [p.detach().clone().float() for p in model.parameters()]
    counts = [opt.step_count(p) for p in model.parameters()]
    lrs = [g["lr"] for g in opt.param_groups]
    opt.engine.close()
    return losses, final, counts, lrs


def _reference(steps=5, clip=0.0):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=0.1)
    losses = _steps(model, opt, steps, clip)
    counts = [int(opt.state[p]["step"]) if p in opt.state else 0 for p in model.parameters()]
    return losses, [p.detach().clone() for p in model.parameters()], counts, [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("stage,param,optim", [
    (1, "none", "none"), (2, "none", "cpu"), (2, "none", "nvme"),
    (3, "none", "none"), (3, "cpu", "cpu"), (3, "nvme", "none"), (3, "nvme", "nvme"), (3, "cpu", "nvme"),
])
def test_groups_scheduler_and_skipped_parameters_match_adamw(tmp_path, stage, param, optim):
    losses, final, counts, lrs = _train(_config(stage, param, optim, str(tmp_path)))
    ref_losses, ref_final, ref_counts, ref_lrs = _reference()
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    for ours, ref in zip(final, ref_final):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
    assert counts == ref_counts  # `skip` took 3 steps, the rest 5
    assert sorted(set(counts)) == [3, 5]
    assert lrs == pytest.approx(ref_lrs)


def test_clipping_with_groups_matches_adamw(tmp_path):
    losses, final, _, _ = _train(_config(3, "nvme", "nvme", str(tmp_path), clip=0.05))
    ref_losses, ref_final, _, _ = _reference(clip=0.05)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    for ours, ref in zip(final, ref_final):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_bf16_fused_output_leaves_skipped_parameters_as_they_were(tmp_path):
    """bf16 with the native Adam writes the fresh bf16 values inside its pass; what it skips
    (a parameter without a gradient) must still come out as its unchanged value."""
    torch.manual_seed(0)
    net = Net()
    model, opt = infinity.initialize(net, config=_config(3, "nvme", "nvme", str(tmp_path), dtype="bf16"))
    x = torch.randn(8, 16).bfloat16()
    seen = []
    for step in range(3):
        model(x, use=step == 0).backward()
        opt.step()
        opt.zero_grad()
        with infinity.GatheredParameters([model.skip.weight, model.a.weight]):
            seen.append((model.skip.weight.detach().clone(), model.a.weight.detach().clone()))
    assert opt.step_count(model.skip.weight) == 1 and opt.step_count(model.a.weight) == 3
    assert torch.equal(seen[0][0], seen[1][0]) and torch.equal(seen[1][0], seen[2][0])
    assert not torch.equal(seen[0][1], seen[2][1])
    opt.engine.close()


# ---------------------------------------------------------------- a gradient on one rank only


def _one_rank_uses(stage, param, path):
    """Rank 0 runs `skip`, rank 1 does not: a gradient on any rank updates it on all. In
    stage 3 every rank must gather the same parameters in the same order (all-gathers are
    collectives), so the parameters of a module that runs on some ranks only are fetched by
    a parent that runs on all (as for the experts of a mixture-of-experts block)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    net = Net()
    if stage == 3:
        for p in net.skip.parameters():
            infinity.register_external_parameter(net, p)
    model, opt = infinity.initialize(net, config=_config(stage, param, "none", path), param_groups=_groups(net))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g) for _ in range(3)]
    rank = dist.get_rank()
    for x in xs:
        model(x.chunk(2)[rank], use=rank == 0).backward()
        opt.step()
        opt.zero_grad()
    with infinity.GatheredParameters(list(model.parameters())):
        final = [p.detach().clone() for p in model.parameters()]
    counts = [opt.step_count(p) for p in model.parameters()]
    opt.engine.close()
    return final, counts


def _one_rank_reference():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for x in [torch.randn(8, 16, generator=g) for _ in range(3)]:
        a, b = x.chunk(2)
        ((model(a, use=True) + model(b, use=False)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage,param", [(2, "none"), (3, "nvme")])
def test_gradient_on_one_rank_updates_on_all(tmp_path, stage, param):
    results = run_ranks(_one_rank_uses, 2, stage, param, str(tmp_path), timeout=240)
    ref = _one_rank_reference()
    for final, counts in results:
        assert counts == [3] * len(counts)
        for ours, r in zip(final, ref):
            torch.testing.assert_close(ours, r, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- refused with a clear message


def _refused(groups_of, match):
    torch.manual_seed(0)
    net = Net()
    with pytest.raises(ValueError, match=match):
        infinity.initialize(net, config=_config(3), param_groups=groups_of(net))
    model, opt = infinity.initialize(net, config=_config(3))  # the refused call left nothing behind
    opt.engine.close()


def test_parameter_in_no_group_is_named():
    _refused(lambda m: [{"params": [m.a.weight, m.a.bias]}], r"trainable parameters in no parameter group: skip.weight")


def test_parameter_in_two_groups_is_named():
    _refused(lambda m: [{"params": list(m.parameters())}, {"params": [m.head.bias]}],
             r"'head.bias' is in param_groups\[0\] and param_groups\[1\]")


def test_foreign_tensor_in_a_group_is_refused():
    _refused(lambda m: [{"params": list(m.parameters()) + [nn.Parameter(torch.zeros(3))]}],
             r"not a parameter of this model")


def test_unsupported_group_option_is_refused():
    _refused(lambda m: [{"params": list(m.parameters()), "amsgrad": True}], r"amsgrad=True")


def test_frozen_parameters_may_be_left_out_of_groups(tmp_path):
    torch.manual_seed(0)
    net = Net()
    net.a.requires_grad_(False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    model, opt = infinity.initialize(net, config=_config(3, "nvme", "nvme", str(tmp_path)),
                                     param_groups=[{"params": trainable}])
    with infinity.GatheredParameters([model.a.weight]):
        before = model.a.weight.detach().clone()
    model(torch.randn(4, 16)).backward()
    opt.step()
    with infinity.GatheredParameters([model.a.weight]):
        assert torch.equal(model.a.weight, before)
    assert opt.step_count(model.a.weight) == 0 and opt.step_count(model.head.weight) == 1
    opt.engine.close()


def test_add_param_group_after_initialize_says_why():
    net = Net()
    model, opt = infinity.initialize(net, config=_config(3))
    with pytest.raises(RuntimeError, match=r"param_groups=\[\.\.\.\]"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    opt.engine.close()


def test_state_dicts_refuse_instead_of_returning_part_of_the_state():
    net = Net()
    model, opt = infinity.initialize(net, config=_config(3))
    model(torch.randn(4, 16)).backward()
    opt.step()
    for call in (opt.state_dict, lambda: opt.load_state_dict({"state": {}, "param_groups": []})):
        with pytest.raises(NotImplementedError, match=r"infinity\.save_checkpoint\(.*infinity\.load_checkpoint\("):
            call()  # names what saves and resumes every state instead
    with pytest.raises(infinity.ParameterNotAvailableError, match=r"GatheredParameters"):
        model.state_dict()
    with infinity.GatheredParameters(list(model.parameters())):
        assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    opt.engine.close()


# ---------------------------------------------------------------- GatheredParameters edits


@pytest.mark.parametrize("stage,param,optim,dtype", [
    (1, "none", "none", "fp32"), (2, "none", "nvme", "bf16"),
    (3, "none", "none", "fp32"),  # one rank, fp32: the parameters are views of the master weights
    (3, "cpu", "none", "bf16"),  # views of the resident bf16 shards
    (3, "nvme", "nvme", "fp32"),
])
def test_edits_without_modifier_rank_are_discarded(tmp_path, stage, param, optim, dtype):
    torch.manual_seed(0)
    cfg = _config(stage, param, optim, str(tmp_path), dtype=dtype)
    cfg["zero"]["prefetch"]["persistence_threshold"] = 10**6  # small units stay gathered: edits could linger
    model, opt = infinity.initialize(Net(), config=cfg)
    x = torch.randn(4, 16).to(model.a.weight.dtype)
    with torch.no_grad():
        loss_before = model(x).item()
    with kept_logs() as handler:
        with infinity.GatheredParameters(list(model.parameters())):
            with torch.no_grad():
                model.a.weight.data.mul_(3.0)  # through .data: no version counter sees it
                model.head.bias.add_(1.0)
    with torch.no_grad():
        assert model(x).item() == loss_before
    assert any("a.weight" in m and "head.bias" in m and "modifier_rank" in m for m in handler.messages)
    with infinity.GatheredParameters(list(model.parameters()), modifier_rank=0):
        with torch.no_grad():
            model.head.bias.add_(1.0)  # kept
    with torch.no_grad():
        assert model(x).item() != loss_before
    opt.engine.close()


def test_reading_without_modifier_rank_warns_nothing():
    model, opt = infinity.initialize(Net(), config=_config(3))
    with kept_logs() as handler:
        with infinity.GatheredParameters(list(model.parameters())):
            copy.deepcopy([p.detach() for p in model.parameters()])
    assert handler.messages == []
    opt.engine.close()


@pytest.mark.parametrize("stage,param", [(3, "none"), (3, "cpu"), (1, "none")])
def test_values_moved_without_modifier_rank_are_detected_and_discarded(tmp_path, stage, param):
    """Swapping two rows changes no value's bits, only their positions: still an edit."""
    torch.manual_seed(0)
    model, opt = infinity.initialize(Net(), config=_config(stage, param, "none", str(tmp_path)))
    with infinity.GatheredParameters([model.a.weight]):
        before = model.a.weight.detach().clone()
        with torch.no_grad():
            model.a.weight.data[[0, 1]] = model.a.weight.data[[1, 0]]
    with infinity.GatheredParameters([model.a.weight]):
        assert torch.equal(model.a.weight, before)
    opt.engine.close()


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x, expert):
        return self.head(self.experts[expert](torch.tanh(self.inp(x)))).pow(2).mean()


def _route_by_rank():
    import torch.distributed as dist

    torch.manual_seed(0)
    model, opt = infinity.initialize(_Experts(), config=_config(3))
    try:
        model(torch.randn(4, 16), expert=dist.get_rank())  # same-size units: the gathers pair up wrongly
    except infinity.InfinityError as e:
        return type(e).__name__, str(e)
    finally:
        opt.engine.close()
    return "ok", ""


def test_stage3_ranks_that_gather_different_units_are_stopped():
    """Note [same gathers on every rank] in _same_gathers.py: identical experts routed differently per rank would
    mix shards silently; the forward raises instead, naming both modules and the remedy."""
    for kind, message in run_ranks(_route_by_rank, 2, timeout=120):
        assert kind == "EngineError"
        assert "experts.0" in message and "experts.1" in message and "register_external_parameter" in message
