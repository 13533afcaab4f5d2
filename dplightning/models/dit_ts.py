"""A DiT-style ε-prediction network for multivariate time series, with DP-aware AdaLN-Zero bounds.

Tokens are time steps (``patch_size=1``, the spec's layout) or patches of ``patch_size``
consecutive time steps (as PatchTST; far cheaper on a CPU). Each time step contributes the
observed values ``M_c ⊙ X``, the noisy unobserved values ``(1 - M_c) ⊙ x_t`` and the
conditioning mask ``M_c``; each token also gets a sinusoidal embedding of its position.
That is CSDI's side information minus its learned feature embedding: with all variables
of a time step in one token, that embedding is the same for every token and example and
would only add a constant that the input bias already provides. The global condition is
c = t_emb(t) + ctx(M_c ⊙ X, M_c), where ctx is a per-time-step Linear, GELU, mean over time
and a Linear. With ``c_max`` / ``gamma_max`` / ``beta_max`` / ``alpha_max`` set, c is
projected onto the L2 ball and the modulation is bounded (DP-aware AdaLN-Zero); with all of
them ``None`` this is plain AdaLN-Zero.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dplightning.models.adaln import AdaLNFinalLayer, AdaLNZeroBlock, BoundMode, ModulationBounds, project_l2_ball
from dplightning.models.embeddings import TimestepEmbedder, sinusoidal_embedding

CONDITIONING_PATTERNS = ["*t_embedder*", "*ctx_encoder*", "*adaLN_modulation*"]
"""Parameter-name globs of the conditioning path, for ``GradientTailStats(groups={"cond": ...})``."""


class ContextEncoder(nn.Module):
    """``(M_c ⊙ X, M_c)`` ``[B, L, K]`` each -> ``[B, d]``: per-token Linear, GELU, mean over time, Linear.

    The mean is over the time steps of one example, never over the batch.
    """

    def __init__(self, num_features: int, d: int) -> None:
        super().__init__()
        self.token = nn.Linear(2 * num_features, d)
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(d, d)

    def forward(self, observed: Tensor, cond_mask: Tensor) -> Tensor:
        h = self.act(self.token(torch.cat([observed, cond_mask], dim=-1)))
        return self.out(h.mean(dim=1))


class TimeSeriesDiT(nn.Module):
    """ε-prediction DiT over time-step tokens, conditioned through (optionally bounded) AdaLN-Zero.

    Args:
        num_features: Variables K per time step (7 for ETT).
        hidden: Width d.
        depth: Number of AdaLN-Zero blocks.
        heads: Attention heads.
        mlp_ratio: MLP width / d.
        position_dim: Width of the sinusoidal position embedding fed to every token.
        patch_size: Time steps per token; the window length must be a multiple of it.
        c_max: Radius of the L2 ball the condition c is projected onto (the spec's default is
            √d); ``None``: no projection.
        gamma_max: Per-coordinate bound of the scales γ; ``None``: unbounded.
        beta_max: Per-coordinate bound of the shifts β; ``None``: unbounded.
        alpha_max: Per-coordinate bound of the gates α; ``None``: unbounded.
        bound_mode: ``"soft"`` (x_max·tanh(x/x_max)) or ``"hard"`` (clamp).
    """

    def __init__(
        self,
        num_features: int = 7,
        hidden: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: float = 4.0,
        position_dim: int = 32,
        patch_size: int = 1,
        c_max: float | None = None,
        gamma_max: float | None = None,
        beta_max: float | None = None,
        alpha_max: float | None = None,
        bound_mode: BoundMode = "soft",
    ) -> None:
        super().__init__()
        if c_max is not None and not c_max > 0:
            raise ValueError(f"c_max must be positive or None, got {c_max}.")
        self.num_features = num_features
        self.position_dim = position_dim
        self.patch_size = patch_size
        self.c_max = c_max
        bounds = ModulationBounds(gamma_max, beta_max, alpha_max, bound_mode)
        self.x_embedder = nn.Linear(3 * num_features * patch_size + position_dim, hidden)
        self.t_embedder = TimestepEmbedder(hidden)
        self.ctx_encoder = ContextEncoder(num_features, hidden)
        self.blocks = nn.ModuleList(AdaLNZeroBlock(hidden, heads, mlp_ratio, bounds) for _ in range(depth))
        self.final_layer = AdaLNFinalLayer(hidden, num_features * patch_size, bounds)
        self.init_weights()

    def init_weights(self) -> None:
        """DiT's init: xavier-uniform Linears, zero biases, N(0, 0.02) timestep MLP, zero modulation and output."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        self.t_embedder.init_weights()
        for block in self.blocks:
            block.zero_init()
        self.final_layer.zero_init()

    def condition(self, t: Tensor, observed: Tensor, cond_mask: Tensor) -> Tensor:
        """c = t_emb(t) + ctx(M_c ⊙ X, M_c), projected onto the ball of radius ``c_max``: ``[B, d]``."""
        return project_l2_ball(self.t_embedder(t) + self.ctx_encoder(observed, cond_mask), self.c_max)

    def forward(self, noisy: Tensor, observed: Tensor, cond_mask: Tensor, t: Tensor) -> Tensor:
        """Predict the noise.

        Args:
            noisy: ``(1 - M_c) ⊙ x_t``, ``[B, L, K]``.
            observed: ``M_c ⊙ X``, ``[B, L, K]``.
            cond_mask: ``M_c`` (1 = observed and given as condition), ``[B, L, K]``.
            t: Diffusion steps, ``[B]`` (integers).

        Returns:
            ε̂, ``[B, L, K]`` (only its unobserved entries are used).
        """
        b, length, k = noisy.shape
        if length % self.patch_size:
            raise ValueError(f"Window length {length} is not a multiple of patch_size {self.patch_size}.")
        n = length // self.patch_size
        steps = torch.cat([observed, noisy, cond_mask], dim=-1).reshape(b, n, 3 * k * self.patch_size)  # [B, n, P·3K]
        positions = sinusoidal_embedding(torch.arange(n, device=noisy.device), self.position_dim)
        x = self.x_embedder(torch.cat([steps, positions.expand(b, n, -1)], dim=-1))
        c = self.condition(t, observed, cond_mask)
        for block in self.blocks:
            x = block(x, c)
        return self.final_layer(x, c).reshape(b, length, k)
