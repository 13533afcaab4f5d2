"""Multi-head self-attention built from ``nn.Linear`` projections (per-example gradients need no extra sampler)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SelfAttention(nn.Module):
    """Multi-head self-attention over the tokens of each example (no mask, no dropout).

    ``nn.MultiheadAttention`` owns its projection weights directly, outside any ``nn.Linear``;
    here the only parameters sit in two ``nn.Linear`` layers, whose per-example gradients the
    DP strategy computes from hooks. The attention mixes tokens of one example only.

    Args:
        d: Model width.
        heads: Number of heads; must divide ``d``.
    """

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"heads ({heads}) must divide the width ({d}).")
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[B, L, d]`` -> ``[B, L, d]``."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # 3 x [B, h, L, d/h]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))
