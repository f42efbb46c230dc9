"""Parameters read outside their module's forward (Note [parameters read by autograd Functions]
in infinity/_zero/_function_params.py): a head's weight handed to a hand-written autograd Function
that recomputes in its backward, to TRL's chunked log-probability Function, and read by plain
torch operators, all in the model's forward but never through the head's own forward. Stage 3
on every parameter tier, one and two ranks, trains as plain PyTorch with AdamW does."""
import copy

import pytest
import torch
import torch.nn.functional as F
from _configs import zero_config
from _models import VOCAB, rank_losses
from torch import nn

import infinity
from infinity.testing import run_ranks

LR = 1e-2
STEPS = 4


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` whose backward recomputes the logits from
    the saved weight, as fused-loss kernels do."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        ctx.save_for_backward(hidden, weight, targets)
        return F.cross_entropy(hidden @ weight.t(), targets)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets = ctx.saved_tensors
        probs = torch.softmax(hidden @ weight.t(), dim=-1)
        probs[torch.arange(len(targets)), targets] -= 1
        probs *= grad / len(targets)
        return probs @ weight, probs.t() @ hidden, None


def _trl_loss(hidden, weight, targets):
    from trl.kernels import ChunkedLogProbFunction

    logprobs = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 16, None, 1.0, ())[0]
    return -logprobs.mean()


def _ops_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight), targets)


LOSSES = {"function": lambda h, w, t: FusedLinearCrossEntropy.apply(h, w, t), "trl": _trl_loss, "ops": _ops_loss}


class HeadlessLM(nn.Module):
    """Embedding, two blocks and a head whose weight the loss reads directly (the head's
    forward never runs)."""

    def __init__(self, loss: str, dim=24):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.loss = loss

    def forward(self, ids):
        h = self.embed(ids[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        return LOSSES[self.loss](h.reshape(-1, h.shape[-1]), self.head.weight, ids[:, 1:].reshape(-1))


def _model(loss):
    torch.manual_seed(0)
    return HeadlessLM(loss)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 10), generator=g) for _ in range(STEPS)]


def _reference(loss):
    model = _model(loss)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = rank_losses(model, opt, _batches(), lambda m, ids: m(ids))
    return losses, [p.detach().clone() for p in model.parameters()]


def _ours(loss, tier, nvme):
    model = _model(loss)
    cfg = zero_config(3, param=tier, optim=tier, nvme=nvme, lr=LR, weight_decay=0.01,
                      prefetch={"persistence_threshold": 0})
    model, opt = infinity.initialize(model, config=cfg)
    losses = rank_losses(model, opt, _batches(), lambda m, ids: m(ids))
    opt.wait_step()
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    return losses, params


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_one_rank_trains_as_plain_pytorch(loss, tier, tmp_path):
    if loss == "trl":
        pytest.importorskip("trl")  # installed by scripts/setup_env.sh
    expected, expected_params = _reference(loss)
    got, params = _ours(loss, tier, str(tmp_path))
    assert got == pytest.approx(expected, rel=0, abs=1e-6)
    for p, q in zip(params, expected_params):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _on_ranks(loss, nvme):
    import torch.distributed as dist

    return _ours(loss, "nvme", f"{nvme}/{dist.get_rank()}")


@pytest.mark.parametrize("loss", ["function", "trl"])
def test_two_ranks_train_as_plain_pytorch(loss, tmp_path):
    if loss == "trl":
        pytest.importorskip("trl")
    expected, expected_params = _reference(loss)
    for got, params in run_ranks(_on_ranks, 2, loss, str(tmp_path), timeout=240):
        assert got == pytest.approx(expected, rel=0, abs=1e-5)
        for p, q in zip(params, expected_params):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_gradient_reaches_the_reducer_once(tmp_path):
    """The head's full-shape gradient is reduced once per backward: the global gradient norm
    infinity's step measures is plain autograd's (a head gradient reduced twice, or lost,
    would change it)."""
    model = _model("function")
    reference = copy.deepcopy(model)
    ids = _batches()[0]
    reference(ids).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    cfg = zero_config(3, param="cpu", optim="cpu", nvme=str(tmp_path), lr=LR, clip=1.0e6)
    model, opt = infinity.initialize(model, config=cfg)
    model(ids).backward()
    opt.step()
    assert opt.last_grad_norm == pytest.approx(expected, rel=1e-6)
    assert model.head.weight.shape == reference.head.weight.shape
    opt.engine.close()


def test_function_outside_every_forward_says_where_to_apply_it(tmp_path):
    model, _ = infinity.initialize(_model("function"), config=zero_config(3, param="cpu", nvme=str(tmp_path)))
    hidden = torch.randn(3, 24)
    with pytest.raises(infinity.ParameterNotAvailableError, match="inside the forward of a module"):
        FusedLinearCrossEntropy.apply(hidden, model.head.weight, torch.zeros(3, dtype=torch.long))


class Borrower(nn.Module):
    """A model whose forward hands another model's head weight to the Function."""

    def __init__(self, other: nn.Module):
        super().__init__()
        self.proj = nn.Linear(24, 24)
        self.__dict__["other"] = other  # not a submodule: another engine's model

    def forward(self, hidden, targets):
        return FusedLinearCrossEntropy.apply(self.proj(hidden), self.other.head.weight, targets)


def test_another_models_parameter_is_refused(tmp_path):
    other, _ = infinity.initialize(_model("function"), config=zero_config(3, param="cpu", nvme=str(tmp_path / "a")))
    model, _ = infinity.initialize(Borrower(other), config=zero_config(3, param="cpu", nvme=str(tmp_path / "b")))
    with pytest.raises(infinity.ParameterNotAvailableError, match="FusedLinearCrossEntropy.apply"):
        model(torch.randn(3, 24), torch.zeros(3, dtype=torch.long))
