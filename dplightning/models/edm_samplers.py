"""Samplers of DPDM's ``samplers.py``: DDIM (Euler on the probability-flow ODE), stochastic DDIM, EDM's Heun with churn.

A sampler takes a denoiser ``D(x, σ) -> x̂`` (σ a scalar tensor), the start noise and the
σ grid, and returns the sample. :func:`guided` turns a class-conditional denoiser into such
a callable with classifier-free guidance; :func:`sample` is the one entry point by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

DenoiseFn = Callable[[Tensor, Tensor], Tensor]
"""``(x [B, ...], σ scalar) -> D(x; σ)``."""


def edm_time_grid(steps: int, t_min: float = 0.002, t_max: float = 80.0, rho: float = 7.0) -> Tensor:
    """t_i = (t_max^{1/ρ} + i/(N−1)·(t_min^{1/ρ} − t_max^{1/ρ}))^ρ for i = 0..N−1 (float64, t_0 = t_max)."""
    if steps < 2:
        raise ValueError(f"The time grid needs at least 2 steps, got {steps}.")
    i = torch.arange(steps, dtype=torch.float64)
    return (t_max ** (1 / rho) + i / (steps - 1) * (t_min ** (1 / rho) - t_max ** (1 / rho))) ** rho


def _randn(like: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.randn(like.shape, generator=generator, dtype=like.dtype).to(like.device)


@torch.no_grad()
def ddim(
    denoise: DenoiseFn, noise: Tensor, grid: Tensor, stochastic: bool = False, generator: torch.Generator | None = None
) -> Tensor:
    """N−1 Euler steps of dx/dt = (x − D(x, t))/t from x = t_0·noise, then x ← D(x, t_{N−1}).

    With ``stochastic`` the steps are Euler–Maruyama on the reverse SDE:
    x ← x + 2·dt·(x − D)/t + √(2·|dt|·t)·ε.
    """
    t = grid.tolist()
    x = t[0] * noise
    for i in range(len(t) - 1):
        ti, dt = t[i], t[i + 1] - t[i]
        d = (x - denoise(x, noise.new_tensor(ti))) / ti
        if stochastic:
            x = x + 2 * dt * d + math.sqrt(2 * abs(dt) * ti) * _randn(x, generator)
        else:
            x = x + dt * d
    return denoise(x, noise.new_tensor(t[-1]))


@torch.no_grad()
def edm(
    denoise: DenoiseFn,
    noise: Tensor,
    grid: Tensor,
    s_churn: float = 0.0,
    s_min: float = 0.0,
    s_max: float = float("inf"),
    s_noise: float = 1.0,
    churn_limit: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """EDM's stochastic Heun sampler (Karras et al., Alg. 2) with DPDM's churn cap of 1.

    ``s_churn=0`` is the deterministic Heun sampler.
    """
    t = [*grid.tolist(), 0.0]
    n = len(t) - 1
    x = t[0] * noise
    for i in range(n):
        gamma = min(s_churn / n, churn_limit) if s_min <= t[i] <= s_max else 0.0
        th = t[i] * (1 + gamma)
        xh = x + s_noise * math.sqrt(th**2 - t[i] ** 2) * _randn(x, generator) if gamma > 0 else x
        d = (xh - denoise(xh, noise.new_tensor(th))) / th
        x = xh + (t[i + 1] - th) * d
        if i < n - 1:
            d2 = (x - denoise(x, noise.new_tensor(t[i + 1]))) / t[i + 1]
            x = xh + (t[i + 1] - th) * (d + d2) / 2
    return x


def heun(denoise: DenoiseFn, noise: Tensor, grid: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Deterministic Heun on the probability-flow ODE (EDM without churn)."""
    return edm(denoise, noise, grid, s_churn=0.0, generator=generator)


SAMPLERS: dict[str, Callable[..., Tensor]] = {"ddim": ddim, "heun": heun, "edm": edm}


def guided(
    denoiser: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    labels: Tensor | None,
    guidance: float = 0.0,
    null_label: int | None = None,
) -> DenoiseFn:
    """D_g = (1 + w)·D(x, σ, y) − w·D(x, σ, ∅), conditional and unconditional rows in one forward.

    Args:
        denoiser: ``(x, σ, labels) -> x̂``.
        labels: Class labels ``[B]`` (``None``: unconditional).
        guidance: w (0 = plain conditional sampling).
        null_label: The "no class" label ∅ (needed when ``guidance != 0``).
    """
    if guidance == 0 or labels is None:
        return lambda x, sigma: denoiser(x, sigma, labels)
    if null_label is None:
        raise ValueError("Classifier-free guidance needs the 'no class' label (null_label).")
    both = torch.cat([labels, torch.full_like(labels, null_label)])

    def denoise(x: Tensor, sigma: Tensor) -> Tensor:
        cond, uncond = denoiser(torch.cat([x, x]), sigma, both).chunk(2)
        return (1 + guidance) * cond - guidance * uncond

    return denoise


def sample(
    denoise: DenoiseFn,
    shape: tuple[int, ...],
    sampler: str = "ddim",
    steps: int = 50,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    **options: Any,
) -> Tensor:
    """Draw ``shape`` samples with the sampler named ``sampler`` (``"ddim"``, ``"heun"``, ``"edm"``) on an N-step grid.

    ``options`` go to the sampler (``stochastic`` for DDIM; ``s_churn``, ``s_min``, ``s_max``,
    ``s_noise``, ``churn_limit`` for EDM).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"Unknown sampler {sampler!r}; choose one of {sorted(SAMPLERS)}.")
    noise = torch.randn(shape, generator=generator).to(device)
    return SAMPLERS[sampler](denoise, noise, edm_time_grid(steps), generator=generator, **options)
