"""Memory-centric tiling: TiledLinear / TiledEmbedding equal the untiled operators, zero.tiling
replaces large layers at initialize, a model whose largest layer exceeds device_memory_limit is
refused without tiling and trains exactly like plain PyTorch with it.

Tolerances (Note [tiled numerics] in infinity/_zero/_tiling.py): the forward with in_splits == 1 is
bitwise; a sum of partial products (in_splits > 1 forward, the input gradient with
out_splits > 1) differs from the one-GEMM result by fp32 rounding of the partial sums:
compared at rtol 1e-5, atol 1e-6 on O(1) data. After a few AdamW steps parameters are compared
at atol 1e-4 (1% of one step at lr 1e-2): Adam divides a gradient by its own running magnitude,
so for an element whose gradient is near zero a rounding difference in the gradient becomes a
visible difference in the update.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from _configs import zero_config
from _models import rank_losses
from torch import nn

import infinity
from infinity._zero._engine import engine_of
from infinity.errors import OutOfMemory, UsageError
from infinity.tiling import TiledEmbedding, TiledLinear, linear_splits

SPLITS = [(1, 1), (1, 4), (1, 3), (3, 1), (4, 1), (2, 3), (5, 7)]  # (in, out); 37 and 50 divide by neither 3, 4, 7
RTOL, ATOL = 1e-5, 1e-6


def _tile_grads(t: TiledLinear):
    w = torch.cat([torch.cat([t.tile(o, i).weight.grad for i in range(t.in_splits)], 1) for o in range(t.out_splits)])
    b = torch.cat([t.tile(o, 0).bias.grad for o in range(t.out_splits)])
    return w, b


@pytest.mark.parametrize("in_splits,out_splits", SPLITS)
def test_tiled_linear_parity(in_splits, out_splits):
    torch.manual_seed(0)
    lin = nn.Linear(37, 50)
    tiled = TiledLinear.from_linear(lin, in_splits=in_splits, out_splits=out_splits)
    assert len(tiled.tiles) == in_splits * out_splits
    x = torch.randn(4, 6, 37, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = lin(x), tiled(x2)
    if in_splits == 1:
        assert torch.equal(y, y2)  # output columns are independent dot products
    torch.testing.assert_close(y2, y, rtol=RTOL, atol=ATOL)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=RTOL, atol=ATOL)
    w_grad, b_grad = _tile_grads(tiled)
    torch.testing.assert_close(w_grad, lin.weight.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(b_grad, lin.bias.grad, rtol=RTOL, atol=ATOL)


def test_tiled_linear_without_bias_and_uneven_bounds():
    t = TiledLinear(10, 7, bias=False, in_splits=3, out_splits=2)
    assert [tuple(m.weight.shape) for m in t.tiles] == [(4, 4), (4, 3), (4, 3), (3, 4), (3, 3), (3, 3)]
    assert all(m.bias is None for m in t.tiles)
    x = torch.randn(5, 10)
    torch.testing.assert_close(t(x), F.linear(x, t.full_weight()), rtol=RTOL, atol=ATOL)


def test_tiled_linear_state_dict_reads_untiled():
    torch.manual_seed(0)
    lin = nn.Linear(11, 9)
    tiled = TiledLinear.from_linear(lin, in_splits=2, out_splits=3)
    sd = tiled.state_dict()
    assert list(sd) == ["weight", "bias"]
    assert torch.equal(sd["weight"], lin.weight) and torch.equal(sd["bias"], lin.bias)
    other = TiledLinear(11, 9, in_splits=3, out_splits=2)  # another tiling loads the same state dict
    other.load_state_dict(sd)
    assert torch.equal(other.full_weight(), lin.weight) and torch.equal(other.full_bias(), lin.bias)
    plain = nn.Linear(11, 9)
    plain.load_state_dict(other.state_dict())
    assert torch.equal(plain.weight, lin.weight)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        other.load_state_dict({"weight": torch.zeros(9, 10), "bias": torch.zeros(9)})
    back = other.to_linear()
    assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)


def test_nested_state_dict_has_original_names():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tiled = copy.deepcopy(model)
    tiled[0] = TiledLinear.from_linear(model[0], out_splits=4)
    tiled[2] = TiledLinear.from_linear(model[2], in_splits=4)
    assert {k: tuple(v.shape) for k, v in tiled.state_dict().items()} == names
    for k, v in tiled.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_bad_splits_are_refused():
    with pytest.raises(UsageError, match="out_splits=9 exceeds out_features=8"):
        TiledLinear(4, 8, out_splits=9)
    with pytest.raises(UsageError, match="in_splits must be a positive int"):
        TiledLinear(4, 8, in_splits=0)
    with pytest.raises(UsageError, match="expected 4"):
        TiledLinear(4, 8, in_splits=2)(torch.randn(2, 5))


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_tiled_embedding_bitwise(splits):
    torch.manual_seed(0)
    emb = nn.Embedding(23, 6, padding_idx=4)
    tiled = TiledEmbedding.from_embedding(emb, splits)
    ids = torch.randint(0, 23, (5, 9))
    ids[0, :3] = 4
    y, y2 = emb(ids), tiled(ids)
    assert torch.equal(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(torch.cat([t.weight.grad for t in tiled.tiles]), emb.weight.grad)
    assert list(tiled.state_dict()) == ["weight"] and torch.equal(tiled.state_dict()["weight"], emb.weight)
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 23\)"):
        tiled(torch.tensor([3, 23]))


def test_linear_splits_respect_the_tile_limit():
    for in_f, out_f, bias, cap in [(1024, 4096, True, 100_000), (4096, 1024, False, 50_000), (50, 30, True, 20),
                                   (7, 1000, True, 8)]:
        i, o = linear_splits(in_f, out_f, bias, cap)
        t = TiledLinear(in_f, out_f, bias=bias, in_splits=i, out_splits=o, device="meta")
        assert max(sum(p.numel() for p in m.parameters()) for m in t.tiles) <= cap, (in_f, out_f, cap)


# ---------------------------------------------------------------------------------------------
# zero.tiling in the engine

VOCAB, HIDDEN = 64, 32
LR = 1e-2


class OneBlock(nn.Module):
    """A one-layer GPT-style MLP block with an untied embedding and head."""

    def __init__(self, hidden=HIDDEN, vocab=VOCAB, tie=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 10), generator=g) for _ in range(steps)]


def _plain_loss(model, ids):
    return model(ids)


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _steps(model, opt, batches, loss_of) -> list:
    losses = []
    for ids in batches:
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference_on(model, batches, loss_of):
    """Plain PyTorch AdamW on a copy: (losses, state dict)."""
    model = copy.deepcopy(model)
    losses = _steps(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), batches, loss_of)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train_on(model, cfg, batches, loss_of):
    """infinity: (model, losses, untiled state dict, device budget peak, peak gathered elements)."""
    model, opt = infinity.initialize(model, cfg)
    losses = _steps(model, opt, batches, loss_of)
    budget = engine_of(model).device_budget
    peak = budget.stats().peak
    live = engine_of(model).peak_live_elems
    budget.set_limit(None)  # reading every parameter at once is not part of training
    with infinity.GatheredParameters(list(model.parameters())):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
    return model, losses, sd, peak, live


def _reference(model, steps):
    return _reference_on(model, _batches(steps), _plain_loss)


def _train(model, cfg, steps):
    return _train_on(model, cfg, _batches(steps), _plain_loss)


def _tiling(max_tile, min_params=0):
    return {"enabled": True, "min_params": min_params, "max_tile_params": max_tile}


NO_PERSIST = {"persistence_threshold": 0}  # tiles this small would otherwise stay gathered (refused by the config)


def test_zero_tiling_replaces_covered_layers_only():
    torch.manual_seed(0)
    model = OneBlock()
    cfg = zero_config(3, lr=LR, weight_decay=0.01, prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=500))
    model, _ = infinity.initialize(model, cfg)
    assert isinstance(model.up, TiledLinear) and isinstance(model.down, TiledLinear)
    assert isinstance(model.emb, TiledEmbedding) and isinstance(model.head, TiledLinear)
    assert isinstance(model.norm, nn.LayerNorm)
    engine = engine_of(model)
    assert max(u.full_numel for u in engine.units) <= 1000
    assert (model.up.in_splits, model.up.out_splits) == (1, 5)  # 128 rows of 33 parameters, 30 rows a tile


def test_tiles_that_would_stay_gathered_are_refused():
    with pytest.raises(infinity.ConfigError, match="below zero.prefetch.persistence_threshold"):
        infinity.Config.from_dict(zero_config(3, tiling=_tiling(1000)))


def test_tied_embedding_and_head_stay_tied():
    torch.manual_seed(0)
    base = OneBlock(tie=True)
    ref_losses, ref_sd = _reference(base, 4)
    cfg = zero_config(3, lr=LR, weight_decay=0.01, prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=500))
    model, losses, sd, _, _ = _train(copy.deepcopy(base), cfg, 4)
    assert isinstance(model.emb, TiledEmbedding) and isinstance(model.head, TiledLinear)
    assert all(h.weight is e.weight for h, e in zip(model.head.tiles, model.emb.tiles))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sd["head.weight"], sd["emb.weight"], rtol=0, atol=0)
    torch.testing.assert_close(sd["emb.weight"], ref_sd["emb.weight"], rtol=1e-4, atol=1e-4)
    with pytest.raises(AttributeError, match="holds its weight as tiles"):
        model.head.weight


class SharedWithOther(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.other = nn.Linear(32, 64)
        self.other.weight = self.up.weight  # two linears sharing a weight: not tiled alike

    def forward(self, x):
        return self.up(x) + self.other(x)


def test_other_sharing_is_refused():
    with pytest.raises(UsageError, match="shared with another module"):
        infinity.initialize(SharedWithOther(), zero_config(3, prefetch=NO_PERSIST, tiling=_tiling(1000)))


def test_largest_layer_over_the_limit_fails_without_tiling_and_trains_exactly_with_it(tmp_path):
    """4·h·4h bytes of MLP weight (16 KiB at h=32) against a 40 KB budget: untiled, the up
    projection's working memory (weight, gradient, one unit ahead: 3 x 16.9 KB) does not fit."""
    torch.manual_seed(0)
    base = OneBlock()
    ref_losses, ref_sd = _reference(base, 5)
    # optimizer on NVMe: with it in host memory, fp32 parameters would be views of the master weights (Note
    # [parameters from the master] in _placement.py), gathered without new memory to charge
    common = dict(param="nvme", optim="nvme", nvme=str(tmp_path), lr=LR, weight_decay=0.01,
                  prefetch={"persistence_threshold": 0})
    limit = 40_000
    with pytest.raises(OutOfMemory, match=r"the largest operator, (up|down) .*enable zero.tiling with max_tile_params "
                                          r"at most 3333"):
        infinity.initialize(copy.deepcopy(base), {**zero_config(3, **common), "device_memory_limit": limit})
    cfg = {**zero_config(3, tiling=_tiling(3333), **common), "device_memory_limit": limit}
    model, losses, sd, peak, _ = _train(copy.deepcopy(base), cfg, 5)
    engine = engine_of(model)
    assert 0 < peak <= limit
    assert max(u.full_numel for u in engine.units) <= 3333
    assert engine.param_store.pool.numel <= 3333  # staging buffers sized by the largest tile
    assert set(sd) == set(ref_sd)  # tiles read as the untiled parameters
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    engine.close()


def test_tiles_are_gathered_one_at_a_time():
    """Prefetch off, nothing persistent: at most one tile (the largest unit) is gathered at any
    moment, far less than the whole layer."""
    torch.manual_seed(0)
    cfg = zero_config(3, lr=LR, prefetch={"enabled": False, "persistence_threshold": 0},
                      tiling=_tiling(1000, min_params=500))
    torch.manual_seed(0)
    model, opt = infinity.initialize(OneBlock(), cfg)
    engine = engine_of(model)
    reduced = []  # (unit, gathered elements) each time a unit's gradient goes to the reducer
    add = engine.reducer.add
    engine.reducer.add = lambda unit: (reduced.append((unit.module_name, engine.live_elems)), add(unit))[1]
    for ids in _batches(2):
        model(ids).backward()
        opt.step()
        opt.zero_grad()
    biggest = max(u.full_numel for u in engine.units)
    assert engine.peak_live_elems == biggest
    assert biggest < 4 * HIDDEN * HIDDEN / 4
    up_tiles = [name for name, _ in reduced if name.startswith("up.tiles.")]
    assert sorted(set(up_tiles)) == [f"up.tiles.{k}" for k in range(5)] and len(up_tiles) == 10  # 5 tiles x 2 steps
    # each tile's gradient is handed over while at most that tile is gathered, not once the whole layer is done
    assert all(live <= biggest for _, live in reduced)


def test_param_groups_follow_their_tiles():
    torch.manual_seed(0)
    base = OneBlock()
    no_decay = [base.up.bias, base.down.bias, base.norm.weight, base.norm.bias]
    decay = [p for p in base.parameters() if all(p is not q for q in no_decay)]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    model, opt = infinity.initialize(base, zero_config(3, lr=LR, prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=500)),
                                     param_groups=groups)
    tile_biases = [t.bias for t in model.up.tiles]
    assert len(tile_biases) == 5 and all(b is not None for b in tile_biases)


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama and infinity.Init


def _hf_reference(model, batches):
    return _reference_on(model, batches, _hf_loss)


def _hf_train(model, cfg, batches):
    return _train_on(model, cfg, batches, _hf_loss)[:3]


@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
def test_hf_llama_with_tiling_matches_plain_pytorch(mode):
    from _hf_models import llama
    from _models import batches

    base = llama(mode)
    data = batches(4)
    ref_losses, ref_sd = _hf_reference(base, data)
    cfg = zero_config(3, lr=LR, weight_decay=0.01, prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=1000))
    model, losses, sd = _hf_train(copy.deepcopy(base), cfg, data)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, TiledLinear) and isinstance(layer.self_attn.q_proj, TiledLinear)
    assert isinstance(model.model.embed_tokens, TiledEmbedding) and isinstance(model.lm_head, TiledLinear)
    assert max(u.full_numel for u in engine_of(model).units) <= 1000
    assert list(sd) == list(ref_sd)  # saved under the original names, in the original order
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_tiling_a_model_built_under_init():
    torch.manual_seed(0)
    base = OneBlock()
    ref_losses, _ = _reference(base, 3)
    cfg = zero_config(3, lr=LR, weight_decay=0.01, prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=500))
    torch.manual_seed(0)
    with infinity.Init(config=cfg):
        model = OneBlock()
    _, losses, sd, _, _ = _train(model, cfg, 3)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def _train_on_rank(cfg, steps):
    torch.manual_seed(0)
    model, opt = infinity.initialize(OneBlock(), cfg)
    losses = rank_losses(model, opt, _batches(steps), _plain_loss)
    return losses, max(u.full_numel for u in engine_of(model).units)


def test_tiling_on_two_ranks_matches_plain_pytorch(tmp_path):
    """Tiles are gathered and their gradients reduce-scattered across real gloo ranks, params on NVMe."""
    from infinity.testing import run_ranks

    torch.manual_seed(0)
    ref_losses, _ = _reference(OneBlock(), 4)
    cfg = zero_config(3, param="nvme", nvme=str(tmp_path), lr=LR, weight_decay=0.01, bucket=500,
                      prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=500))
    results = run_ranks(_train_on_rank, 2, cfg, 4, timeout=300)
    for losses, biggest in results:
        assert biggest <= 1000
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# infinity.estimate with tiling


def _est(**kw):
    return infinity.estimate(layers=1, hidden=8192, gpus=1, gpu_mem="256MB", cpu_mem="64GB", nvme="1TB", dtype="fp32",
                             seq_len=16, **kw)


def test_estimate_divides_the_operator_working_memory_by_the_tiling_factor():
    plain, tiled = _est(), _est(tiling_factor=16)
    largest = 4 * 8192 * 8192
    assert plain.terms.model_state_working == 8 * largest  # fp32 params + grads of the h -> 4h weight
    assert tiled.terms.model_state_working == 8 * largest // 16
    assert tiled.terms.activation_working == plain.terms.activation_working
    assert tiled.recommended.config["zero"]["tiling"] == {"enabled": True, "max_tile_params": largest // 16}


def test_estimate_names_the_tiling_factor_that_makes_the_largest_operator_fit(capsys):
    est = _est()
    assert not est.fitting
    assert est.tiling_needed.tiling_factor == 16  # 8 B x 268M / 16 = 134 MB; / 8 would be 268 MB > 256 MB
    assert est.tiling_needed.recommended.placement.stage == 3
    assert est.to_dict()["tiling_needed"]["max_tile_params"] == 4 * 8192 * 8192 // 16
    from infinity._apps._estimate_cli import main

    main(["--layers", "1", "--hidden", "8192", "--gpus", "1", "--gpu-mem", "256MB", "--cpu-mem", "64GB", "--nvme",
          "1TB", "--dtype", "fp32", "--seq-len", "16"])
    assert "fits with tiling factor 16 (zero.tiling.max_tile_params = 16777216)" in capsys.readouterr().out


@pytest.mark.parametrize("stage", [1, 2])
def test_tiling_at_stages_1_and_2_matches_plain_pytorch(stage):
    torch.manual_seed(0)
    base = OneBlock()
    ref_losses, _ = _reference(base, 3)
    cfg = zero_config(stage, lr=LR, weight_decay=0.01, tiling=_tiling(1000, min_params=500))
    model, losses, _, _, _ = _train(copy.deepcopy(base), cfg, 3)
    assert isinstance(model.up, TiledLinear)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_hf_gpt2_tied_embedding_tiled_and_conv1d_named(caplog):
    """GPT-2: the tied wte / lm_head are tiled alike and stay tied; its Conv1D layers are not a
    covered type and a warning names those above max_tile_params."""
    import logging

    from _models import batches, gpt2

    base = gpt2()
    data = batches(3)
    ref_losses, _ = _hf_reference(base, data)
    cfg = zero_config(3, lr=LR, weight_decay=0.01, prefetch=NO_PERSIST, tiling=_tiling(1000, min_params=1000))
    infinity.logger.propagate, was = True, infinity.logger.propagate
    try:
        with caplog.at_level(logging.WARNING, logger=infinity.logger.name):
            model, losses, sd = _hf_train(copy.deepcopy(base), cfg, data)
    finally:
        infinity.logger.propagate = was
    assert isinstance(model.transformer.wte, TiledEmbedding) and isinstance(model.lm_head, TiledLinear)
    assert model.lm_head.tiles[0].weight is model.transformer.wte.tiles[0].weight
    assert "transformer.h.0.mlp.c_fc (Conv1D) is not a covered type" in caplog.text
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_each_engine_has_its_own_device_budget(tmp_path):
    """Note [hold ledger] in _ledger.py: the device budget belongs to one engine. A model left gathered (not
    closed) in one engine does not count against another's ``device_memory_limit``, and each
    engine's peak is its own."""
    torch.manual_seed(0)
    base = OneBlock()
    # master weights on NVMe: the gathered parameters are read into buffers of their own (charged)
    common = dict(param="nvme", optim="nvme", nvme=str(tmp_path), lr=LR, prefetch=NO_PERSIST)
    big_model, _ = infinity.initialize(copy.deepcopy(base), zero_config(3, **common))
    with infinity.GatheredParameters(list(big_model.parameters())):  # every byte of one engine held
        held = engine_of(big_model).device_budget.stats().allocated
        assert held == sum(4 * p.numel() for p in base.parameters())
        cfg = {**zero_config(3, tiling=_tiling(3333), **common), "device_memory_limit": 40_000}
        model, losses, _, peak, _ = _train(copy.deepcopy(base), cfg, 2)  # fits its own 40 KB beside the first
    assert held > 40_000 and 0 < peak <= 40_000
    assert engine_of(big_model).device_budget.stats().allocated == 0  # released at the block's exit
    engine_of(model).close()
    engine_of(big_model).close()
