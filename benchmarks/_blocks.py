"""One GPT-style block of plain torch modules, for the benchmarks that build a stack of their own
(``tiling``: one block under a device budget; ``activation_offload``: checkpointed blocks)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class GPTBlock(nn.Module):
    """LayerNorm, attention h -> 3h -> h (heads of 64), LayerNorm, MLP h -> 4h -> h."""

    def __init__(self, h: int):
        super().__init__()
        self.heads = max(1, h // 64)
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def mlp_params(h: int) -> int:
    """The block's largest operator, h -> 4h with its bias."""
    return 4 * h * h + 4 * h


class CheckpointedStack(nn.Module):
    """``layers`` blocks of width ``h``, each under torch.utils.checkpoint (non-reentrant); the
    loss is the output's mean square."""

    def __init__(self, h: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(h) for _ in range(layers))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.pow(2).mean()
