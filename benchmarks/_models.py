"""The one GPT-2 builder and the one batch maker of the benchmarks (and of scripts/).

``build(shape)`` makes Hugging Face's ``GPT2LMHeadModel`` of any ``Shape`` with its own
constructor, where it is called: under ``infinity.Init`` the engine partitions it as it is made
(the way a model larger than host memory is built), under ``torch.device("meta")`` it takes no
memory. ``Shape.of(layers, hidden)`` is a GPT-2-proportioned shape of any depth and width.

Note [identical contenders]: every contender of a benchmark trains the same model from the same
weights on the same batches. ``gpt2`` builds the model of a named size on the meta device,
materializes it on the CPU (``to_empty``) and draws its weights with GPT-2's own rule
(normal(0, 0.02); the residual projections ``c_proj`` scaled by 1/sqrt(2 x layers); biases 0;
LayerNorm 1 and 0), parameter by parameter, each from a generator seeded from ``seed`` and its
index. That is a few seconds for GPT-2 XL on many cores where Hugging Face's constructor, which
initializes every weight twice on one core, takes half a minute, and it gives the same tensors
whatever the thread count. Dropout is off, so two contenders' first losses agree to rounding.
``batches`` draws random tokens from its own seeded generator. Both take a named size or a
``Shape``; ``Shape.for_params(n)`` is a GPT-2-proportioned shape of about ``n`` parameters.
(``_blocks.GPTBlock``, one block of plain torch modules, is for the benchmarks that stack blocks
of their own.)
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Union

VOCAB = 50257  # GPT-2's


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    vocab: int = VOCAB
    positions: int = 1024

    @classmethod
    def of(cls, layers: int, hidden: int) -> "Shape":
        """GPT-2's proportions at any depth and width: heads of 64 dimensions, its vocabulary."""
        return cls(layers=layers, hidden=hidden, heads=hidden // 64)

    @classmethod
    def for_params(cls, params: float) -> "Shape":
        """GPT-2's proportions at about ``params`` parameters: the widest of the usual widths whose
        32 layers stay within it, then as many layers as reach it."""
        widths = [768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192]
        hidden = max([w for w in widths if w * w * 12 * 32 <= params] or [widths[0]])
        per_layer = 12 * hidden * hidden + 13 * hidden
        return cls.of(max(1, math.ceil((params - (VOCAB + 1024) * hidden) / per_layer)), hidden)

    @property
    def params(self) -> int:
        """GPT-2's parameter count at this shape (the head tied to the token embedding)."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.positions) * h + 2 * h

    @property
    def name(self) -> str:
        return f"{self.layers}x{self.hidden}"


SHAPES = {
    "tiny": Shape(layers=2, hidden=64, heads=2, vocab=512, positions=64),
    "124m": Shape(layers=12, hidden=768, heads=12),
    "1.3b": Shape(layers=24, hidden=2048, heads=32),
    "1.5b": Shape(layers=48, hidden=1600, heads=25),  # GPT-2 XL
}
INIT_STD = 0.02  # GPT2Config.initializer_range
Size = Union[str, Shape]


def shape_of(size: Size) -> Shape:
    if isinstance(size, Shape):
        return size
    try:
        return SHAPES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(SHAPES)}") from None


def param_count(model) -> int:
    """Distinct parameters (a tied weight once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def build(shape: Shape, user_defaults: bool = False):
    """``GPT2LMHeadModel`` of ``shape`` from Hugging Face's constructor (its own weight init, from
    torch's global generator), dropout off and no key/value cache; with ``user_defaults``,
    ``GPT2Config``'s own dropout and ``use_cache``, as users build it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet = {} if user_defaults else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    cfg = GPT2Config(vocab_size=shape.vocab, n_positions=shape.positions, n_embd=shape.hidden,
                     n_layer=shape.layers, n_head=shape.heads, initializer_range=INIT_STD,
                     bos_token_id=shape.vocab - 1, eos_token_id=shape.vocab - 1, **quiet)
    return GPT2LMHeadModel(cfg)


def gpt2(size: Size, seed: int = 0):
    """GPT-2 of ``size`` on the CPU in fp32, dropout off (Note [identical contenders])."""
    import torch

    shape = shape_of(size)
    with torch.device("meta"):
        model = build(shape)
    if any(True for _ in model.buffers()):  # to_empty would leave them unset
        raise RuntimeError("this transformers' GPT-2 has buffers; gpt2() materializes parameters only")
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty made the head's weight a tensor of its own
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("GPT-2's head is not tied to its token embedding after tie_weights()")
    _init_weights(model, shape, seed)
    return model.train()


def _init_weights(model, shape: Shape, seed: int) -> None:
    import torch

    params = list({id(p): (name, p) for name, p in model.named_parameters()}.values())
    proj_std = INIT_STD / math.sqrt(2 * shape.layers)

    def fill(index: int) -> None:
        name, p = params[index]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, proj_std if name.endswith("c_proj.weight") else INIT_STD, generator=gen)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # the fills release the GIL
        list(pool.map(fill, range(len(params))))


def batches(size: Size, micro_batch: int, seq_len: int, count: int, seed: int = 1) -> List["torch.Tensor"]:  # noqa: F821
    """``count`` batches of random token ids, (micro_batch, seq_len) int64 on the CPU."""
    import torch

    shape = shape_of(size)
    if seq_len > shape.positions:
        raise ValueError(f"--seq-len {seq_len} is longer than the {size} model's {shape.positions} positions")
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(shape.vocab, (micro_batch, seq_len), generator=gen) for _ in range(count)]

