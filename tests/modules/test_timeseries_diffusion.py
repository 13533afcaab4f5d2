"""DPTimeSeriesDiffusion: masks, per-example loss, the DDPM schedule and sampler, and a short DP fit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import dplightning
from dplightning.callbacks import GradientTailStats
from dplightning.data import ETTDataModule
from dplightning.models import TimeSeriesDiT
from dplightning.models.ddpm import DDPMSchedule, quad_betas
from dplightning.models.dit_ts import CONDITIONING_PATTERNS
from dplightning.modules import DPTimeSeriesDiffusion
from dplightning.modules.timeseries_diffusion import (
    forecast_mask,
    masked_mse_per_example,
    point_missing_mask,
    random_missing_mask,
)
from tests.data.test_ett import MONTH, write_csv
from tests.helpers import make_trainer, params_of


def tiny_module(task: str = "forecasting", **bounds: float) -> DPTimeSeriesDiffusion:
    net = TimeSeriesDiT(num_features=7, hidden=16, depth=1, heads=2, mlp_ratio=2.0, position_dim=8, **bounds)
    return DPTimeSeriesDiffusion(net, task=task, horizon=4, n_samples=4, diffusion_steps=50)  # type: ignore[arg-type]


# ------------------------------------------------------------------ masks


def test_forecast_mask_hides_the_horizon_only() -> None:
    cond = forecast_mask(torch.ones(2, 10, 3), 4)
    assert cond[:, :6].eq(1).all() and cond[:, 6:].eq(0).all()


def test_random_missing_mask_hides_round_r_times_observed_per_example() -> None:
    observed = (torch.rand(200, 8, 3, generator=torch.Generator().manual_seed(0)) < 0.8).float()
    g = torch.Generator().manual_seed(1)
    ratio = torch.rand(200, 1, generator=torch.Generator().manual_seed(1))  # the draw the function makes first
    cond = random_missing_mask(observed, g)
    assert (cond <= observed).all()  # M_c ⊆ M_obs
    hidden = (observed - cond).flatten(1).sum(1)
    assert torch.equal(hidden, torch.round(ratio[:, 0] * observed.flatten(1).sum(1)))
    assert hidden.std() > 2  # the ratio varies across examples


def test_point_missing_mask_hides_about_the_ratio() -> None:
    cond = point_missing_mask(torch.ones(50, 96, 7), 0.25, torch.Generator().manual_seed(0))
    assert abs((1 - cond).mean().item() - 0.25) < 0.01


# ------------------------------------------------------------------ loss


def test_per_example_loss_is_normalised_by_each_examples_targets() -> None:
    eps, eps_hat = torch.zeros(2, 4, 1), torch.ones(2, 4, 1)
    target = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]]).unsqueeze(-1)
    assert masked_mse_per_example(eps, eps_hat, target).tolist() == [1.0, 1.0]
    assert masked_mse_per_example(eps, eps_hat, torch.zeros_like(target)).tolist() == [0.0, 0.0]


def test_one_windows_loss_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Spec acceptance 7: no batch-level normalisation or mixing anywhere in the loss or the network."""
    torch.manual_seed(0)
    module = tiny_module("imputation")
    for p in module.parameters():  # leave zero-init so that the output depends on the input
        p.data += 0.1 * torch.randn_like(p)
    x = torch.randn(6, 12, 7)
    cond = random_missing_mask(torch.ones_like(x), torch.Generator().manual_seed(0))
    t, eps = torch.randint(0, 50, (6,)), torch.randn_like(x)

    def losses(rows: slice) -> torch.Tensor:
        x_t = module.schedule.noise(x[rows], t[rows], eps[rows])
        return masked_mse_per_example(eps[rows], module.denoise(x_t, x[rows], cond[rows], t[rows]), 1 - cond[rows])

    torch.testing.assert_close(losses(slice(0, 1)), losses(slice(0, 6))[:1])


@pytest.mark.filterwarnings("ignore:You are trying to")  # no Trainer attached: self.log warns
@pytest.mark.parametrize("task", ["forecasting", "imputation"])
def test_training_step_handles_an_empty_poisson_batch(task: str) -> None:
    module = tiny_module(task)
    loss = module.training_step(torch.zeros(0, 12, 7), 0)
    assert loss.item() == 0.0 and loss.requires_grad  # graph-connected zero, never None
    loss.backward()


# ------------------------------------------------------------------ DDPM


def test_quad_schedule() -> None:
    betas = quad_betas()
    assert len(betas) == 50 and betas[0].item() == pytest.approx(1e-4) and betas[-1].item() == pytest.approx(0.5)
    assert torch.all(betas[1:] > betas[:-1])


def test_reverse_step_with_the_true_noise_is_the_posterior_mean_plus_its_noise() -> None:
    schedule = DDPMSchedule()
    x0, eps = torch.randn(4, 5), torch.randn(4, 5)
    b, a = schedule.betas, schedule.alpha_bars
    for t in (0, 1, 25, 49):
        x_t = schedule.noise(x0, torch.full((4,), t), eps)
        out = schedule.reverse_step(x_t, t, eps, torch.Generator().manual_seed(0))
        if t == 0:
            torch.testing.assert_close(out, x0, rtol=1e-4, atol=1e-4)  # the last step recovers x_0 exactly
            continue
        # q(x_{t-1} | x_t, x_0): mean and variance from Ho et al. (2020), eq. 7
        mean = (a[t - 1].sqrt() * b[t] * x0 + (1 - b[t]).sqrt() * (1 - a[t - 1]) * x_t) / (1 - a[t])
        z = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(out, mean + ((1 - a[t - 1]) / (1 - a[t]) * b[t]).sqrt() * z, rtol=1e-4, atol=1e-4)


def test_samples_keep_the_observed_points() -> None:
    torch.manual_seed(0)
    module = tiny_module()
    x = torch.randn(3, 12, 7)
    cond = forecast_mask(torch.ones_like(x), 4)
    samples = module.sample(x, cond, n_samples=5)
    assert samples.shape == (5, 3, 12, 7)
    assert torch.equal(samples[:, :, :8], x[:, :8].expand(5, -1, -1, -1))
    assert samples[:, :, 8:].std(0).min() > 0  # hidden points are drawn, differently per sample


# ------------------------------------------------------------------ a short DP fit, end to end


def test_short_dp_fit_reports_epsilon_and_trains_then_tests(tmp_path: Path) -> None:
    torch.manual_seed(0)
    write_csv(tmp_path / "ETTh1.csv")
    dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH, batch_size=16,
                       max_test_windows=6, max_val_windows=8)  # fmt: skip
    module = tiny_module(c_max=4.0, gamma_max=1.0, beta_max=1.0, alpha_max=1.0)
    before = params_of(module)
    tails = GradientTailStats(groups={"cond": CONDITIONING_PATTERNS}, every_n_steps=3, save_figure=False)
    strategy = dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = make_trainer(strategy, max_steps=3, callbacks=[tails], limit_val_batches=1)
    trainer.fit(module, dm)
    eps = trainer.strategy.get_epsilon()
    assert trainer.strategy.steps == 3 and 0 < eps < math.inf
    changed = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert "model.final_layer.linear.weight" in changed and "model.blocks.0.adaLN_modulation.1.weight" in changed
    assert tails.group_names == ["cond", "rest", "all"] and tails.history[-1].examples > 0
    (result,) = trainer.test(module, dm, verbose=False)
    assert set(result) == {"test_mse", "test_rmse", "test_mae", "test_crps", "test_crps_sum"}
    assert all(math.isfinite(v) for v in result.values())
    assert result["test_rmse"] == pytest.approx(math.sqrt(result["test_mse"]), rel=1e-5)


def test_clamped_sampler_is_the_same_step_when_nothing_is_clamped_and_bounds_x0() -> None:
    schedule = DDPMSchedule()
    x0, eps = torch.randn(4, 5), torch.randn(4, 5)
    for t in (0, 10, 49):
        x_t = schedule.noise(x0, torch.full((4,), t), eps)
        plain = schedule.reverse_step(x_t, t, eps, torch.Generator().manual_seed(0))
        loose = schedule.reverse_step(x_t, t, eps, torch.Generator().manual_seed(0), clip_denoised=1e6)
        torch.testing.assert_close(loose, plain, rtol=1e-3, atol=1e-3)  # float32: x̂_0 divides by √ᾱ_t ≈ 0.003
    x_t = schedule.noise(x0 * 100, torch.zeros(4, dtype=torch.long), eps)
    assert schedule.reverse_step(x_t, 0, eps, clip_denoised=3.0).abs().max() <= 3.0  # t = 0 returns x̂_0
