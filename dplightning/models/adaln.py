"""AdaLN-Zero conditioning (DiT) with optional DP-aware bounds on the condition and the modulation.

DiT's AdaLN-Zero block reads a shift β, a scale γ and a gate α per branch from the
condition c. DP-aware AdaLN-Zero (Huang et al., arXiv 2602.22610) bounds them: c is
projected onto the L2 ball of radius ``c_max`` and every coordinate of γ, β, α is squashed
into [-x_max, x_max], so no conditioning context can make a per-example gradient arbitrarily
large. Every operation is per example: per-example gradients stay well defined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from dplightning.models.attention import SelfAttention

BoundMode = Literal["soft", "hard"]
_NORM_EPS = 1e-12


def bound(x: Tensor, x_max: float | None, mode: BoundMode = "soft") -> Tensor:
    """Bound every coordinate of ``x`` to [-x_max, x_max].

    Args:
        x: Any tensor.
        x_max: The bound; ``None`` leaves ``x`` unchanged (never ∞·tanh(x/∞), which is NaN).
        mode: ``"soft"``: x_max·tanh(x/x_max) (smooth, identity near 0); ``"hard"``: clamp.

    Returns:
        The bounded tensor.
    """
    if x_max is None:
        return x
    if mode == "soft":
        return x_max * torch.tanh(x / x_max)
    if mode == "hard":
        return x.clamp(-x_max, x_max)
    raise ValueError(f"bound mode must be 'soft' or 'hard', got {mode!r}.")


def project_l2_ball(c: Tensor, c_max: float | None) -> Tensor:
    """Project each row of ``c`` (``[B, d]``) onto the L2 ball of radius ``c_max`` (``None``: identity)."""
    if c_max is None:
        return c
    norm = torch.linalg.vector_norm(c, dim=-1, keepdim=True)
    return c * torch.clamp(c_max / (norm + _NORM_EPS), max=1.0)


class L2BallProjection(nn.Module):
    """:func:`project_l2_ball` as a module, so that a forward hook sees the pre-projection c̃ (its input).

    It has no parameters or buffers: a network's ``state_dict`` is the same with it as without it.

    Args:
        c_max: The radius; ``None``: the identity.
    """

    def __init__(self, c_max: float | None = None) -> None:
        super().__init__()
        if c_max is not None and not c_max > 0:
            raise ValueError(f"c_max must be positive or None, got {c_max}.")
        self.c_max = c_max

    def forward(self, c: Tensor) -> Tensor:
        return project_l2_ball(c, self.c_max)

    def extra_repr(self) -> str:
        return f"c_max={self.c_max}"


ModulationKind = Literal["gamma", "beta", "alpha"]


def modulate(h: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """DiT's ``h (1 + scale) + shift`` with one ``[B, d]`` modulation per example, broadcast over tokens."""
    return h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


@dataclass(frozen=True)
class ModulationBounds:
    """Per-coordinate bounds of the AdaLN modulation; ``None`` switches a bound off.

    Attributes:
        gamma_max: Bound of the scales γ.
        beta_max: Bound of the shifts β.
        alpha_max: Bound of the gates α.
        mode: ``"soft"`` (tanh, default) or ``"hard"`` (clamp).
    """

    gamma_max: float | None = None
    beta_max: float | None = None
    alpha_max: float | None = None
    mode: BoundMode = "soft"

    def __post_init__(self) -> None:
        for name in ("gamma_max", "beta_max", "alpha_max"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}.")
        if self.mode not in ("soft", "hard"):
            raise ValueError(f"mode must be 'soft' or 'hard', got {self.mode!r}.")

    def limit(self, kind: ModulationKind) -> float | None:
        """The bound of ``kind`` (``"gamma"``, ``"beta"`` or ``"alpha"``)."""
        return {"gamma": self.gamma_max, "beta": self.beta_max, "alpha": self.alpha_max}[kind]

    def shift(self, x: Tensor) -> Tensor:
        return bound(x, self.beta_max, self.mode)

    def scale(self, x: Tensor) -> Tensor:
        return bound(x, self.gamma_max, self.mode)

    def gate(self, x: Tensor) -> Tensor:
        return bound(x, self.alpha_max, self.mode)


def modulation_chunks(raw: Tensor, kinds: tuple[ModulationKind, ...]) -> list[tuple[ModulationKind, Tensor]]:
    """Each chunk of a raw (pre-bound) ``adaLN_modulation`` output ``[B, n·d]`` with its kind (``MODULATION_KINDS``)."""
    return list(zip(kinds, raw.chunk(len(kinds), dim=-1), strict=True))


def _mlp(d: int, mlp_ratio: float) -> nn.Sequential:
    hidden = int(d * mlp_ratio)
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d))


class AdaLNZeroBlock(nn.Module):
    """DiT block: self-attention and MLP branches, each modulated (β, γ) and gated (α) by the condition.

    The modulation Linear is zero-initialised by :meth:`zero_init` (called by the owning
    network), so every gate starts at 0 and the block at the identity.

    Args:
        d: Hidden size.
        heads: Attention heads.
        mlp_ratio: MLP width / d.
        bounds: Bounds of (γ, β, α); the default (all ``None``) is plain AdaLN-Zero.
    """

    MODULATION_KINDS: tuple[ModulationKind, ...] = ("beta", "gamma", "alpha", "beta", "gamma", "alpha")
    """What each of the ``adaLN_modulation`` output's chunks is, in DiT's order (shift, scale, gate; twice)."""

    def __init__(self, d: int, heads: int, mlp_ratio: float = 4.0, bounds: ModulationBounds | None = None) -> None:
        super().__init__()
        self.bounds = bounds or ModulationBounds()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(d, heads)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = _mlp(d, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def zero_init(self) -> None:
        nn.init.zeros_(self.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.adaLN_modulation[-1].bias)

    def modulation(self, c: Tensor) -> tuple[Tensor, ...]:
        """The bounded ``(shift1, scale1, gate1, shift2, scale2, gate2)``, each ``[B, d]``, in DiT's order."""
        b1, g1, a1, b2, g2, a2 = self.adaLN_modulation(c).chunk(6, dim=-1)
        s = self.bounds
        return s.shift(b1), s.scale(g1), s.gate(a1), s.shift(b2), s.scale(g2), s.gate(a2)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """``x``: tokens ``[B, L, d]``; ``c``: condition ``[B, d]``."""
        b1, g1, a1, b2, g2, a2 = self.modulation(c)
        x = x + a1.unsqueeze(1) * self.attn(modulate(self.norm1(x), b1, g1))
        return x + a2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), b2, g2))


class AdaLNFinalLayer(nn.Module):
    """DiT's final layer: LayerNorm, (β, γ) modulation (bounded like the blocks), Linear to the outputs.

    Args:
        d: Hidden size.
        out: Output features per token.
        bounds: Bounds of (γ, β); the gate bound is unused here.
    """

    MODULATION_KINDS: tuple[ModulationKind, ...] = ("beta", "gamma")
    """What each of the ``adaLN_modulation`` output's chunks is (shift, scale)."""

    def __init__(self, d: int, out: int, bounds: ModulationBounds | None = None) -> None:
        super().__init__()
        self.bounds = bounds or ModulationBounds()
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.linear = nn.Linear(d, out)

    def zero_init(self) -> None:
        for layer in (self.adaLN_modulation[-1], self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def modulation(self, c: Tensor) -> tuple[Tensor, Tensor]:
        """The bounded ``(shift, scale)``, each ``[B, d]``."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.bounds.shift(shift), self.bounds.scale(scale)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.modulation(c)
        return self.linear(modulate(self.norm(x), shift, scale))
