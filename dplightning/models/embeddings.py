"""Sinusoidal embeddings (diffusion step, time position) and DiT's timestep embedder."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_embedding(positions: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """DiT's ``[cos, sin]`` embedding of (possibly fractional) positions: ``[...]`` -> ``[..., dim]``.

    Frequencies are exp(-ln(max_period)·i/half), i = 0..half-1; an odd ``dim`` gets a zero column.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    args = positions.float().unsqueeze(-1) * freqs
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[..., :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    """Diffusion step t -> ``[B, d]``: sinusoidal (``frequency_dim``), then Linear, SiLU, Linear (DiT).

    Args:
        d: Output width.
        frequency_dim: Width of the sinusoidal embedding.
    """

    def __init__(self, d: int, frequency_dim: int = 256) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.init_weights()

    def init_weights(self) -> None:
        """DiT's N(0, 0.02) weights and zero biases."""
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(sinusoidal_embedding(t, self.frequency_dim))
