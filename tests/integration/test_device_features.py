"""The features beside plain training, on the device: each runs on the accelerator (the
emulated one in CI, Note [emulated accelerator] in _emulated.py; CUDA with ``INFINITY_ACCELERATOR=cuda``) and is
compared with plain PyTorch on the same device, as tests/integration/test_device_matrix.py compares
training: fp32, every loss and every final weight within 1e-5.

- checkpoints: save after 2 steps, load into a fresh engine (other initial weights), 2 more
  steps equal 4 uninterrupted ones (stage 3 on NVMe, stage 2 with the optimizer in host
  memory); both exports (the streamed ``infinity.export`` of a checkpoint and the live
  ``export_safetensors``) hold the trained weights; a checkpoint saved by two ranks resumes
  at one (another placement) and continues exactly;
- ``GatheredParameters``: reading gives the full weights, an edit without ``modifier_rank``
  is discarded, one with ``modifier_rank=0`` persists into training as the same edit does in
  plain PyTorch (tied weights included);
- activation checkpointing (Hugging Face's, both flavours) with stage 3 and
  ``activation_checkpointing.offload: cpu``, and torch's checkpoint at stage 2 with offload;
- parameter groups (own lr, weight decay, betas, an LR scheduler, a parameter without a
  gradient in some steps), frozen parameters (BitFit) and LoRA (peft);
- ``infinity.TiledLinear`` in a small model (tiles split both ways), and its untiled export;
- ``InfinityTrainer``: a tiny run on the device equals the same run on the CPU;
- ``infinity.Init``: a model built partitioned with stage 3 on NVMe trains exactly.
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _hf_models import batches, build, loss_of
from test_activation_offload import VOCAB as STACK_VOCAB
from test_activation_offload import Stack
from test_device_matrix import KIND, LR, STEPS, WEIGHT_DECAY, Cell, _fit, _moved, _to_device, reference
from test_frozen import BitFit
from test_param_groups import Net, _groups
from torch import nn

import infinity
from infinity._runtime import _accelerator as acc

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")

TOL = 1e-5


@pytest.fixture(autouse=True)
def device():
    """Every test of this file computes on the accelerator (emulated unless CUDA was asked for)."""
    with acc.using(KIND):
        yield acc.device()


def _close(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def _same_losses(got, want):
    assert all(torch.isfinite(torch.tensor(got))), got
    _close(torch.tensor(got), torch.tensor(want), "losses")


def _same_params(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, ref in want.items():
        _close(got[name], ref, name)


def _steps(model, opt, kind, pairs, dev, rank=0, world=1) -> list:
    """One step per ``(ids, targets)`` batch, this rank's share of it, on ``dev``; the losses."""
    losses = []
    for ids, targets in pairs:
        ids, targets = _to_device((ids.chunk(world)[rank], targets.chunk(world)[rank]), dev)
        loss = loss_of(model, kind, ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _host_params(model) -> dict:
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def _gathered(model) -> dict:
    with infinity.GatheredParameters(list(model.parameters())):
        return _host_params(model)


def _plain_run(kind, dev, pairs, mode="none", edit_after=None, edit=None):
    """Plain ``torch.optim.AdamW`` on the model moved to ``dev``, one step per batch; ``edit(model)``
    under no_grad after step ``edit_after``. The losses and the final weights."""
    model = _moved(build(kind, mode), dev, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for k, pair in enumerate(pairs):
        losses += _steps(model, opt, kind, [pair], dev)
        if edit is not None and k + 1 == edit_after:
            with torch.no_grad():
                edit(model)
    return losses, _host_params(model)


def _ids(cells):
    return [c.id for c in cells]


def _placements(cells):
    """Ids of cells whose model is the test's own (not ``cell.kind``): the placement only."""
    return [f"s{c.stage}" + (f"-param-{c.param}" if c.stage == 3 else "") + f"-opt-{c.optim}" for c in cells]


# ------------------------------------------------------------------ checkpoints

RESUME = [Cell(3, "nvme", "nvme"), Cell(2, optim="cpu")]


@pytest.mark.parametrize("cell", RESUME, ids=_ids(RESUME))
def test_resume_on_the_device_matches_the_uninterrupted_run(cell, tmp_path, device):
    pairs = batches(cell.kind, 4)
    ref_losses, ref_params = _plain_run(cell.kind, device, pairs)
    nvme, ck = str(tmp_path / "nvme"), str(tmp_path / "ck")
    model, opt = infinity.initialize(build(cell.kind), config=cell.config(nvme))
    try:
        losses = _steps(model, opt, cell.kind, pairs[:2], device)
        infinity.save_checkpoint(ck, model, opt, client_state={"data_position": 2})
    finally:
        opt.engine.close()
    more, params = _resumed(cell, nvme, ck, pairs[2:], device)
    assert more[0] == {"data_position": 2}
    _same_losses(losses + more[1], ref_losses)
    _same_params(params, ref_params)


def _resumed(cell, nvme, ck, pairs, device):
    """A fresh engine of other initial weights loads ``ck`` and trains on ``pairs``: (what the
    load returned, the losses), and the weights at the end."""
    model, opt = infinity.initialize(build(cell.kind, seed=7), config=cell.config(nvme))
    try:
        extra = infinity.load_checkpoint(ck, model, opt)
        return (extra, _steps(model, opt, cell.kind, pairs, device)), _gathered(model)
    finally:
        opt.engine.close()


def test_exports_hold_the_trained_weights(tmp_path, device):
    """The streamed export of a checkpoint (``python -m infinity.export``) and the live
    ``export_safetensors`` of the model on the device write the weights it trained to."""
    from safetensors.torch import load_file

    from infinity._checkpoint._safetensors_export import export_safetensors
    from infinity.export import main as export_main

    cell = Cell(3, "nvme", "cpu", kind="llama")
    ref_losses, ref_params = _plain_run(cell.kind, device, batches(cell.kind, 2))
    model, opt = infinity.initialize(build(cell.kind), config=cell.config(str(tmp_path / "nvme")))
    try:
        losses = _steps(model, opt, cell.kind, batches(cell.kind, 2), device)
        infinity.save_checkpoint(str(tmp_path / "ck"), model, opt)
        export_safetensors(model, str(tmp_path / "live"))
        params = _gathered(model)
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "streamed")]) == 0
    for where in ("streamed", "live"):
        assert (tmp_path / where / "config.json").exists(), where
        files = load_file(str(tmp_path / where / "model.safetensors"))
        assert set(params) <= set(files), where
        for name, p in params.items():
            assert torch.equal(files[name], p), (where, name)


def _save_at_two_ranks(cell: Cell, nvme: str, ck: str):
    """Two steps, each rank on its half of every batch, then a checkpoint; the global mean losses."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    with acc.using(KIND):
        model, opt = infinity.initialize(build(cell.kind), config=cell.config(nvme))
        try:
            local = torch.tensor(_steps(model, opt, cell.kind, batches(cell.kind, 4)[:2], acc.device(), rank, world),
                                 dtype=torch.float64)
            infinity.save_checkpoint(ck, model, opt)
        finally:
            opt.engine.close()
    dist.all_reduce(local)
    return (local / world).tolist()


def test_a_checkpoint_of_two_ranks_resumes_at_one(tmp_path, device):
    """Saved by two ranks with stage 3 on NVMe, loaded by one with stage 3 in host memory
    (each parameter's chunks re-cut), two more steps: the uninterrupted run's losses and weights."""
    from infinity.testing import run_ranks

    if KIND == "cuda" and acc.device_count() < 2:
        pytest.skip("two NCCL ranks need two GPUs (NCCL refuses two ranks on one device)")
    saved, loaded = Cell(3, "nvme", "nvme"), Cell(3, "cpu", "cpu")
    pairs = batches(saved.kind, 4)
    ref_losses, ref_params = _plain_run(saved.kind, device, pairs)
    ck = str(tmp_path / "ck")
    losses = run_ranks(_save_at_two_ranks, 2, saved, str(tmp_path / "nvme2"), ck, timeout=300)[0]
    (_, more), params = _resumed(loaded, str(tmp_path / "nvme1"), ck, pairs[2:], device)
    _same_losses(losses + more, ref_losses)
    _same_params(params, ref_params)


# ------------------------------------------------------------------ GatheredParameters


def test_gathered_parameters_read_the_full_weights_and_discard_edits_without_modifier_rank(tmp_path, device):
    """Gathered on the device, every parameter is the whole initial weight; an edit without
    modifier_rank is undone at exit, so training is still exactly plain PyTorch's."""
    cell = Cell(3, "nvme", "nvme")
    initial = _host_params(build(cell.kind))
    ref_losses, ref_params = reference(cell, device)
    model, opt = infinity.initialize(build(cell.kind), config=cell.config(str(tmp_path)))
    try:
        with infinity.GatheredParameters(list(model.parameters())):
            assert {p.device.type for p in model.parameters()} == {device.type}
            _same_params(_host_params(model), initial)
        w = model.transformer.h[0].mlp.c_fc.weight
        with infinity.GatheredParameters([w]):
            assert tuple(w.shape) == tuple(initial["transformer.h.0.mlp.c_fc.weight"].shape)
            assert torch.equal(w.detach().cpu(), initial["transformer.h.0.mlp.c_fc.weight"])
            with torch.no_grad():
                w.data.mul_(3.0)  # no modifier_rank: discarded
        with infinity.GatheredParameters([w]):
            assert torch.equal(w.detach().cpu(), initial["transformer.h.0.mlp.c_fc.weight"])
        losses = _fit(model, opt, cell, device)
        params = _gathered(model)
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)


def _edit(model):
    """Scale one attention weight, shift a bias, and scale the tied embedding (and so the head)."""
    model.transformer.h[0].attn.c_attn.weight.mul_(0.5)
    model.transformer.h[1].mlp.c_proj.bias.add_(0.1)
    model.transformer.wte.weight.mul_(1.5)


# With the optimizer on NVMe (s3 nvme/nvme, s2 nvme) the edit is refused: the engine hands the
# device tensor of the edited shard to the NVMe store, whose aio write takes host tensors only
# (infinity/_zero/_engine.py repartition -> _nvme_optimizer_store.py load_master -> aio pwrite).
EDITS = [Cell(3, "nvme", "nvme"), Cell(3, "nvme", "cpu"), Cell(3, "none", "none"), Cell(2, optim="nvme"),
         Cell(2, optim="cpu"), Cell(1)]


@pytest.mark.parametrize("cell", EDITS, ids=_ids(EDITS))
def test_edit_with_modifier_rank_persists_into_training(cell, tmp_path, device):
    pairs = batches(cell.kind, 4)
    ref_losses, ref_params = _plain_run(cell.kind, device, pairs, edit_after=2, edit=_edit)
    model, opt = infinity.initialize(build(cell.kind), config=cell.config(str(tmp_path)))
    try:
        losses = _steps(model, opt, cell.kind, pairs[:2], device)
        edited = [model.transformer.h[0].attn.c_attn.weight, model.transformer.h[1].mlp.c_proj.bias,
                  model.transformer.wte.weight]
        with infinity.GatheredParameters(edited, modifier_rank=0):
            with torch.no_grad():
                _edit(model)
        losses += _steps(model, opt, cell.kind, pairs[2:], device)
        params = _gathered(model)
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)


# ------------------------------------------------------------------ activation checkpointing and offload

OFFLOAD = [Cell(3, "nvme", "nvme", kind="llama", mode="reentrant"),
           Cell(3, "cpu", "cpu", kind="llama", mode="nonreentrant")]


@pytest.mark.parametrize("cell", OFFLOAD, ids=_ids(OFFLOAD))
def test_hf_checkpointing_with_activation_offload_at_stage3(cell, tmp_path, device):
    from infinity._zero._engine import engine_of

    ref_losses, ref_params = reference(cell, device)
    cfg = {**cell.config(str(tmp_path)), "activation_checkpointing": {"offload": "cpu"}}
    model, opt = infinity.initialize(build(cell.kind, cell.mode), config=cfg)
    try:
        assert model.is_activation_checkpointing
        losses = _fit(model, opt, cell, device)
        params = _gathered(model)
        stats = engine_of(model).activation_offload.stats()
    finally:
        opt.engine.close()
    assert stats["packs"] > 0 and stats["fetched_bytes"] >= stats["offloaded_bytes"] > 0, stats
    assert stats["device_bytes"] == 0, stats
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)


def _train_module(model, opt, inputs, loss=lambda m, x: m(x)) -> list:
    losses = []
    for x in inputs:
        out = loss(model, x)
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses


def _plain_module(base, dev, inputs, groups=None, loss=lambda m, x: m(x), **adamw):
    """Plain AdamW (``groups(model)`` or every trainable parameter) on a copy moved to ``dev``."""
    model = _moved(copy.deepcopy(base), dev, torch.float32)
    params = groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **{"lr": LR, "weight_decay": WEIGHT_DECAY, **adamw})
    return _train_module(model, opt, inputs, loss), _host_params(model)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])
def test_torch_checkpoint_with_activation_offload_at_stage2(reentrant, device):
    from infinity._zero._engine import engine_of

    torch.manual_seed(0)
    base = Stack("reentrant" if reentrant else "nonreentrant")
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, STACK_VOCAB, (4, 10), generator=g).to(device) for _ in range(STEPS)]
    ref_losses, ref_params = _plain_module(base, device, ids)
    cfg = {**Cell(2, optim="cpu").config(None), "activation_checkpointing": {"offload": "cpu"}}
    model, opt = infinity.initialize(copy.deepcopy(base), config=cfg)
    try:
        losses = _train_module(model, opt, ids)
        params = _gathered(model)
        stats = engine_of(model).activation_offload.stats()
    finally:
        opt.engine.close()
    assert stats["packs"] >= len(base.blocks) * STEPS and stats["offloaded_bytes"] > 0, stats
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)


# ------------------------------------------------------------------ parameter groups, frozen, LoRA


USE = [True, False, False, True]  # `skip` gets no gradient in steps 1 and 2


def _group_steps(model, opt, dev):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dev)
    losses = []
    for use in USE:
        loss = model(x, use)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, [g["lr"] for g in opt.param_groups]


GROUPS = [Cell(3, "nvme", "nvme"), Cell(2, optim="cpu"), Cell(1)]


@pytest.mark.parametrize("cell", GROUPS, ids=_placements(GROUPS))
def test_parameter_groups_and_a_scheduler_match_adamw(cell, tmp_path, device):
    torch.manual_seed(0)
    base = Net()
    ref = _moved(copy.deepcopy(base), device, torch.float32)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=LR, weight_decay=0.1)
    ref_losses, ref_lrs = _group_steps(ref, ref_opt, device)
    ref_counts = [int(ref_opt.state[p]["step"]) for p in ref.parameters()]
    net = copy.deepcopy(base)
    cfg = cell.config(str(tmp_path))
    cfg["optimizer"]["weight_decay"] = 0.1
    model, opt = infinity.initialize(net, config=cfg, param_groups=_groups(net))
    try:
        losses, lrs = _group_steps(model, opt, device)
        params = _gathered(model)
        counts = [opt.step_count(p) for p in model.parameters()]
    finally:
        opt.engine.close()
    assert counts == ref_counts and sorted(set(counts)) == [2, 4]
    assert lrs == pytest.approx(ref_lrs)
    _same_losses(losses, ref_losses)
    _same_params(params, _host_params(ref))


FROZEN = [Cell(3, "nvme", "nvme"), Cell(2, optim="cpu")]


@pytest.mark.parametrize("cell", FROZEN, ids=_placements(FROZEN))
def test_frozen_parameters_stay_and_the_rest_matches_adamw(cell, tmp_path, device):
    torch.manual_seed(0)
    base = BitFit()
    initial = _host_params(base)
    x = [torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(device)] * STEPS
    ref_losses, ref_params = _plain_module(base, device, x)
    model, opt = infinity.initialize(copy.deepcopy(base), config=cell.config(str(tmp_path)))
    try:
        losses = _train_module(model, opt, x)
        params = _gathered(model)
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)
    for name in ("a.weight", "b.weight"):
        assert torch.equal(params[name], initial[name]), name


def test_lora_matches_plain_pytorch(tmp_path, device):
    from test_frozen import _llama, _lora  # skips where peft is not installed

    base = _lora(_llama(hidden=32, vocab=96))
    initial = _host_params(base)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (2, 12), generator=g).to(device) for _ in range(STEPS)]

    def lm_loss(m, x):
        return m(input_ids=x, labels=x).loss

    ref_losses, ref_params = _plain_module(base, device, ids, loss=lm_loss)
    model, opt = infinity.initialize(copy.deepcopy(base), config=Cell(3, "nvme", "nvme").config(str(tmp_path)))
    try:
        assert sum(u.trainable for u in opt.engine.units) < len(opt.engine.units)
        losses = _train_module(model, opt, ids, lm_loss)
        params = _gathered(model)
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)
    frozen = [n for n, p in base.named_parameters() if not p.requires_grad]
    assert frozen and all(torch.equal(params[n], initial[n]) for n in frozen)
    assert not all(torch.equal(params[n], initial[n]) for n in params)


# ------------------------------------------------------------------ tiling


class _Tiled(nn.Module):
    """An MLP block whose two linears are ``infinity.TiledLinear``: ``up`` split both ways,
    ``down`` along its input features (partial products summed)."""

    VOCAB, HIDDEN = 48, 16

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, self.HIDDEN)
        self.norm = nn.LayerNorm(self.HIDDEN)
        self.up = infinity.TiledLinear(self.HIDDEN, 4 * self.HIDDEN, in_splits=2, out_splits=3)
        self.down = infinity.TiledLinear(4 * self.HIDDEN, self.HIDDEN, in_splits=3, out_splits=1)
        self.head = nn.Linear(self.HIDDEN, self.VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.VOCAB), ids[:, 1:].reshape(-1))


def test_tiled_linear_matches_plain_pytorch_and_exports_untiled(tmp_path, device):
    from safetensors.torch import load_file

    from infinity._checkpoint._safetensors_export import export_safetensors

    torch.manual_seed(0)
    base = _Tiled()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, _Tiled.VOCAB, (4, 10), generator=g).to(device) for _ in range(STEPS)]
    ref_losses, ref_params = _plain_module(base, device, ids)
    cfg = Cell(3, "nvme", "nvme").config(str(tmp_path / "nvme"))
    model, opt = infinity.initialize(copy.deepcopy(base), config=cfg)
    try:
        tiles = {id(p) for m in (model.up, model.down) for p in m.parameters()}
        assert sum(all(id(p) in tiles for p in u.params) for u in opt.engine.units) == 6 + 3  # a unit per tile
        losses = _train_module(model, opt, ids)
        params = _gathered(model)
        with infinity.GatheredParameters(list(model.parameters())):
            untiled = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        export_safetensors(model, str(tmp_path / "live"))
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)
    assert set(untiled) == {"emb.weight", "norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight",
                            "down.bias", "head.weight"}
    files = load_file(str(tmp_path / "live" / "model.safetensors"))
    assert set(files) == set(untiled)
    for k, v in untiled.items():
        assert torch.equal(files[k], v), k


# ------------------------------------------------------------------ InfinityTrainer


def _trainer_run(out: str, nvme: str):
    from _trainer_job import dataset, losses, tiny_llama, training_args

    from infinity.integrations.transformers import InfinityTrainer

    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           "precision": {"dtype": "fp32"}}
    trainer = InfinityTrainer(model=tiny_llama(), args=training_args(out, max_steps=2), train_dataset=dataset(16),
                              eval_dataset=dataset(4, seed=3), infinity_config=cfg)
    try:
        trainer.train()
        return losses(trainer) + [trainer.evaluate()["eval_loss"]], _gathered(trainer.model), acc.kind()
    finally:
        trainer.optimizer.engine.close()


def test_infinity_trainer_on_the_device_matches_the_same_run_on_the_cpu(tmp_path, device):
    """The Trainer computes on the CPU here (``use_cpu``: ``args.device`` is the CPU) and infinity
    on the device: each micro-batch must go where infinity placed the parameters, and each loss
    back to ``args.device`` where the Trainer sums them (Note [InfinityTrainer seams] in transformers.py, batches)."""
    with acc.using("cpu"):
        cpu_losses, cpu_params, cpu_kind = _trainer_run(str(tmp_path / "cpu"), str(tmp_path / "nvme_cpu"))
    losses, params, kind = _trainer_run(str(tmp_path / "dev"), str(tmp_path / "nvme_dev"))
    assert (cpu_kind, kind) == ("cpu", KIND)
    assert len(losses) == 3  # two steps, then the evaluation
    _same_losses(losses, cpu_losses)
    _same_params(params, cpu_params)


# ------------------------------------------------------------------ infinity.Init


def test_init_stage3_nvme_trains_like_plain_pytorch(tmp_path, device):
    """Built under ``infinity.Init`` with stage 3 on NVMe (partitioned as it is built, the
    initial weights those of the model built plainly), then initialize, then training."""
    cell = Cell(3, "nvme", "nvme")
    ref_losses, ref_params = reference(cell, device)
    initial = _host_params(build(cell.kind))
    cfg = cell.config(str(tmp_path))
    with infinity.Init(config=cfg):
        model = build(cell.kind)
    assert model.lm_head.weight is model.transformer.wte.weight
    with infinity.GatheredParameters(list(model.parameters())):
        _same_params(_host_params(model), initial)
    model, opt = infinity.initialize(model, config=cfg)
    try:
        losses = _fit(model, opt, cell, device)
        params = _gathered(model)
    finally:
        opt.engine.close()
    _same_losses(losses, ref_losses)
    _same_params(params, ref_params)


def test_the_routing_leaves_other_accelerators_to_torch():
    """The emulator's answers in ``torch.accelerator`` (Note [emulated accelerator in torch.accelerator] in
    _emulated_torch.py) are for it alone: in a process without it torch's own entry points answer (here: no
    accelerator)."""
    code = ("import torch, infinity._runtime._accelerator._emulated_torch as t; t.install(); "
            "print(torch.accelerator.current_accelerator(), torch.accelerator.device_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "0"]
