"""EDM preconditioning, DPDM's U-Net and EMA, and the samplers on a 2-D Gaussian mixture with an analytic denoiser."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from dplightning.models import EMA, Denoiser, EDMPreconditioning, NCSNppUNet, VPreconditioning
from dplightning.models.edm import SIGMA_DATA, ema_decay
from dplightning.models.edm_samplers import ddim, edm, edm_time_grid, guided, heun, sample

SIGMAS = torch.tensor([0.002, 0.05, 0.3, SIGMA_DATA, 1.0, 5.0, 80.0], dtype=torch.float64)


def test_edm_coefficients_follow_the_spec() -> None:
    p, sd = EDMPreconditioning(), math.sqrt(1 / 3)
    assert p.sigma_data == pytest.approx(sd)
    for s in SIGMAS.tolist():
        t = torch.tensor(s, dtype=torch.float64)
        assert float(p.c_skip(t)) == pytest.approx(sd**2 / (s**2 + sd**2))
        assert float(p.c_out(t)) == pytest.approx(s * sd / math.sqrt(sd**2 + s**2))
        assert float(p.c_in(t)) == pytest.approx(1 / math.sqrt(sd**2 + s**2))
        assert float(p.c_noise(t)) == pytest.approx(math.log(s) / 4)
        assert float(p.weight(t)) == pytest.approx((s**2 + sd**2) / (s * sd) ** 2)
    torch.testing.assert_close(p.weight(SIGMAS) * p.c_out(SIGMAS) ** 2, torch.ones_like(SIGMAS))
    assert float(p.c_skip(torch.tensor(sd))) == pytest.approx(0.5)


def test_edm_sigma_is_log_normal() -> None:
    log_sigma = EDMPreconditioning().sample_sigma(20000, torch.Generator().manual_seed(0)).log()
    assert float(log_sigma.mean()) == pytest.approx(-1.2, abs=0.03)
    assert float(log_sigma.std()) == pytest.approx(1.2, abs=0.03)


def test_v_parameterization() -> None:
    v = VPreconditioning()
    t = torch.linspace(v.t_min, v.t_max, 9, dtype=torch.float64)
    sigma = v.sigma_of_t(t)
    torch.testing.assert_close(sigma, torch.tan(math.pi * t / 2))
    torch.testing.assert_close(v.c_noise(sigma), t)
    torch.testing.assert_close(v.weight(sigma) * v.c_out(sigma) ** 2, torch.ones_like(t))
    assert math.log(1 / float(v.sigma_of_t(torch.tensor(v.t_min))) ** 2) == pytest.approx(13.0, abs=1e-6)  # log-SNR
    drawn = v.sample_sigma(1000, torch.Generator().manual_seed(0))
    assert float(drawn.min()) >= float(v.sigma_of_t(torch.tensor(v.t_min))) - 1e-9


class _Recorder(nn.Module):
    def forward(self, x: Tensor, c_noise: Tensor, labels: Tensor | None) -> Tensor:
        self.seen = (x, c_noise, labels)
        return torch.full_like(x, 2.0)


def test_the_denoiser_combines_skip_and_network_output() -> None:
    net = _Recorder()
    d = Denoiser(net)
    x, sigma = torch.randn(3, 1, 2, 2), torch.tensor([0.1, 1.0, 10.0])
    out = d(x, sigma, torch.tensor([0, 1, 2]))
    p = d.precond
    col = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(out, p.c_skip(col) * x + p.c_out(col) * 2.0)
    torch.testing.assert_close(net.seen[0], p.c_in(col) * x)
    torch.testing.assert_close(net.seen[1], sigma.log() / 4)


@pytest.mark.parametrize(
    ("kwargs", "count"),
    [
        ({}, 1_753_345),  # MNIST / Fashion-MNIST
        ({"image_size": 32, "in_channels": 3, "attn_resolutions": (16,)}, 1_754_499),  # CIFAR-10
        ({"image_size": 32, "in_channels": 3, "attn_resolutions": (8, 16), "num_classes": 0}, 1_804_451),  # CelebA-32
    ],
)
def test_the_unet_has_the_papers_parameter_count(kwargs, count) -> None:
    assert sum(p.numel() for p in NCSNppUNet(**kwargs).parameters()) == count


def test_the_unet_maps_images_to_images_and_has_no_batchnorm() -> None:
    net = NCSNppUNet(image_size=8, nf=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,))
    x = torch.randn(3, 1, 8, 8)
    assert net(x, torch.zeros(3), torch.tensor([0, 5, 10])).shape == x.shape
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    with pytest.raises(ValueError, match="divisible"):
        NCSNppUNet(image_size=6, ch_mult=(1, 2, 2))


def test_ema_decay_and_update_follow_dpdm() -> None:
    assert [ema_decay(n) for n in (1, 2, 100, 10**5)] == [2 / 11, 3 / 12, 101 / 110, 0.999]
    net = nn.Linear(2, 1)
    ema = EMA(net)
    start = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    assert ema.update(net) == pytest.approx(2 / 11)
    torch.testing.assert_close(ema.shadow()["weight"], start - (1 - 2 / 11) * (start - net.weight.detach()))
    assert "shadow_0" in ema.state_dict() and not list(ema.parameters())  # buffers: checkpointed, never optimized


def test_time_grid_endpoints_and_call_counts() -> None:
    grid = edm_time_grid(50)
    assert float(grid[0]) == pytest.approx(80.0) and float(grid[-1]) == pytest.approx(0.002)
    assert bool((grid[1:] < grid[:-1]).all())
    calls = []

    def denoise(x: Tensor, sigma: Tensor) -> Tensor:
        calls.append(float(sigma))
        return torch.zeros_like(x)

    out = ddim(denoise, torch.randn(4, 2), grid)
    assert out.shape == (4, 2) and len(calls) == 50  # N − 1 Euler steps plus the final denoise at t_min
    calls.clear()
    edm(denoise, torch.randn(4, 2), grid)
    assert len(calls) == 2 * 50 - 1  # Heun: two evaluations per step but the last


def test_the_edm_sampler_without_churn_is_deterministic_given_the_start_noise() -> None:
    noise, grid = torch.randn(16, 2), edm_time_grid(12)
    denoise = GaussianMixture().denoise
    a = edm(denoise, noise, grid, s_churn=0.0, generator=torch.Generator().manual_seed(1))
    b = edm(denoise, noise, grid, s_churn=0.0, generator=torch.Generator().manual_seed(2))
    c = edm(denoise, noise, grid, s_churn=40.0, s_min=0.05, s_max=50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_classifier_free_guidance_extrapolates_from_the_unconditional_denoiser() -> None:
    def denoiser(x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return x + labels.view(-1, 1).float()

    x, labels = torch.zeros(3, 2), torch.tensor([0, 1, 2])
    out = guided(denoiser, labels, guidance=0.5, null_label=10)(x, torch.tensor(1.0))
    torch.testing.assert_close(out, 1.5 * labels.view(-1, 1).float().expand(3, 2) - 0.5 * 10)
    with pytest.raises(ValueError, match="null_label"):
        guided(denoiser, labels, guidance=1.0)


class GaussianMixture:
    """Four isotropic 2-D Gaussians; E[x_0 | x_σ] is exact (the ideal denoiser of each noise level)."""

    def __init__(self, spread: float = 0.15) -> None:
        self.means = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]], dtype=torch.float64) * 0.6
        self.weights = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
        self.s2 = spread**2

    def draw(self, n: int, generator: torch.Generator) -> Tensor:
        comp = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        return self.means[comp] + self.s2**0.5 * torch.randn(n, 2, generator=generator, dtype=torch.float64)

    def denoise(self, x: Tensor, sigma: Tensor) -> Tensor:
        var = self.s2 + float(sigma) ** 2
        diff = x.unsqueeze(1) - self.means  # [B, 4, 2]
        logits = self.weights.log() - diff.square().sum(-1) / (2 * var)
        resp = logits.softmax(1).unsqueeze(-1)
        posterior_means = self.means + self.s2 / var * diff
        return (resp * posterior_means).sum(1)

    def mean(self) -> Tensor:
        return self.weights @ self.means

    def cov(self) -> Tensor:
        mu = self.mean()
        centered = self.means - mu
        return (self.weights[:, None, None] * centered[:, :, None] * centered[:, None, :]).sum(0) + self.s2 * torch.eye(
            2, dtype=torch.float64
        )


def sliced_wasserstein(a: Tensor, b: Tensor, projections: int = 64, seed: int = 0) -> float:
    """Mean over random directions of the 1-D W1 distance between the projected sets (equal sizes)."""
    dirs = torch.randn(2, projections, generator=torch.Generator().manual_seed(seed), dtype=a.dtype)
    dirs = dirs / dirs.norm(dim=0)
    pa, pb = (a @ dirs).sort(0).values, (b @ dirs).sort(0).values
    return float((pa - pb).abs().mean())


# Tolerances: with 4000 samples, two independent draws of the mixture are 0.015 apart (SW) and
# their moments differ by <= 0.02. Measured: DDIM (40 steps) 0.025, Heun 0.018, EDM churn 0.016,
# stochastic DDIM (200 steps) 0.012; DDIM with 5 steps 0.20, a mixture with spread 0.25 instead of
# 0.15 0.060, one with equal weights 0.14, so the SW bound separates right from wrong.
SW_TOL, MOMENT_TOL = 0.04, 0.05


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("ddim", {}),
        ("heun", {}),
        ("edm", {"s_churn": 10.0, "s_min": 0.05, "s_max": 50.0}),
        ("ddim", {"stochastic": True}),
    ],
)
def test_samplers_draw_the_gaussian_mixture(name, options) -> None:
    gmm, g = GaussianMixture(), torch.Generator().manual_seed(0)
    steps = 200 if options.get("stochastic") else 40
    drawn = sample(gmm.denoise, (4000, 2), name, steps, g, **options).double()
    reference = gmm.draw(4000, torch.Generator().manual_seed(1))
    assert (drawn.mean(0) - gmm.mean()).abs().max() < MOMENT_TOL
    assert (torch.cov(drawn.T) - gmm.cov()).abs().max() < MOMENT_TOL
    assert sliced_wasserstein(drawn, reference) < SW_TOL
    # Negative controls: the bound rejects a mixture with other weights or a wider spread.
    equal = GaussianMixture()
    equal.weights = torch.full((4,), 0.25, dtype=torch.float64)
    for wrong in (equal, GaussianMixture(spread=0.25)):
        assert sliced_wasserstein(wrong.draw(4000, torch.Generator().manual_seed(2)), reference) > SW_TOL


def test_heun_is_an_alias_of_the_churnless_edm_sampler() -> None:
    noise, grid = torch.randn(8, 2, dtype=torch.float64), edm_time_grid(10)
    torch.testing.assert_close(
        heun(GaussianMixture().denoise, noise, grid), edm(GaussianMixture().denoise, noise, grid)
    )
