"""Every ZeRO stage trains exactly like plain PyTorch on the same global batch.

World sizes 1, 2 and 3 (gloo ranks); a Hugging Face GPT-2 with tied embeddings and a custom
model with a shared module, a tied weight, a parameter its parent uses and a parameter a
submodule returns. fp32 is compared to plain AdamW within 1e-5; bf16 to plain PyTorch bf16
training with fp32 master weights (the same math) within the bf16 tolerance below.
"""
import copy
import itertools

import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, train_losses

import infinity
from infinity.testing import run_ranks

STEPS = 6
LR = 2e-3
CLIP = 0.5
KINDS = ["gpt2", "custom"]
STAGES = [1, 2, 3]
DTYPES = ["fp32", "bf16"]
# bf16: per-step losses within 2e-2 relative; parameters within 3e-2 absolute (a few bf16 ulps
# of weights of magnitude ~1, accumulated over the steps).
BF16_LOSS_RTOL, BF16_PARAM_ATOL = 2e-2, 3e-2


def _config(stage, dtype):
    return zero_config(stage, bucket=2000, dtype=dtype, adam="adamw", lr=LR, weight_decay=0.01, clip=CLIP)


def _train_on_ranks(combos):
    """On each rank: train every (kind, stage, dtype) combination; return losses and params."""
    out = {}
    for kind, stage, dtype in combos:
        model, opt = infinity.initialize(build(kind), _config(stage, dtype))
        losses = train_losses(model, opt, kind, STEPS)
        with infinity.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        out[(kind, stage, dtype)] = (losses, params)
    return out


def _reference(kind, dtype):
    """Plain PyTorch: fp32 AdamW, or bf16 compute with fp32 master weights."""
    model = build(kind)
    master = copy.deepcopy(model)
    if dtype == "bf16":
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids in batches(STEPS):
        loss = loss_of(model, kind, ids)
        loss.backward()
        for p, m in zip(model.parameters(), master.parameters()):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                p.copy_(m)
        losses.append(loss.item())
    return losses, {n: p.detach().float() for n, p in model.named_parameters()}


_COMBOS = list(itertools.product(KINDS, STAGES, DTYPES))


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def trained(request):
    return request.param, run_ranks(_train_on_ranks, request.param, _COMBOS, timeout=600)[0]


@pytest.fixture(scope="module")
def references():
    return {(k, d): _reference(k, d) for k in KINDS for d in DTYPES}


@pytest.mark.parametrize("kind,stage,dtype", _COMBOS)
def test_matches_plain_pytorch(trained, references, kind, stage, dtype):
    world, results = trained
    losses, params = results[(kind, stage, dtype)]
    ref_losses, ref_params = references[(kind, dtype)]
    assert params.keys() == ref_params.keys()
    if dtype == "fp32":
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    else:
        assert losses == pytest.approx(ref_losses, rel=BF16_LOSS_RTOL)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=BF16_PARAM_ATOL, msg=lambda m: f"{name}: {m}")
    assert losses[-2] < losses[0]  # it learns: batches repeat with period 2
