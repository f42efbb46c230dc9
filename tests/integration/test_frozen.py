"""Frozen parameters cost nothing in the optimizer (Note [frozen parameters] in
infinity/_offload/_layout.py): with LoRA (peft) on a Hugging Face Llama, or any requires_grad=False
parameter, master weights, moments and gradient shards exist for the trainable parameters
only, on every tier, in the preflight and in infinity.estimate; training stays exact."""
import copy
import os

import pytest
import torch
from _configs import zero_config
from torch import nn

import infinity
from infinity._offload._layout import ParamSource
from infinity._offload._preflight import plan

peft = pytest.importorskip("peft")  # installed by scripts/setup_env.sh

LR = 1e-2


def _llama(hidden=64, layers=2, vocab=256, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _lora(model):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False)  # random B: the adapters change the output from step 0
    return peft.get_peft_model(model, lora)


def _config(stage, param, optim, path):
    return zero_config(stage, param=param, optim=optim, nvme=path, prefetch={"persistence_threshold": 0}, lr=LR,
                       weight_decay=0.01)


def _ids(steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(steps)]


def _train(model, opt, gather=None):
    losses = []
    for ids in _ids():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = list(model.parameters())
    if gather is None:
        return losses, [p.detach().clone() for p in params]
    with gather(params):
        return losses, [p.detach().clone() for p in params]


def _opt_files(path):
    """Bytes of the optimizer's swap files under ``path`` (not the parameter file, nor the
    owner note of each rank directory)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(".swp") and f != "params.swp")
    return total


@pytest.mark.parametrize("stage,param,optim", [(2, "none", "cpu"), (3, "none", "none"), (3, "nvme", "nvme"),
                                               (3, "cpu", "nvme")])
def test_lora_is_exact_and_its_optimizer_holds_the_adapters_only(tmp_path, stage, param, optim):
    model = _lora(_llama())
    ref = copy.deepcopy(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert trainable * 50 < total
    model, opt = infinity.initialize(model, config=_config(stage, param, optim, str(tmp_path)))
    units = opt.engine.units
    assert all(u.trainable == all(p.requires_grad for p in u.params) for u in units)  # never mixed
    # the optimizer's flat space holds the adapters (each unit rounded up to the alignment), not the model
    assert trainable <= opt.total <= trainable + 2048 * sum(u.trainable for u in units)
    if optim == "nvme":  # master, moments (and gradients unless they stay in host memory)
        assert _opt_files(tmp_path) in (3 * 4 * opt.total, 4 * 4 * opt.total)
    else:  # master, moments, gradients (and a spare gradient buffer when the step is overlapped)
        assert sum(opt.store.nbytes().values()) <= 24 * opt.total
    if opt.param_store is not None:  # every parameter keeps its shard
        assert opt.layout.param_total >= total
        held = sum(opt.param_store.nbytes().values())
        if opt.placement.param_source is ParamSource.MASTER:  # the trainable units' shards are the master tensor's
            assert held == 4 * opt.layout.frozen_total and opt.store.master_view().numel() == opt.layout.opt_total
        else:
            assert held >= 4 * opt.layout.param_total
    needed = plan(opt.placement, opt.cfg)
    nvme_needed = sum(needed["nvme"].values())
    if optim == "nvme":
        assert nvme_needed <= 16 * opt.total + (4 * opt.layout.param_total if param == "nvme" else 0)
    losses, final = _train(model, opt, infinity.GatheredParameters)
    frozen_before = [p.detach().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    ref_losses, ref_final = _train(ref, ref_opt)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for (name, p), ours, theirs, before in zip(ref.named_parameters(), final, ref_final, frozen_before):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
        if not p.requires_grad:
            assert torch.equal(ours, before), name  # frozen: bit-identical after training
    opt.engine.close()


def test_optimizer_bytes_scale_with_the_trainable_count(tmp_path):
    """Full fine-tuning vs LoRA of the same Llama: the optimizer's files hold the trainable
    units' shards (each rounded up to the 2048-element alignment of NVMe transfers) and
    nothing for the frozen ones; the parameter file holds every unit."""
    sizes = {}
    for kind in ("full", "lora"):
        model = _llama(hidden=128)
        if kind == "lora":
            model = _lora(model)
        path = tmp_path / kind
        path.mkdir()
        model, opt = infinity.initialize(model, config=_config(3, "nvme", "nvme", str(path)))
        slots = [-(-u.shard_numel // 2048) * 2048 for u in opt.engine.units if u.trainable]
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sizes[kind] = (trainable, _opt_files(path), sum(slots), opt.layout.param_total)
        assert opt.total == sum(slots) and trainable <= sum(slots)
        opt.engine.close()
    (t_full, files_full, slots_full, params_full), (t_lora, files_lora, slots_lora, params_lora) = \
        sizes["full"], sizes["lora"]
    assert files_full / slots_full == files_lora / slots_lora in (12, 16)  # bytes per optimizer element
    assert params_lora >= params_full  # every parameter still has its shard
    assert t_lora * 50 < t_full and files_lora * 20 < files_full


class BitFit(nn.Module):
    """Frozen weights, trainable biases: each linear is split into a frozen and a trainable unit."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 1)
        for m in (self.a, self.b):
            m.weight.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


@pytest.mark.parametrize("stage,param,optim", [(1, "none", "none"), (2, "none", "nvme"), (3, "nvme", "nvme"),
                                               (3, "cpu", "cpu")])
def test_bitfit_mixed_modules_are_exact(tmp_path, stage, param, optim):
    torch.manual_seed(0)
    net = BitFit()
    ref = copy.deepcopy(net)
    model, opt = infinity.initialize(net, config=_config(stage, param, optim, str(tmp_path)))
    assert len(opt.engine.units) == 4 and opt.total <= 2 * 2048
    x = torch.randn(8, 32)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
    with infinity.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    opt.engine.close()


def test_ranks_that_disagree_on_requires_grad_are_refused():
    from infinity.testing import RankFailure, run_ranks

    with pytest.raises(RankFailure, match=r"built different models.*frozen"):
        run_ranks(_freeze_on_rank_one, 2, timeout=120)


def _freeze_on_rank_one():
    import torch.distributed as dist

    net = BitFit()
    if dist.get_rank() == 1:
        net.a.bias.requires_grad_(False)
    infinity.initialize(net, config=_config(3, "none", "none", None))


def test_estimate_counts_optimizer_states_for_trainable_parameters_only():
    full = infinity.estimate("7B", gpus=1, gpu_mem="80GB", cpu_mem="256GB", nvme="1TB", dtype="bf16")
    lora = infinity.estimate("7B", gpus=1, gpu_mem="80GB", cpu_mem="256GB", nvme="1TB", dtype="bf16",
                             trainable="20M")
    assert full.terms.model_states == 20 * full.params
    # the decoder planned trains its top parameters that fit and an adapter for the rest (Note [the
    # planned decoder] in infinity/_apps/_estimate_model.py)
    assert lora.trainable == 20 * 10**6 and lora.params == pytest.approx(7 * 10**9, rel=0.02)
    assert lora.terms.model_states == 2 * lora.params + 18 * 20 * 10**6
    by = {(p.stage, str(p.param_tier), str(p.optimizer_tier)): p for p in lora.placements}
    # params.swp (2 bytes each) and the trained ones' master weights and moments (12: their gradients stay in host memory)
    assert by[(3, "nvme", "nvme")].nvme_bytes == pytest.approx(2 * lora.params + 12 * 20 * 10**6, rel=1e-4)
    assert by[(3, "nvme", "nvme")].plan.trainable == 20 * 10**6
    with pytest.raises(infinity._apps._estimator.EstimateError, match="trainable"):
        infinity.estimate("7B", gpus=1, gpu_mem="80GB", cpu_mem="256GB", nvme="1TB", trainable="8B")
