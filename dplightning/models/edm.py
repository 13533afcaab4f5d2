"""EDM preconditioning (Karras et al. 2022) as DPDM uses it, the V variant, and DPDM's weight EMA.

The denoiser is D(x; σ, y) = c_skip(σ)·x + c_out(σ)·F(c_in(σ)·x, c_noise(σ), y); the loss
weight λ(σ) makes λ·c_out² = 1. DPDM keeps σ_data = √(1/3), the std of U[−1, 1] (EDM's own
default is 0.5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

SIGMA_DATA = math.sqrt(1.0 / 3.0)
Parameterization = Literal["edm", "v"]


def _col(sigma: Tensor, like: Tensor) -> Tensor:
    """σ of shape ``[B]`` broadcast against ``[B, ...]``."""
    return sigma.reshape(-1, *([1] * (like.dim() - 1)))


class EDMPreconditioning:
    """c_skip, c_out, c_in, c_noise, the training σ distribution and the loss weight λ of EDM.

    Args:
        sigma_data: σ_data (DPDM: √(1/3)).
        p_mean: Mean of ln σ during training.
        p_std: Std of ln σ during training.
    """

    def __init__(self, sigma_data: float = SIGMA_DATA, p_mean: float = -1.2, p_std: float = 1.2) -> None:
        self.sigma_data = sigma_data
        self.p_mean = p_mean
        self.p_std = p_std

    def c_skip(self, sigma: Tensor) -> Tensor:
        """σ_d² / (σ² + σ_d²)."""
        return self.sigma_data**2 / (sigma**2 + self.sigma_data**2)

    def c_out(self, sigma: Tensor) -> Tensor:
        """σ·σ_d / √(σ² + σ_d²)."""
        return sigma * self.sigma_data / (sigma**2 + self.sigma_data**2).sqrt()

    def c_in(self, sigma: Tensor) -> Tensor:
        """1 / √(σ² + σ_d²)."""
        return 1 / (sigma**2 + self.sigma_data**2).sqrt()

    def c_noise(self, sigma: Tensor) -> Tensor:
        """¼·ln σ, the network's "time" input."""
        return sigma.log() / 4

    def weight(self, sigma: Tensor) -> Tensor:
        """λ(σ) = (σ² + σ_d²) / (σ·σ_d)²."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def sample_sigma(
        self, n: int, generator: torch.Generator | None = None, device: torch.device | None = None
    ) -> Tensor:
        """n draws of σ with ln σ ~ N(P_mean, P_std²)."""
        z = torch.randn(n, generator=generator).to(device)
        return (self.p_mean + self.p_std * z).exp()


class VPreconditioning:
    """DPDM's V-parameterization (used for ε = 0.2): t ~ U[t_min, t_max], σ = tan(πt/2).

    Args:
        logsnr_min: Smallest log-SNR (sets t_max).
        logsnr_max: Largest log-SNR (sets t_min).
    """

    sigma_data = 1.0

    def __init__(self, logsnr_min: float = -9.0, logsnr_max: float = 13.0) -> None:
        self.t_min = self.t_of_logsnr(logsnr_max)
        self.t_max = self.t_of_logsnr(logsnr_min)

    @staticmethod
    def t_of_logsnr(logsnr: float) -> float:
        """t(λ) = (2/π)·arccos(1/√(1 + e^{−λ}))."""
        return 2 / math.pi * math.acos(1 / math.sqrt(1 + math.exp(-logsnr)))

    @staticmethod
    def sigma_of_t(t: Tensor) -> Tensor:
        """σ(t) = tan(πt/2)."""
        return torch.tan(math.pi * t / 2)

    def c_skip(self, sigma: Tensor) -> Tensor:
        """1 / (σ² + 1)."""
        return 1 / (sigma**2 + 1)

    def c_out(self, sigma: Tensor) -> Tensor:
        """σ / √(1 + σ²)."""
        return sigma / (1 + sigma**2).sqrt()

    def c_in(self, sigma: Tensor) -> Tensor:
        """1 / √(1 + σ²)."""
        return 1 / (1 + sigma**2).sqrt()

    def c_noise(self, sigma: Tensor) -> Tensor:
        """(2/π)·arccos(1/√(1 + σ²)), which is t."""
        return 2 / math.pi * torch.acos(1 / (1 + sigma**2).sqrt())

    def weight(self, sigma: Tensor) -> Tensor:
        """(σ² + 1) / σ²."""
        return (sigma**2 + 1) / sigma**2

    def sample_sigma(
        self, n: int, generator: torch.Generator | None = None, device: torch.device | None = None
    ) -> Tensor:
        """σ(t) for t ~ U[t_min, t_max]."""
        t = self.t_min + (self.t_max - self.t_min) * torch.rand(n, generator=generator)
        return self.sigma_of_t(t).to(device)


Preconditioning = EDMPreconditioning | VPreconditioning


def make_preconditioning(kind: Parameterization = "edm") -> Preconditioning:
    """The preconditioning named ``kind`` (``"edm"`` or ``"v"``) with DPDM's constants."""
    if kind == "edm":
        return EDMPreconditioning()
    if kind == "v":
        return VPreconditioning()
    raise ValueError(f"Unknown parameterization {kind!r}; choose 'edm' or 'v'.")


class Denoiser(nn.Module):
    """D(x; σ, y) = c_skip·x + c_out·F(c_in·x, c_noise, y) around a network ``F(x, c_noise, y)``.

    Args:
        net: The raw network (e.g. :class:`dplightning.models.NCSNppUNet`).
        parameterization: ``"edm"`` (default) or ``"v"``.
    """

    def __init__(self, net: nn.Module, parameterization: Parameterization = "edm") -> None:
        super().__init__()
        self.net = net
        self.precond = make_preconditioning(parameterization)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor | None = None) -> Tensor:
        """Denoised estimate of x from ``x`` ``[B, C, H, W]`` at noise level ``sigma`` (``[B]`` or scalar)."""
        sigma = sigma.to(x.dtype).expand(x.shape[0]) if sigma.dim() == 0 else sigma.to(x.dtype)
        p, s = self.precond, _col(sigma, x)
        return p.c_skip(s) * x + p.c_out(s) * self.net(p.c_in(s) * x, p.c_noise(sigma), labels)

    def loss_per_row(
        self,
        x: Tensor,
        labels: Tensor | None,
        sigma: Tensor,
        noise: Tensor,
        denoise: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None,
    ) -> Tensor:
        """λ(σ)·mean over pixels of (D(x + σn; σ, y) − x)², one value per row (``[B]``).

        ``denoise`` replaces this module's forward (e.g. the same network with EMA weights).
        """
        denoised = (denoise or self)(x + _col(sigma, x) * noise, sigma, labels)
        return self.precond.weight(sigma) * (denoised - x).square().flatten(1).mean(1)


def ema_decay(n: int, max_decay: float = 0.999) -> float:
    """DPDM's EMA warm-up: d = min(max_decay, (1 + n)/(10 + n)), n counting updates from 1."""
    return min(max_decay, (1 + n) / (10 + n))


class EMA(nn.Module):
    """Shadow copies of a module's trainable parameters, as buffers (so they checkpoint and move with it).

    Buffers, not parameters: the optimizer and the DP strategy never see them. Update with
    ``shadow ← shadow − (1 − d)(shadow − θ)`` after every optimizer step.

    Args:
        module: The module whose parameters are averaged.
        max_decay: The decay cap (DPDM: 0.999).
    """

    updates: Tensor

    def __init__(self, module: nn.Module, max_decay: float = 0.999) -> None:
        super().__init__()
        self.max_decay = max_decay
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in trainable]
        self._keys = [f"shadow_{i}" for i in range(len(trainable))]  # buffer names may not contain dots
        for key, (_, p) in zip(self._keys, trainable, strict=True):
            self.register_buffer(key, p.detach().clone())
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, module: nn.Module) -> float:
        """One EMA step towards ``module``'s current parameters; returns the decay used."""
        self.updates += 1
        decay = ema_decay(int(self.updates), self.max_decay)
        params = dict(module.named_parameters())
        for name, key in zip(self.names, self._keys, strict=True):
            shadow = getattr(self, key)
            shadow.sub_((1 - decay) * (shadow - params[name].detach()))
        return decay

    @property
    def dp_public_buffers(self) -> set[str]:
        """The shadows and the update count: post-processing of the released weights, written between steps."""
        return {*self._keys, "updates"}

    def shadow(self) -> dict[str, Tensor]:
        """``{parameter name: averaged value}``, for ``torch.func.functional_call``."""
        return {name: getattr(self, key) for name, key in zip(self.names, self._keys, strict=True)}
