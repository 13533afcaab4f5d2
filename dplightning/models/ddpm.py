"""The DDPM noise schedule and ancestral sampler of CSDI (50 steps, "quad" schedule)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Denoiser = Callable[[Tensor, Tensor], Tensor]
"""``(x_t, t) -> ε̂``, with ``t`` a ``[B]`` tensor of integer steps."""


def quad_betas(steps: int = 50, beta_start: float = 1e-4, beta_end: float = 0.5) -> Tensor:
    """CSDI's "quad" schedule: β_t = linspace(√β_start, √β_end, steps)_t², float64."""
    return torch.linspace(beta_start**0.5, beta_end**0.5, steps, dtype=torch.float64) ** 2


class DDPMSchedule(nn.Module):
    """β_t, ᾱ_t and the two DDPM operations (forward noising, one reverse step).

    The schedule is kept in non-persistent buffers so that it follows the module's device
    and stays out of checkpoints.

    Args:
        steps: Diffusion steps T.
        beta_start: β_0.
        beta_end: β_{T-1}.
    """

    betas: Tensor
    alpha_bars: Tensor

    def __init__(self, steps: int = 50, beta_start: float = 1e-4, beta_end: float = 0.5) -> None:
        super().__init__()
        betas = quad_betas(steps, beta_start, beta_end)
        self.steps = steps
        self.register_buffer("betas", betas.float(), persistent=False)
        self.register_buffer("alpha_bars", torch.cumprod(1 - betas, 0).float(), persistent=False)

    def noise(self, x0: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        """x_t = √ᾱ_t·x_0 + √(1-ᾱ_t)·ε, with one step t per example (``[B]``)."""
        a = self.alpha_bars[t].view(-1, *([1] * (x0.dim() - 1)))
        return a.sqrt() * x0 + (1 - a).sqrt() * eps

    def reverse_step(
        self,
        x: Tensor,
        t: int,
        eps_hat: Tensor,
        generator: torch.Generator | None = None,
        clip_denoised: float | None = None,
    ) -> Tensor:
        """One ancestral step t -> t-1: mean from ε̂, plus √β̃_t·z for t > 0.

        With ``clip_denoised`` the mean is the posterior mean μ̃(x_t, x̂_0) with the implied
        x̂_0 = (x_t − √(1−ᾱ_t)·ε̂)/√ᾱ_t clamped to [−clip, clip] (Ho et al.'s ``clip_denoised``);
        without clamping both forms are the same mean. CSDI does not clamp (``None``).
        """
        beta, a = self.betas[t], self.alpha_bars[t]
        if clip_denoised is None:
            x = (x - beta / (1 - a).sqrt() * eps_hat) / (1 - beta).sqrt()
        else:
            x0 = ((x - (1 - a).sqrt() * eps_hat) / a.sqrt()).clamp(-clip_denoised, clip_denoised)
            a_prev = self.alpha_bars[t - 1] if t > 0 else torch.ones_like(a)
            x = (a_prev.sqrt() * beta * x0 + (1 - beta).sqrt() * (1 - a_prev) * x) / (1 - a)
        if t > 0:
            variance = (1 - self.alpha_bars[t - 1]) / (1 - a) * beta
            z = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            x = x + variance.sqrt() * z
        return x

    @torch.no_grad()
    def sample(
        self,
        denoiser: Denoiser,
        shape: torch.Size,
        device: torch.device,
        generator: torch.Generator | None = None,
        clip_denoised: float | None = None,
    ) -> Tensor:
        """Run the reverse chain from x ~ N(0, I) for all T steps (``clip_denoised``: see :meth:`reverse_step`)."""
        x = torch.randn(shape, generator=generator, device=device)
        for t in reversed(range(self.steps)):
            steps = torch.full((shape[0],), t, device=device, dtype=torch.long)
            x = self.reverse_step(x, t, denoiser(x, steps), generator, clip_denoised)
        return x
