"""Tiny models for the exact-training grid (tests/integration/test_exact_training.py), all built from
configs (nothing downloads), each with a switch for activation checkpointing.

- ``gpt2``: Hugging Face GPT-2 with tied embeddings (tests/_models.py).
- ``llama``: Hugging Face Llama (rotary embeddings, RMSNorm, gated MLP; untied head), and
  ``llama_frozen``, the same with its embedding and first layer frozen.
- ``t5``: Hugging Face T5 encoder-decoder (relative attention bias owned by the first block
  and read by every later one, cross-attention, tied encoder/decoder embedding).
- ``moe``: a top-1 mixture of experts whose experts are separate modules run only on the
  tokens routed to them; one expert is never routed to, one only on some steps.
- ``frozen``: a stack whose lower half does not require grad (gradients still flow through
  it to the trainable embedding below), with two modules frozen only in part.

Checkpoint modes: ``none``, ``reentrant`` and ``nonreentrant`` for every model; the custom
models also have ``nested`` and ``nested_reentrant`` (a checkpointed block whose forward
checkpoints a sub-block again). Hugging Face models checkpoint through
``activation_checkpointing_enable``, which checkpoints each layer's ``forward`` (the layer's
own hooks stay outside); the custom models checkpoint ``module.__call__`` (hooks inside, run
again by the recomputation), the way hand-written training code does.
"""
import torch
import torch.nn.functional as F
from _models import VOCAB
from _models import gpt2 as _gpt2
from torch import nn
from torch.utils.checkpoint import checkpoint

HF_MODES = ("none", "reentrant", "nonreentrant")
CUSTOM_MODES = HF_MODES + ("nested", "nested_reentrant")


def _reentrant(mode):
    return mode in ("reentrant", "nested_reentrant")


# ------------------------------------------------------------------ Hugging Face models


def _hf_checkpointing(model, mode):
    model.train()
    if mode != "none":
        new = hasattr(model, "activation_checkpointing_enable")  # the names before transformers 5.18: gradient_*
        enable = model.activation_checkpointing_enable if new else model.gradient_checkpointing_enable
        enable(**{"activation_checkpointing_kwargs" if new else "gradient_checkpointing_kwargs":
                  {"use_reentrant": _reentrant(mode)}})
        assert model.is_activation_checkpointing if new else model.is_gradient_checkpointing
    return model


def gpt2(mode="none", seed=0):
    return _hf_checkpointing(_gpt2(seed), mode)


def llama(mode="none", seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
    return _hf_checkpointing(LlamaForCausalLM(cfg), mode)


def llama_frozen(mode="none", seed=0):
    """Llama with its lower half frozen (embedding and first layer), as when fine-tuning the top
    layers. With checkpointing on, Hugging Face makes the embedding's output require grad, so
    backward runs through the frozen layer (its RMSNorm reads its weight there)."""
    model = llama(mode, seed)
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    return model


def t5(mode="none", seed=0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2,
                   num_heads=2, dropout_rate=0.0, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1, use_cache=False)
    return _hf_checkpointing(T5ForConditionalGeneration(cfg), mode)


# ------------------------------------------------------------------ custom models


class _Checkpointed(nn.Module):
    """Calls its blocks through ``torch.utils.checkpoint`` when the mode asks for it."""

    mode = "none"

    def run(self, module, *args, inner=False):
        if self.mode == "none" or (inner and not self.mode.startswith("nested")):
            return module(*args)
        return checkpoint(module, *args, use_reentrant=_reentrant(self.mode))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoELayer(nn.Module):
    """Top-1 routing by a router linear; expert ``e`` runs only on the tokens routed to it,
    its output scaled by the router's probability (so the router learns too)."""

    def __init__(self, dim, hidden, experts, owner):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList([MLP(dim, hidden) for _ in range(experts)])
        self._owner = [owner]  # not a submodule: the model, for its checkpoint mode
        self.used = ()  # the experts the last forward ran

    def forward(self, x):
        h = self.norm(x)
        flat = h.reshape(-1, h.size(-1))
        probs = torch.softmax(self.router(flat), dim=-1)
        gate, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        used = []
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue  # an expert no token chose does not run: its parameters get no gradient
            used.append(e)
            y = self._owner[0].run(expert, flat[idx], inner=True)
            out = out.index_add(0, idx, y * gate[idx, None])
        self.used = tuple(used)
        return x + out.view_as(x)


class MoE(_Checkpointed):
    """Embedding, two MoE layers of four experts, tied output head."""

    DEAD = 3  # the expert no token is ever routed to (its router bias is far below the others)
    SOMETIMES = 2  # the expert that the second batch never reaches (see ``batches``)

    def __init__(self, dim=16, hidden=32, experts=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([MoELayer(dim, hidden, experts, self) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        with torch.no_grad():
            for layer in self.layers:
                layer.router.weight.mul_(8.0)  # decisive routing, so that data decides the experts
                layer.router.bias[self.DEAD] = -30.0
        self.routing = []  # per forward, per layer: the experts that received tokens

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = self.run(layer, x)
        self.routing.append([layer.used for layer in self.layers])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


class Block(nn.Module):
    def __init__(self, dim, hidden, owner):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)
        self._owner = [owner]

    def forward(self, x):
        return x + self._owner[0].run(self.mlp, self.norm(x), inner=True)


class ScaleShift(nn.Module):
    """``x * gain + shift``: two autograd nodes; frozen gain, trainable shift."""

    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(dim), requires_grad=False)
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * self.gain + self.shift


class FrozenHalf(_Checkpointed):
    """Embedding, four blocks and a head. Blocks 0 and 1 are frozen (``requires_grad=False``),
    but the embedding below them trains, so backward runs through the frozen blocks without
    producing their gradients. Two modules are frozen only in part: block 2's norm (weight
    frozen, bias trains; one autograd node) and ``out`` (a frozen gain, then a trainable shift:
    the shift's gradient is complete before backward has read the gain)."""

    def __init__(self, dim=16, hidden=32, depth=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden, self) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.out = ScaleShift(dim)
        self.head = nn.Linear(dim, VOCAB)
        for block in self.blocks[: depth // 2]:
            block.requires_grad_(False)
        self.blocks[depth // 2].norm.weight.requires_grad_(False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = self.run(block, x)
        logits = self.head(self.out(self.norm(x)))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def _custom(cls, mode, seed):
    assert mode in CUSTOM_MODES, mode
    torch.manual_seed(seed)
    model = cls()
    model.mode = mode
    return model.train()


def moe(mode="none", seed=0):
    return _custom(MoE, mode, seed)


def frozen(mode="none", seed=0):
    return _custom(FrozenHalf, mode, seed)


BUILDERS = {"gpt2": gpt2, "llama": llama, "llama_frozen": llama_frozen, "t5": t5, "moe": moe, "frozen": frozen}


def build(kind, mode="none", seed=0):
    return BUILDERS[kind](mode, seed)


# ------------------------------------------------------------------ data and loss


def batches(kind, steps, global_batch=4, seq=12, seed=1):
    """``steps`` batches ``(ids, targets)`` alternating between two fixed random ones (the
    targets are T5's decoder labels; the decoder-only models predict ``ids`` shifted).
    For the MoE the second batch holds only tokens that no layer routes to ``MoE.SOMETIMES``,
    so that expert is used on the odd steps and idle on the even ones."""
    g = torch.Generator().manual_seed(seed)
    targets = [torch.randint(2, VOCAB, (global_batch, seq // 2), generator=g) for _ in range(2)]
    ids = [torch.randint(2, VOCAB, (global_batch, seq), generator=g) for _ in range(2)]
    if kind == "moe":
        allowed = _tokens_not_routed_to(moe(), MoE.SOMETIMES)
        ids[1] = allowed[torch.randint(0, len(allowed), (global_batch, seq), generator=g)]
    pool = list(zip(ids, targets))
    return [pool[i % 2] for i in range(steps)]


@torch.no_grad()
def _tokens_not_routed_to(model, expert, margin=1.0):
    """Token ids that no MoE layer sends to ``expert``, by at least ``margin`` in router
    logits (so the few training steps do not change it). Tokens do not interact in this
    model: a token's route is a function of its id alone."""
    x = model.emb(torch.arange(VOCAB))[:, None, :]
    ok = torch.ones(VOCAB, dtype=torch.bool)
    for layer in model.layers:
        logits = layer.router(layer.norm(x)).squeeze(1)
        others = torch.cat([logits[:, :expert], logits[:, expert + 1:]], dim=1).max(dim=1).values
        ok &= logits[:, expert] < others - margin
        x = layer(x)
    ok[:2] = False
    return ok.nonzero(as_tuple=True)[0]


def loss_of(model, kind, ids, targets):
    if kind in ("gpt2", "llama", "llama_frozen"):
        return model(input_ids=ids, labels=ids).loss
    if kind == "t5":
        return model(input_ids=ids, labels=targets).loss
    return model(ids, labels=ids)
