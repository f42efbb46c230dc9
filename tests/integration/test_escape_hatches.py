"""The escape hatches and their errors, on 2 gloo ranks.

- A stage-3 parameter used outside forward/backward raises ParameterNotAvailableError that
  points to ``infinity.GatheredParameters``; its placeholder never broadcasts in arithmetic,
  and its full shape stays queryable.
- ``GatheredParameters`` refuses what it cannot gather; with ``modifier_rank`` the edits of
  that rank reach every rank and the next training step (master weights updated), stages 1-3.
- Ranks that built different models get an EngineError naming the first difference.
- ``register_external_parameter`` makes a module gather a parameter it does not own in its
  own pre-forward and keep it through its backward, which matters when the parameter is only
  touched inside a custom autograd Function's backward (no op sees it during forward).

All rank-side checks run in one spawn; each check records what happened and the tests below
assert on those records.
"""
import pytest
import torch
import torch.distributed as dist
from _configs import zero_config
from _models import batches, build, loss_of
from torch import nn

import infinity
from infinity._zero._param import info_of
from infinity.errors import UsageError, UsageTypeError
from infinity.testing import run_ranks

WORLD = 2
LR = 2e-3


def _config(stage):
    # persistence_threshold 0: small stage-3 parameters are released too, so these checks see them
    return zero_config(stage, bucket=2000, prefetch={"persistence_threshold": 0}, adam="adamw", lr=LR,
                       weight_decay=0.01, clip=0)


def _outcome(fn):
    """('ok', value) or (exception class name, message); infinity's generic UsageError and
    UsageTypeError are recorded as the builtin they stand for (ValueError, TypeError)."""
    try:
        return ("ok", fn())
    except (UsageError, UsageTypeError) as e:
        builtin = ValueError if isinstance(e, UsageError) else TypeError
        return (builtin.__name__ if type(e) in (UsageError, UsageTypeError) else type(e).__name__, str(e))
    except Exception as e:  # noqa: BLE001 - the record is the point
        return (type(e).__name__, str(e))


def _train_step(model, opt, ids):
    rank = dist.get_rank()
    loss = loss_of(model, "custom", ids.chunk(WORLD)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _gathered_copy(model):
    with infinity.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- placeholder outside forward

# Uses of a released parameter that need its values; each must raise, none may broadcast.
_USES = {
    "ones(1) * p": lambda p: torch.ones(1) * p,
    "p + 1": lambda p: p + 1,
    "ones(5) + p": lambda p: torch.ones(5) + p,
    "p * ones(1)": lambda p: p * torch.ones(1),
    "p.sum()": lambda p: p.sum(),
    "F.linear": lambda p: torch.nn.functional.linear(torch.ones(2, p.shape[1]), p),
    "matmul": lambda p: torch.ones(2, p.shape[0]) @ p,
    "p[0]": lambda p: p[0],
    "p.data": lambda p: p.data,
    "p.detach()": lambda p: p.detach(),
    "p.tolist()": lambda p: p.tolist(),
    "p.clone()": lambda p: p.clone(),
    "x.copy_(p)": lambda p: torch.zeros(p.shape).copy_(p),
    "p.copy_(x)": lambda p: _no_grad(lambda: p.copy_(torch.zeros(p.shape))),
    "p.mul_(2)": lambda p: _no_grad(lambda: p.mul_(2)),
    "torch.add(other=p)": lambda p: torch.add(torch.ones(1), other=p),
}
# Metadata that answers with the full shape while only the shard exists.
_QUERIES = {
    "shape": lambda p: tuple(p.shape),
    "size()": lambda p: tuple(p.size()),
    "size(0)": lambda p: p.size(0),
    "size(-1)": lambda p: p.size(-1),
    "numel()": lambda p: p.numel(),
    "dim()": lambda p: p.dim(),
    "ndim": lambda p: p.ndim,
}


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _placeholder_checks():
    model, opt = infinity.initialize(build("custom"), _config(3))
    _train_step(model, opt, batches(1)[0])
    p = model.proj.weight
    out = {"uses": {name: _outcome(lambda: use(p)) for name, use in _USES.items()},
           "queries": {name: _outcome(lambda: q(p)) for name, q in _QUERIES.items()},
           "state_dict": _outcome(model.state_dict),
           "repr": repr(p)}
    with infinity.GatheredParameters([p]):
        out["gathered"] = {name: tuple(use(p).shape) for name, use in _USES.items()
                           if name in ("ones(1) * p", "p + 1", "p.clone()")}
    # The refused uses left the engine intact: training goes on.
    out["loss_after"] = _train_step(model, opt, batches(1)[0])
    return out


# ---------------------------------------------------------------- GatheredParameters

def _bad_gathered_args():
    model, _ = infinity.initialize(build("custom"), _config(3))
    params = list(model.parameters())
    return {
        "not managed": _outcome(lambda: infinity.GatheredParameters([nn.Parameter(torch.ones(3))])),
        "module": _outcome(lambda: infinity.GatheredParameters(model.proj)),
        "plain tensor": _outcome(lambda: infinity.GatheredParameters([torch.ones(3)])),
        "modifier_rank=world": _outcome(lambda: infinity.GatheredParameters(params, modifier_rank=WORLD)),
        "modifier_rank=-1": _outcome(lambda: infinity.GatheredParameters(params, modifier_rank=-1)),
    }


def _edit(model, value_for_rank):
    with torch.no_grad():
        model.proj.weight.mul_(value_for_rank)
        model.odd.fill_(value_for_rank)


def _modifier_rank_run(stage):
    """Train a step, edit on rank 0 (rank 1's edits must be dropped), train another step."""
    rank = dist.get_rank()
    model, opt = infinity.initialize(build("custom"), _config(stage))
    first, second = batches(2)
    _train_step(model, opt, first)
    with infinity.GatheredParameters(list(model.parameters()), modifier_rank=0):
        _edit(model, 0.5 if rank == 0 else 7.0)
    edited = _gathered_copy(model)
    _train_step(model, opt, second)
    return edited, _gathered_copy(model)


def _reference_modifier_run():
    model = build("custom")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    first, second = batches(2)
    for ids, edit in ((first, True), (second, False)):
        loss_of(model, "custom", ids).backward()
        opt.step()
        opt.zero_grad()
        if edit:
            _edit(model, 0.5)
            edited = {n: p.detach().clone() for n, p in model.named_parameters()}
    return edited, {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- different models

def _different_models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 + dist.get_rank()))
    return _outcome(lambda: infinity.initialize(model, _config(1)))


# ---------------------------------------------------------------- external parameters

class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``owner.gain``, a parameter of
    another module that no op touches during forward."""

    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.owner.gain, None


class _Gain(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * self.gain


class _Consumer(nn.Module):
    """Owns no parameter itself; its forward's backward needs ``owner.gain``."""

    def __init__(self, dim, owner):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.owner = [owner]  # a plain reference, not a submodule
        self.gain_state_at_forward = []

    def forward(self, x):
        info = info_of(self.owner[0].gain)
        self.gain_state_at_forward.append(info.state.name if info else None)
        return self.lin(_ScaleGrad.apply(x, self.owner[0]))


class _Net(nn.Module):
    def __init__(self, register_before_init=False, dim=6):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gainmod = _Gain(dim)
        self.consumer = _Consumer(dim, self.gainmod)
        if register_before_init:
            infinity.register_external_parameter(self.consumer, self.gainmod.gain)

    def forward(self, x):
        return self.consumer(self.gainmod(torch.tanh(self.inp(x)))).pow(2).mean()


EXT_STEPS = 3


def _ext_batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 6, generator=g) for _ in range(EXT_STEPS)]


def _external_runs():
    rank = dist.get_rank()
    out = {}
    for when in ("never", "before init", "after init"):
        torch.manual_seed(0)
        net = _Net(register_before_init=when == "before init")
        model, opt = infinity.initialize(net, _config(3))
        if when == "after init":
            infinity.register_external_parameter(net.consumer, net.gainmod.gain)
        units = [u.module_name for u in opt.engine.states[net.consumer].units]

        def train():
            for x in _ext_batches():
                model(x.chunk(WORLD)[rank]).backward()
                opt.step()
                opt.zero_grad()
            return _gathered_copy(model)

        out[when] = {"units_before_forward": units, "result": _outcome(train),
                     "gain_state_at_forward": net.consumer.gain_state_at_forward}
    torch.manual_seed(0)
    stranger = nn.Parameter(torch.ones(2))
    net = _Net()
    infinity.register_external_parameter(net.consumer, stranger)
    out["stranger before init"] = _outcome(lambda: infinity.initialize(net, _config(3)))
    torch.manual_seed(0)
    net = _Net()
    infinity.initialize(net, _config(3))
    out["stranger after init"] = _outcome(lambda: infinity.register_external_parameter(net.consumer, stranger))
    out["module outside the model"] = _outcome(
        lambda: infinity.register_external_parameter(nn.Linear(2, 2), net.gainmod.gain))
    return out


def _reference_external():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for x in _ext_batches():
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- the spawn

def _on_ranks():
    return {
        "placeholder": _placeholder_checks(),
        "bad gathered": _bad_gathered_args(),
        "modifier": {stage: _modifier_rank_run(stage) for stage in (1, 2, 3)},
        "different models": _different_models(),
        "external": _external_runs(),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_on_ranks, WORLD, timeout=300)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("use", list(_USES))
def test_released_parameter_use_raises_pointing_to_gathered_parameters(results, use):
    for r in results:
        kind, message = r["placeholder"]["uses"][use]
        assert kind == "ParameterNotAvailableError", (use, kind, message)
        assert "proj.weight" in message and "(24, 24)" in message
        assert "infinity.GatheredParameters" in message and "modifier_rank" in message


@pytest.mark.parametrize("query", list(_QUERIES))
def test_released_parameter_keeps_full_shape(results, query):
    full = {"shape": (24, 24), "size()": (24, 24), "size(0)": 24, "size(-1)": 24, "numel()": 576, "dim()": 2,
            "ndim": 2}
    for r in results:
        assert r["placeholder"]["queries"][query] == ("ok", full[query])


def test_released_parameter_repr_and_state_dict(results):
    for r in results:
        assert "PartitionedParameter" in r["placeholder"]["repr"] and "RELEASED" in r["placeholder"]["repr"]
        kind, message = r["placeholder"]["state_dict"]
        assert kind == "ParameterNotAvailableError" and "GatheredParameters" in message


def test_gathered_parameter_works_and_training_continues(results):
    for r in results:
        assert r["placeholder"]["gathered"] == {"ones(1) * p": (24, 24), "p + 1": (24, 24), "p.clone()": (24, 24)}
        assert torch.isfinite(torch.tensor(r["placeholder"]["loss_after"]))


@pytest.mark.parametrize("case,error,words", [
    ("not managed", "ValueError", ["not managed by infinity", "infinity.initialize"]),
    ("module", "TypeError", ["module.parameters()"]),
    ("plain tensor", "TypeError", ["not an nn.Parameter"]),
    ("modifier_rank=world", "ValueError", ["modifier_rank=2", "world size 2"]),
    ("modifier_rank=-1", "ValueError", ["modifier_rank=-1", "world size 2"]),
])
def test_gathered_parameters_rejects_bad_arguments(results, case, error, words):
    for r in results:
        kind, message = r["bad gathered"][case]
        assert kind == error, message
        for w in words:
            assert w in message


@pytest.fixture(scope="module")
def reference_modifier():
    return _reference_modifier_run()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_modifier_rank_edits_reach_every_rank_and_training(results, reference_modifier, stage):
    ref_edited, ref_final = reference_modifier
    for rank, r in enumerate(results):
        edited, final = r["modifier"][stage]
        assert torch.equal(edited["odd"], torch.full((7, 5), 0.5)), f"rank {rank}: rank 0's edit is not visible"
        for name in ref_edited:
            torch.testing.assert_close(edited[name], ref_edited[name], rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {rank} {name} after the edit: {m}")
            # The next step started from the edited values: the master weights took the edit.
            torch.testing.assert_close(final[name], ref_final[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name} after the next step: {m}")


def test_ranks_with_different_models_get_engine_error(results):
    for rank, r in enumerate(results):
        kind, message = r["different models"]
        assert kind == "EngineError"
        assert "different models" in message and "1.weight" in message
        assert "(3, 4)" in message and "(4, 4)" in message, message


def test_external_parameter_needed_in_backward_only_raises_without_registration(results):
    for r in results:
        run = r["external"]["never"]
        assert run["units_before_forward"] == []
        kind, message = run["result"]
        assert kind == "ParameterNotAvailableError" and "gainmod.gain" in message
        assert run["gain_state_at_forward"] == ["RELEASED"]


@pytest.fixture(scope="module")
def reference_external():
    return _reference_external()


@pytest.mark.parametrize("when", ["before init", "after init"])
def test_registered_external_parameter_is_gathered_with_the_module(results, reference_external, when):
    for rank, r in enumerate(results):
        run = r["external"][when]
        assert run["units_before_forward"] == ["gainmod"]
        # gathered in the consumer's pre-forward, not fetched on demand
        assert run["gain_state_at_forward"] == ["AVAILABLE"] * EXT_STEPS
        kind, params = run["result"]
        assert kind == "ok", params
        for name, ref in reference_external.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("case,words", [
    ("stranger before init", ["not part of this model"]),
    ("stranger after init", ["not part of the model", "consumer"]),
    ("module outside the model", ["not a submodule"]),
])
def test_register_external_parameter_rejects_what_is_not_in_the_model(results, case, words):
    for r in results:
        kind, message = r["external"][case]
        assert kind == "EngineError", message
        for w in words:
            assert w in message


def test_register_external_parameter_rejects_non_parameters():
    with pytest.raises(TypeError, match="nn.Module and an nn.Parameter"):
        infinity.register_external_parameter(nn.Linear(2, 2), torch.ones(2))
    with pytest.raises(TypeError, match="nn.Module and an nn.Parameter"):
        infinity.register_external_parameter(nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2)))
