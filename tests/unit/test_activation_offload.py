"""activation_checkpointing.offload: cpu. The tensors saved at checkpoint boundaries go to host
memory after each block's forward and come back before its recomputation: training is exactly
the same (bitwise: the values are copied, never computed differently) with torch's checkpoint
in both flavours and with Hugging Face's gradient checkpointing, and the device bytes held for
checkpoints stay within the prefetch window."""
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from _configs import zero_config
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity._zero._activation_offload import DEFAULT_DEPTH
from infinity._zero._engine import engine_of

VOCAB, HIDDEN, LAYERS, LR = 64, 32, 4, 1e-2
BATCH, SEQ = 4, 10


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Every block checkpointed through ``Block.__call__`` (its hooks run again on recomputation)."""

    def __init__(self, mode, hidden=HIDDEN, layers=LAYERS):
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.block_inputs = []  # weak references to each block's input, for the memory test

    def forward(self, ids):
        x = self.emb(ids)
        self.block_inputs = []
        for block in self.blocks:
            self.block_inputs.append(weakref.ref(x))
            x = block(x) if self.mode == "none" else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def _cfg(stage, offload):
    return {**zero_config(stage, lr=LR, weight_decay=0.01), "activation_checkpointing": {"offload": offload}}


def _train(model, cfg, steps, loss_of=lambda m, ids: m(ids)):
    model, opt = infinity.initialize(model, cfg)
    losses = []
    for ids in _batches(steps):
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_offload_is_exact(mode, stage):
    torch.manual_seed(0)
    base = Stack(mode)
    _, plain = _train(copy.deepcopy(base), _cfg(stage, "none"), 4)
    model, offloaded = _train(copy.deepcopy(base), _cfg(stage, "cpu"), 4)
    assert offloaded == plain  # bitwise
    stats = engine_of(model).activation_offload.stats()
    assert stats["packs"] > 0 and stats["fetched_bytes"] >= stats["offloaded_bytes"] > 0
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for ids in _batches(4):
        loss = ref(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    torch.testing.assert_close(offloaded, ref_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_hf_gradient_checkpointing_offload_is_exact(mode):
    from _hf_models import llama

    def loss_of(m, ids):
        return m(input_ids=ids % 96, labels=ids % 96).loss

    base = llama(mode)
    _, plain = _train(copy.deepcopy(base), _cfg(3, "none"), 3, loss_of)
    model, offloaded = _train(copy.deepcopy(base), _cfg(3, "cpu"), 3, loss_of)
    assert offloaded == plain
    stats = engine_of(model).activation_offload.stats()
    hidden_bytes = BATCH * SEQ * 32 * 4
    assert stats["offloaded_bytes"] >= 2 * hidden_bytes * 3  # at least each layer's input, every step


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_block_inputs_leave_the_device_and_backward_holds_the_window(mode):
    """With offload, no block input survives the forward on the device (only its host copy);
    without, autograd keeps every one. In backward, the checkpoints held on the device are the
    one in use and the prefetch window: at most DEFAULT_DEPTH + 1 checkpoints' bytes."""
    torch.manual_seed(0)
    ids = _batches(1)[0]
    for offload, alive in (("none", 8), ("cpu", 0)):
        model, _ = infinity.initialize(Stack(mode, layers=8), _cfg(3, offload))
        loss = model(ids)
        gc.collect()
        assert sum(r() is not None for r in model.block_inputs) == alive, offload
        loss.backward()
        if offload == "cpu":
            stats = engine_of(model).activation_offload.stats()
            biggest = BATCH * SEQ * VOCAB * 4  # the largest saved tensor: the logits
            assert 0 < stats["peak_device_bytes"] <= (DEFAULT_DEPTH + 1) * biggest
            assert stats["peak_device_bytes"] < stats["offloaded_bytes"] / 2
            assert stats["device_bytes"] == 0  # everything fetched was handed to autograd
        engine_of(model).close()


def test_config_refuses_other_tiers():
    with pytest.raises(infinity.ConfigError, match="activation_checkpointing.offload"):
        infinity.Config.from_dict({"activation_checkpointing": {"offload": "nvme"}})


def test_hf_gradient_checkpointing_enable_gpt2():
    """The call the issue names, on GPT-2 (tied embeddings, Conv1D)."""
    from _models import gpt2

    base = gpt2()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.train()

    def loss_of(m, ids):
        return m(input_ids=ids, labels=ids).loss

    _, plain = _train(copy.deepcopy(base), _cfg(3, "none"), 3, loss_of)
    model, offloaded = _train(copy.deepcopy(base), _cfg(3, "cpu"), 3, loss_of)
    assert offloaded == plain
    assert engine_of(model).activation_offload.stats()["packs"] >= 2 * 3  # both layers' inputs, every step


def test_offload_with_tiling_is_exact():
    """Tiles run inside checkpointed blocks: recomputation gathers them again; offload changes nothing."""
    torch.manual_seed(0)
    base = Stack("nonreentrant")
    tiling = {"tiling": {"enabled": True, "min_params": 1000, "max_tile_params": 1000},
              "prefetch": {"persistence_threshold": 0}}

    def cfg(offload):
        c = _cfg(3, offload)
        c["zero"].update(tiling)
        return c

    _, plain = _train(copy.deepcopy(base), cfg("none"), 3)
    model, offloaded = _train(copy.deepcopy(base), cfg("cpu"), 3)
    assert type(model.blocks[0].up).__name__ == "TiledLinear"
    assert offloaded == plain


def test_two_forwards_then_two_backwards():
    """Gradient accumulation written as two forwards before their backwards: each backward
    brings back its own forward's checkpoints."""
    torch.manual_seed(0)
    base = Stack("nonreentrant")
    params = {}
    for offload in ("none", "cpu"):
        model, opt = infinity.initialize(copy.deepcopy(base), {**_cfg(2, offload), "gradient_accumulation_steps": 2})
        a, b = _batches(2)
        la, lb = model(a), model(b)
        lb.backward()
        la.backward()
        opt.step()
        with infinity.GatheredParameters(list(model.parameters())):
            params[offload] = {k: v.clone() for k, v in model.state_dict().items()}
    for k in params["none"]:
        assert torch.equal(params["none"][k], params["cpu"][k]), k
