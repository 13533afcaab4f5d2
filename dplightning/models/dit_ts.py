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

Two layout options beside the spec's (the defaults): ``context_path="c_only"`` takes the
observed values out of the tokens (they carry the noisy targets, the mask and the position),
so the context reaches the network only through c and hence only through the bounded
modulation; ``project="ctx"`` projects ctx alone, c = t_emb(t) + Π(ctx), so the ball bounds
the data-dependent part and not the diffusion step's embedding. ``context_encoder="flatten"``
replaces the mean over time (which cannot tell one time step from another) by a Linear of
the whole flattened context, which can express a linear forecaster.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from dplightning.models.adaln import AdaLNFinalLayer, AdaLNZeroBlock, BoundMode, L2BallProjection, ModulationBounds
from dplightning.models.embeddings import TimestepEmbedder, sinusoidal_embedding

ContextPath = Literal["tokens_and_c", "c_only"]
Projection = Literal["t_emb+ctx", "ctx"]
ContextEncoderKind = Literal["mean", "flatten"]
CONTEXT_PATHS: tuple[str, ...] = ("tokens_and_c", "c_only")
PROJECTIONS: tuple[str, ...] = ("t_emb+ctx", "ctx")
CONTEXT_ENCODERS: tuple[str, ...] = ("mean", "flatten")

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


class FlatContextEncoder(nn.Module):
    """``(M_c ⊙ X, M_c)`` ``[B, L, K]`` each -> ``[B, d]``: Linear of the flattened window, GELU, Linear.

    Unlike the mean over time it keeps where in the window each value lies (a linear forecaster
    is one of its functions); it needs the window length at construction. Per example only.
    """

    def __init__(self, num_features: int, d: int, window: int) -> None:
        super().__init__()
        self.window = window
        self.token = nn.Linear(2 * num_features * window, d)
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(d, d)

    def forward(self, observed: Tensor, cond_mask: Tensor) -> Tensor:
        if observed.shape[1] != self.window:
            raise ValueError(
                f"context_encoder='flatten' was built for windows of {self.window}, got {observed.shape[1]}."
            )
        return self.out(self.act(self.token(torch.cat([observed, cond_mask], dim=-1).flatten(1))))


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
        context_path: ``"tokens_and_c"`` (the spec's layout: the tokens carry ``M_c ⊙ X`` and c
            gets ctx) or ``"c_only"`` (the tokens carry ``(1 - M_c) ⊙ x_t``, ``M_c`` and the
            position only; the observed values reach the network through c alone).
        project: What the L2 ball of radius ``c_max`` bounds: ``"t_emb+ctx"`` (the spec's
            c = Π(t_emb + ctx)) or ``"ctx"`` (c = t_emb + Π(ctx): the data-independent step
            embedding is left alone).
        context_encoder: ``"mean"`` (per-time-step Linear, GELU, mean over time, Linear; the
            default) or ``"flatten"`` (Linear of the flattened window, GELU, Linear; needs
            ``window``).
        window: Window length L, required by ``context_encoder="flatten"``.
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
        context_path: ContextPath = "tokens_and_c",
        project: Projection = "t_emb+ctx",
        context_encoder: ContextEncoderKind = "mean",
        window: int | None = None,
    ) -> None:
        super().__init__()
        _check_choice("context_path", context_path, CONTEXT_PATHS)
        _check_choice("project", project, PROJECTIONS)
        _check_choice("context_encoder", context_encoder, CONTEXT_ENCODERS)
        if context_encoder == "flatten" and (window is None or window < 1):
            raise ValueError(f"context_encoder='flatten' needs the window length: window=L, got {window}.")
        self.context_path = context_path
        self.project = project
        self.num_features = num_features
        self.position_dim = position_dim
        self.patch_size = patch_size
        self.projection = L2BallProjection(c_max)  # a module: a forward hook sees c̃ (bind statistics)
        bounds = ModulationBounds(gamma_max, beta_max, alpha_max, bound_mode)
        self.token_channels = 3 if context_path == "tokens_and_c" else 2  # (observed,) noisy, mask per variable
        self.x_embedder = nn.Linear(self.token_channels * num_features * patch_size + position_dim, hidden)
        self.t_embedder = TimestepEmbedder(hidden)
        self.ctx_encoder: nn.Module = (
            ContextEncoder(num_features, hidden)
            if context_encoder == "mean"
            else FlatContextEncoder(num_features, hidden, window)  # type: ignore[arg-type]
        )
        self.blocks = nn.ModuleList(AdaLNZeroBlock(hidden, heads, mlp_ratio, bounds) for _ in range(depth))
        self.final_layer = AdaLNFinalLayer(hidden, num_features * patch_size, bounds)
        self.init_weights()

    @property
    def c_max(self) -> float | None:
        """The radius of the condition's L2 ball (``None``: no projection)."""
        return self.projection.c_max

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
        """c = Π(t_emb(t) + ctx(M_c ⊙ X, M_c)) or, with ``project="ctx"``, t_emb(t) + Π(ctx): ``[B, d]``.

        Π is the projection onto the L2 ball of radius ``c_max`` (the identity without it).
        """
        t_emb, ctx = self.t_embedder(t), self.ctx_encoder(observed, cond_mask)
        if self.project == "ctx":
            return t_emb + self.projection(ctx)
        return self.projection(t_emb + ctx)

    def token_inputs(self, noisy: Tensor, observed: Tensor, cond_mask: Tensor) -> Tensor:
        """What ``x_embedder`` reads, ``[B, L / patch_size, channels·K·patch_size + position_dim]``.

        Per time step: ``(M_c ⊙ X, (1 - M_c) ⊙ x_t, M_c)`` with ``context_path="tokens_and_c"``,
        ``((1 - M_c) ⊙ x_t, M_c)`` with ``"c_only"`` (the observed values never enter a token);
        then the patch's sinusoidal position.
        """
        b, length, k = noisy.shape
        if length % self.patch_size:
            raise ValueError(f"Window length {length} is not a multiple of patch_size {self.patch_size}.")
        n = length // self.patch_size
        parts = [observed, noisy, cond_mask] if self.context_path == "tokens_and_c" else [noisy, cond_mask]
        steps = torch.cat(parts, dim=-1).reshape(b, n, self.token_channels * k * self.patch_size)
        positions = sinusoidal_embedding(torch.arange(n, device=noisy.device), self.position_dim)
        return torch.cat([steps, positions.expand(b, n, -1)], dim=-1)

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
        x = self.x_embedder(self.token_inputs(noisy, observed, cond_mask))
        c = self.condition(t, observed, cond_mask)
        for block in self.blocks:
            x = block(x, c)
        return self.final_layer(x, c).reshape(b, length, k)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")
