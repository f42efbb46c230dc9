"""Activation checkpointing is exact on every stage and parameter tier: both flavours of
torch.utils.checkpoint, nested checkpoints, and a module shared by two checkpointed blocks
(Note [aborted forward] in infinity/_zero/_engine.py, Note [used again in one backward] in _backward.py)."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity._zero._phase import Phase

LR = 1e-2


class Block(nn.Module):
    """The issue's block: non-reentrant recomputation stops inside ``b``, its last submodule."""

    def __init__(self, shared=None, inner=False):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.shared = shared
        self.inner = Block() if inner else None
        self.mode = None

    def forward(self, x):
        if self.inner is not None:
            x = checkpoint(self.inner, x, use_reentrant=self.mode)  # nested
        if self.shared is not None:
            x = x + torch.tanh(self.shared(x))
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, kind):
        super().__init__()
        shared = nn.Linear(16, 16) if kind == "shared" else None
        self.blocks = nn.ModuleList(Block(shared=shared, inner=kind == "nested") for _ in range(2))
        self.head = nn.Linear(16, 1)
        self.mode = None

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.mode) if self.mode is not None else block(x)
        return self.head(x).pow(2).mean()


def _set_mode(model, mode):
    for m in model.modules():
        if isinstance(m, (Net, Block)):
            m.mode = mode


def _train(model, opt, mode, steps=3, gather=None):
    _set_mode(model, mode)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=mode is True)
    losses = []
    for _ in range(steps):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if gather is None:
        return losses, [p.detach().clone() for p in model.parameters()]
    with gather(list(model.parameters())):
        return losses, [p.detach().clone() for p in model.parameters()]


CELLS = [(1, "none"), (2, "none"), (3, "none"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("kind", ["plain", "nested", "shared"])
@pytest.mark.parametrize("mode", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("stage,param", CELLS)
def test_checkpointing_matches_plain_pytorch(tmp_path, stage, param, mode, kind):
    torch.manual_seed(0)
    net = Net(kind)
    ref = copy.deepcopy(net)
    cfg = {"zero": {"stage": stage, "offload_param": {"device": param, "nvme_path": str(tmp_path)},
                    "prefetch": {"persistence_threshold": 0}},
           "optimizer": {"lr": LR, "weight_decay": 0.01}, "gradient_clipping": 0.0}
    model, opt = infinity.initialize(net, config=cfg)
    losses, final = _train(model, opt, mode, gather=infinity.GatheredParameters)
    ref_losses, ref_final = _train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), mode)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    for (name, _), ours, theirs in zip(ref.named_parameters(), final, ref_final):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)
    if stage == 3:  # nothing stays gathered behind an aborted recomputation
        assert all(u.refs == 0 for u in opt.engine.units)
        assert opt.engine.calls.top() is None and opt.engine.calls.phase is Phase.IDLE  # no frame left behind
    opt.engine.close()


# ---------------------------------------------------------------- the hook protocol's corner cases


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.b = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x, use_b=True):
        y = torch.tanh(x @ self.a)
        return torch.tanh(y @ self.b) if use_b else y


class Partial(nn.Module):
    """A module whose own parameters are used only in part in some steps (one unit, some of
    its parameters without a gradient), or shared by two reentrant checkpoints that use it
    in part and then whole."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.two = _Two()
        self.out = nn.Linear(8, 1)

    def forward(self, x, use_b=True, shared_twice=False):
        h = torch.tanh(self.inp(x))
        if shared_twice:
            h = checkpoint(self.two, h, False, use_reentrant=True)
            h = checkpoint(self.two, h, True, use_reentrant=True)
        else:
            h = self.two(h, use_b)
        return self.out(h).pow(2).mean()


def _steps(model, opt, calls, gather=None):
    for kwargs in calls:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(len(kwargs) + 7))
        model(x, **kwargs).backward()
        opt.step()
        opt.zero_grad()
    if gather is None:
        return [p.detach().clone() for p in model.parameters()]
    with gather(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


PARTIAL = {"partial": [dict(use_b=s % 2 == 0) for s in range(4)], "reentrant shared": [dict(shared_twice=True)] * 3}


@pytest.mark.parametrize("case", list(PARTIAL))
@pytest.mark.parametrize("stage,param", [(2, "none"), (3, "none"), (3, "nvme")])
def test_units_used_in_part_match_plain_pytorch(tmp_path, stage, param, case):
    torch.manual_seed(0)
    net = Partial()
    ref = copy.deepcopy(net)
    cfg = {"zero": {"stage": stage, "offload_param": {"device": param, "nvme_path": str(tmp_path)},
                    "prefetch": {"persistence_threshold": 0}},
           "optimizer": {"lr": LR, "weight_decay": 0.01}, "gradient_clipping": 0.0}
    model, opt = infinity.initialize(net, config=cfg)
    ours = _steps(model, opt, PARTIAL[case], gather=infinity.GatheredParameters)
    theirs = _steps(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), PARTIAL[case])
    for (name, _), a, b in zip(ref.named_parameters(), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    opt.engine.close()


def test_forward_called_inside_an_except_block_is_not_taken_as_aborted():
    torch.manual_seed(0)
    net = Net("plain")
    ref = copy.deepcopy(net)
    model, opt = infinity.initialize(net, config={"zero": {"stage": 3, "prefetch": {"persistence_threshold": 0}},
                                                  "optimizer": {"lr": LR, "weight_decay": 0.0}, "gradient_clipping": 0})
    x = torch.randn(8, 16)
    try:
        raise KeyError("a fast path that is not available")
    except KeyError:
        loss = model(x)  # the fallback runs inside the handler
    loss.backward()
    opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    ref(x).backward()
    ref_opt.step()
    with infinity.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    opt.engine.close()


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.S = nn.Linear(8, 8)
        self.T = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x, second):
        h = self.inp(x)
        h = checkpoint(lambda t: torch.tanh(self.S(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(second(t)), h, use_reentrant=True)
        return self.out(h).pow(2).mean()


def _late_on_one_rank(stage):
    """Rank 0 differentiates S twice in one backward (late gradients), rank 1 does not."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model, opt = infinity.initialize(_Twice(), config={"zero": {"stage": stage}, "gradient_clipping": 0,
                                                       "optimizer": {"lr": LR, "weight_decay": 0.0}})
    rank = dist.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).chunk(2)[rank]
    for _ in range(2):
        model(x, model.S if rank == 0 else model.T).backward()
        opt.step()
        opt.zero_grad()
    with infinity.GatheredParameters(list(model.parameters())):
        out = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    return out


def _late_reference():
    torch.manual_seed(0)
    model = _Twice()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    a, b = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).chunk(2)
    for _ in range(2):
        ((model(a, model.S) + model(b, model.T)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])  # stage 3 also needs the same modules on every rank (README)
def test_late_gradients_on_one_rank_reduce_the_same_buckets_everywhere(stage):
    from infinity.testing import run_ranks

    results = run_ranks(_late_on_one_rank, 2, stage, timeout=180)
    ref = _late_reference()
    for out in results:
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class _SharedInput(nn.Module):
    """Frozen layers all fed one tensor (T5's encoder output feeding every cross-attention)."""

    def __init__(self, n=6, d=16):
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.self_lin = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.cross = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        for m in self.cross:
            m.requires_grad_(False)
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        memory = torch.tanh(self.enc(x))
        for s, c in zip(self.self_lin, self.cross):
            y = torch.tanh(s(y) + c(memory))
        return self.head(y).pow(2).mean()


def test_frozen_units_are_released_after_their_own_backward_call():
    """A unit waits for the input gradients of its own call, not for the total gradient of a
    tensor other modules also read; a forward without a backward leaves no wait behind."""
    from infinity._zero._param import ParamState

    torch.manual_seed(0)
    model, opt = infinity.initialize(_SharedInput(), config={"zero": {"stage": 3, "prefetch": {
        "persistence_threshold": 0, "enabled": False}}, "gradient_clipping": 0})
    engine = opt.engine
    gathered = []
    def probe(module, args, output):
        output.register_hook(lambda g: gathered.append(sum(u.state is ParamState.AVAILABLE for u in engine.units)))

    model.self_lin[0].register_forward_hook(probe)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    model(x, y)  # grad enabled, no backward (an evaluation without no_grad)
    model(x, y).backward()
    opt.step()
    assert gathered[-1] <= 2, gathered  # the first layers' own units, not every cross layer
    opt.engine.close()
