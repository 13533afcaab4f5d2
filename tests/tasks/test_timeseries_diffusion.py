"""DPTimeSeriesDiffusion: masks, per-example loss, the DDPM schedule and sampler, and a short DP fit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dplightning
from dplightning.callbacks import GradientTailStats
from dplightning.cli import build_cli
from dplightning.data import ETTDataModule
from dplightning.models import TimeSeriesDiT
from dplightning.models.ddpm import DDPMSchedule, quad_betas
from dplightning.models.dit_ts import CONDITIONING_PATTERNS
from dplightning.tasks import DPTimeSeriesDiffusion
from dplightning.tasks.timeseries_diffusion import (
    context_mean,
    forecast_mask,
    masked_mse_per_example,
    point_missing_mask,
    random_missing_mask,
)
from tests.data.test_ett import MONTH, write_csv
from tests.helpers import make_trainer, params_of
from tests.metrics.test_crps import numpy_crps


def tiny_module(task: str = "forecasting", module_options: dict | None = None, **bounds: Any) -> DPTimeSeriesDiffusion:
    net = TimeSeriesDiT(num_features=7, hidden=16, depth=1, heads=2, mlp_ratio=2.0, position_dim=8, **bounds)
    return DPTimeSeriesDiffusion(net, task=task, horizon=4, n_samples=4, diffusion_steps=50, **(module_options or {}))  # type: ignore[arg-type]


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
    assert set(result) == {"test_mse", "test_rmse", "test_mae", "test_crps", "test_crps_sum", "test_windows"}
    assert all(math.isfinite(v) for v in result.values()) and result["test_windows"] == len(dm.test_set) == 6
    assert result["test_rmse"] == pytest.approx(math.sqrt(result["test_mse"]), rel=1e-4)


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


# ------------------------------------------------------------------ test metrics: CRPS on de-normalised values


def fixed_samples(module: DPTimeSeriesDiffusion) -> None:
    """Replace the sampler by samples x + a_s on the hidden points (a_s = -0.6, -0.2, 0.2, 0.6 in z-scores)."""
    offsets = torch.tensor([-0.6, -0.2, 0.2, 0.6])

    def sample(x: torch.Tensor, cond_mask: torch.Tensor, n_samples: int | None = None) -> torch.Tensor:
        return x + (1 - cond_mask) * offsets.view(-1, 1, 1, 1)

    module.sample = sample  # type: ignore[method-assign]


def ett_data(tmp_path: Path) -> ETTDataModule:
    """Test windows of the synthetic file, z-scored with statistics near theirs (~N(1003, 2²) raw, ~N(0, 1) scaled)."""
    write_csv(tmp_path / "ETTh1.csv")
    mean, std = [1003.0 + k for k in range(7)], [2.0 + k for k in range(7)]
    dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH, max_test_windows=7,
                       eval_batch_size=3, mean=mean, std=std)  # fmt: skip
    dm.setup()
    return dm


def reference_crps(dm: ETTDataModule, scale: bool, mean: np.ndarray | None = None, std: np.ndarray | None = None):
    """CSDI's CRPS and CRPS-sum of :func:`fixed_samples` on every test window, computed directly in numpy."""
    x = torch.stack([dm.test_set[i] for i in range(len(dm.test_set))]).double().numpy()
    hidden = np.zeros_like(x)
    hidden[:, -4:] = 1.0
    samples = x[None] + hidden[None] * np.array([-0.6, -0.2, 0.2, 0.6]).reshape(-1, 1, 1, 1)
    if scale:
        mean = dm.mean.numpy() if mean is None else mean
        std = dm.std.numpy() if std is None else std
        samples, x = samples * std + mean, x * std + mean
    return numpy_crps(samples, x, hidden), numpy_crps(samples.sum(-1), x.sum(-1), hidden.mean(-1))


def test_crps_is_scored_on_de_normalised_values_from_the_datamodules_scaler(tmp_path: Path) -> None:
    dm = ett_data(tmp_path)
    module = tiny_module()
    fixed_samples(module)
    (result,) = make_trainer("auto").test(module, dm, verbose=False)
    crps, crps_sum = reference_crps(dm, scale=True)
    assert result["test_crps"] == pytest.approx(crps, rel=1e-4)
    assert result["test_crps_sum"] == pytest.approx(crps_sum, rel=1e-4)
    assert result["test_windows"] == 7  # three batches: 3 + 3 + 1 windows
    normalised, _ = reference_crps(dm, scale=False)
    assert normalised > 100 * result["test_crps"]  # Σ|y| near 0 in z-scores: the space changes the number
    assert result["test_mse"] == pytest.approx(0.2**2, rel=1e-4)  # normalised space: torch's median is offset -0.2


def test_crps_space_normalised_and_an_explicit_public_scaler(tmp_path: Path) -> None:
    dm = ett_data(tmp_path)
    plain = tiny_module(module_options={"crps_space": "normalised"})
    fixed_samples(plain)
    (result,) = make_trainer("auto").test(plain, dm, verbose=False)
    assert result["test_crps"] == pytest.approx(reference_crps(dm, scale=False)[0], rel=1e-4)
    mean, std = [1.0, 2, 3, 4, 5, 6, 7], [0.5] * 7  # given statistics win over the datamodule's
    public = tiny_module(module_options={"data_mean": mean, "data_std": std})
    fixed_samples(public)
    (result,) = make_trainer("auto").test(public, dm, verbose=False)
    expected = reference_crps(dm, scale=True, mean=np.array(mean), std=np.array(std))
    assert result["test_crps"] == pytest.approx(expected[0], rel=1e-4)
    assert result["test_crps_sum"] == pytest.approx(expected[1], rel=1e-4)


def test_original_space_crps_without_a_scaler_says_what_to_pass(tmp_path: Path) -> None:
    dm = ett_data(tmp_path)
    module = tiny_module()
    loader = DataLoader(dm.test_set, batch_size=4)  # bare windows: no datamodule, so no mean/std
    with pytest.raises(ValueError, match="pass data_mean/data_std.*crps_space='normalised'"):
        make_trainer("auto").test(module, loader, verbose=False)


def test_module_options_are_validated() -> None:
    with pytest.raises(ValueError, match="crps_space must be 'original' or 'normalised'"):
        tiny_module(module_options={"crps_space": "z"})
    with pytest.raises(ValueError, match="both data_mean and data_std"):
        tiny_module(module_options={"data_mean": [0.0] * 7})
    with pytest.raises(ValueError, match="center must be 'none' or 'context_mean'"):
        tiny_module(module_options={"center": "mean"})


def test_the_layout_options_and_the_crps_space_come_through_a_config() -> None:
    config = Path(__file__).parents[2] / "configs" / "timeseries" / "etth1_forecast_dp_aware_sigma1.0.yaml"
    net = "--model.init_args.model.init_args"
    cli = build_cli(["--config", str(config), f"{net}.context_path", "c_only", f"{net}.project", "ctx",
                     f"{net}.context_encoder", "flatten", f"{net}.window", "192",
                     "--model.init_args.crps_space", "normalised", "--data.init_args.max_test_windows", "512"],
                    run=False)  # fmt: skip
    model = cli.model.model
    assert (model.context_path, model.project) == ("c_only", "ctx")
    assert model.x_embedder.in_features == 2 * 7 * 8 + 32 and model.ctx_encoder.window == 192
    assert cli.model.crps_space == "normalised" and cli.datamodule.hparams.max_test_windows == 512
    with pytest.raises(SystemExit):  # a misspelt choice is refused by the parser
        build_cli(["--config", str(config), f"{net}.context_path", "tokens"], run=False)


# ------------------------------------------------------------------ optional centring on the context's level


def test_context_mean_is_per_example_and_per_channel_over_the_conditioning_points() -> None:
    x = torch.arange(24.0).reshape(2, 4, 3)
    cond = torch.ones_like(x)
    cond[0, 2:] = 0  # example 0: the first two steps are its context
    cond[1, :, 2] = 0  # example 1: channel 2 has no context at all
    mean = context_mean(x, cond)
    assert mean.shape == (2, 1, 3)
    torch.testing.assert_close(mean[0, 0], x[0, :2].mean(0))
    torch.testing.assert_close(mean[1, 0], torch.tensor([x[1, :, 0].mean(), x[1, :, 1].mean(), 0.0]))


def test_centred_module_is_the_plain_one_on_shifted_windows_and_shift_equivariant() -> None:
    torch.manual_seed(0)
    centred = tiny_module(module_options={"center": "context_mean"})
    for p in centred.parameters():
        p.data += 0.1 * torch.randn_like(p)
    plain = tiny_module()
    plain.load_state_dict(centred.state_dict())
    x = torch.randn(3, 12, 7) + torch.tensor([5.0, -3, 0, 1, 2, 10, -7])
    cond = forecast_mask(torch.ones_like(x), 4)
    shifted = x - context_mean(x, cond)
    loss_c = centred.per_example_loss(x, torch.ones_like(x), cond, torch.Generator().manual_seed(1))
    loss_p = plain.per_example_loss(shifted, torch.ones_like(x), cond, torch.Generator().manual_seed(1))
    torch.testing.assert_close(loss_c, loss_p)
    level = torch.tensor([100.0, -50, 3, 0, 7, 1, -2])  # one constant per channel, over the whole window
    samples = {}
    for name, module in (("centred", centred), ("plain", plain)):
        for shift in (0.0, 1.0):
            torch.manual_seed(2)
            samples[name, shift] = module.sample(x + shift * level, cond, n_samples=3)
    torch.testing.assert_close(samples["centred", 1.0], samples["centred", 0.0] + level, rtol=1e-4, atol=1e-3)
    assert not torch.allclose(samples["plain", 1.0], samples["plain", 0.0] + level, rtol=1e-4, atol=1e-3)
    assert torch.equal(samples["centred", 0.0][:, :, :8], x[:, :8].expand(3, -1, -1, -1))  # observed points kept


# ------------------------------------------------------------------ v-parameterisation


class Constant(torch.nn.Module):
    """A stand-in network that returns a fixed tensor (whatever it is asked)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value
        self.bias = torch.nn.Parameter(torch.zeros(()))

    def forward(self, noisy: torch.Tensor, observed: torch.Tensor, cond: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.value + self.bias


def test_v_parameterisation_regresses_v_and_gives_the_sampler_the_implied_noise() -> None:
    x = torch.randn(4, 12, 7, generator=torch.Generator().manual_seed(0))
    cond = forecast_mask(torch.ones_like(x), 4)
    g = torch.Generator().manual_seed(1)
    t, eps = torch.randint(0, 50, (4,), generator=g), torch.randn(x.shape, generator=g)  # the loss's own draws
    schedule = DDPMSchedule()
    a = schedule.alpha_bars[t].view(-1, 1, 1)
    v = a.sqrt() * eps - (1 - a).sqrt() * x
    v_module = DPTimeSeriesDiffusion(Constant(v), horizon=4, parameterization="v")
    loss = v_module.per_example_loss(x, torch.ones_like(x), cond, torch.Generator().manual_seed(1))
    assert loss.abs().max() < 1e-10  # the true v costs nothing ...
    eps_module = DPTimeSeriesDiffusion(Constant(v), horizon=4)
    assert eps_module.per_example_loss(x, torch.ones_like(x), cond, torch.Generator().manual_seed(1)).min() > 0.1
    x_t = schedule.noise(x, t, eps)
    torch.testing.assert_close(v_module.predict_eps(x_t, x, cond, t), eps, rtol=1e-4, atol=1e-4)  # ... and gives ε
    assert torch.equal(eps_module.predict_eps(x_t, x, cond, t), v)  # "eps": the output is ε̂ itself
    with pytest.raises(ValueError, match="parameterization must be 'eps' or 'v'"):
        DPTimeSeriesDiffusion(Constant(v), parameterization="x0")  # type: ignore[arg-type]


# ------------------------------------------------------------------ faulted windows: (X, M_obs, Y) batches


class Recorder(torch.nn.Module):
    """A stand-in network that records what it is given and returns zeros (plus a parameter, for a graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def forward(self, noisy: torch.Tensor, observed: torch.Tensor, cond: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls.append((noisy, observed, cond))
        return torch.zeros_like(noisy) + self.bias


@pytest.mark.parametrize("center", ["none", "context_mean"])
def test_a_faulted_triple_conditions_on_the_faults_and_regresses_the_clean_targets(center: str) -> None:
    clean = torch.randn(2, 12, 7, generator=torch.Generator().manual_seed(0))
    observed = torch.ones_like(clean)
    given = clean.clone()
    given[0, :, 3] += 9.0  # a level fault over the whole window (an imputation context)
    given[1, :, 5], observed[1, :, 5] = 0.0, 0.0  # a missing channel
    cond = random_missing_mask(observed, torch.Generator().manual_seed(1))
    targets = (observed - cond).bool()
    net = Recorder()
    module = DPTimeSeriesDiffusion(net, task="imputation", center=center)  # type: ignore[arg-type]
    loss = module.per_example_loss(given, observed, cond, torch.Generator().manual_seed(2), clean)
    mixed = torch.where(targets, clean, given)  # given points as seen, target points clean, the rest as given
    net_ref = Recorder()
    reference = DPTimeSeriesDiffusion(net_ref, task="imputation", center=center)  # type: ignore[arg-type]
    torch.testing.assert_close(
        loss, reference.per_example_loss(mixed, observed, cond, torch.Generator().manual_seed(2))
    )
    (noisy, seen, _), (noisy_ref, _, _) = net.calls[0], net_ref.calls[0]
    assert torch.equal(seen, cond * (given - module.offset(given, cond) if center != "none" else given))
    assert torch.equal(noisy, noisy_ref)
    far = clean.clone()
    far[~targets] = 1e6  # clean values off the targets never reach the network (the missing channel's above all)
    module.per_example_loss(given, observed, cond, torch.Generator().manual_seed(2), far)
    assert torch.equal(net.calls[-1][0], noisy)
    assert loss.min() > 0  # the zero network misses the clean targets


def test_unpack_windows_reads_all_three_batch_forms() -> None:
    x, mask = torch.randn(2, 4, 3), torch.ones(2, 4, 3)
    assert DPTimeSeriesDiffusion.unpack_windows(x)[2] is None
    assert DPTimeSeriesDiffusion.unpack_windows([x, mask])[2] is None
    given, observed, target = DPTimeSeriesDiffusion.unpack_windows([x + 1, mask, x])
    assert (
        torch.equal(given, x + 1)
        and target is x
        and torch.equal(DPTimeSeriesDiffusion.unpack([x + 1, mask, x])[0], given)
    )


def test_faulted_test_windows_are_scored_against_their_clean_values(tmp_path: Path) -> None:
    write_csv(tmp_path / "ETTh1.csv")
    results = {}
    for rate in (0.0, 1.0):
        dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), task="imputation", input_len=8, rows_per_month=MONTH,
                           max_test_windows=7, eval_batch_size=3, test_fault_rate=rate,
                           fault_kinds=("level",))  # fmt: skip
        module = tiny_module("imputation", module_options={"crps_space": "normalised"})
        # Samples 0 on the hidden points (repeat, not expand: torch's median misreads a stride-0 dimension).
        module.sample = lambda x, cond, n_samples=None: (cond * x).repeat(4, 1, 1, 1)  # type: ignore[method-assign]
        (results[rate],) = make_trainer("auto").test(module, dm, verbose=False)
    # The level faults (5-20 sd) are in the given values only: predicting 0 scores the same on the clean targets.
    assert results[1.0]["test_mse"] == pytest.approx(results[0.0]["test_mse"], rel=1e-6)
    assert results[1.0]["test_windows"] == 7


def test_a_short_dp_fit_on_faulted_training_windows(tmp_path: Path) -> None:
    torch.manual_seed(0)
    write_csv(tmp_path / "ETTh1.csv")
    dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH, batch_size=16,
                       max_val_windows=8, fault_rate=0.5, fault_seed=1)  # fmt: skip
    module = tiny_module(c_max=4.0, gamma_max=1.0, beta_max=1.0, alpha_max=1.0)
    strategy = dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)  # the coupling probe runs too
    trainer = make_trainer(strategy, max_steps=3, limit_val_batches=1)
    trainer.fit(module, dm)
    assert trainer.strategy.dp_state.steps == 3 and math.isfinite(trainer.strategy.get_epsilon())
