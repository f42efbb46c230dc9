"""Activation checkpointing is exact on every stage and parameter tier: both flavours of
torch.utils.checkpoint, nested checkpoints, and a module shared by two checkpointed blocks
(Note [aborted forward] and Note [used again in one backward] in infinity/_engine.py)."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity

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
        assert opt.engine._stack == []
    opt.engine.close()
