"""QuantileCRPS against closed forms, a brute-force numpy computation of CSDI's formula and exact Gaussian quantiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import norm

from dplightning.metrics import CSDI_QUANTILES, QuantileCRPS
from dplightning.metrics.crps import denormalise, quantile_crps


def numpy_crps(samples: np.ndarray, target: np.ndarray, mask: np.ndarray) -> float:
    """CSDI's calc_quantile_CRPS, point by point with np.quantile (linear interpolation)."""
    total = 0.0
    for q in np.arange(1, 20) * 0.05:
        loss = 0.0
        for idx in np.ndindex(target.shape):
            f = np.quantile(samples[(slice(None), *idx)], q)
            y = target[idx]
            loss += 2 * abs((f - y) * mask[idx] * (float(y <= f) - q))
        total += loss / np.abs(target * mask).sum()
    return total / 19


def test_the_19_levels() -> None:
    assert len(CSDI_QUANTILES) == 19 and CSDI_QUANTILES[0] == 0.05 and CSDI_QUANTILES[-1] == 0.95


def test_point_mass_forecasts() -> None:
    y = torch.full((3, 4, 2), 2.0)
    exact = QuantileCRPS()
    exact.update(y.expand(10, -1, -1, -1), y)
    assert exact.compute() == 0.0
    off = QuantileCRPS()  # every sample is y + 1: each level costs 2(1 - q), mean 1, divided by |y| = 2
    off.update((y + 1).expand(10, -1, -1, -1), y)
    assert off.compute().item() == pytest.approx(0.5, rel=1e-12)


def test_matches_brute_force_over_two_updates_with_masks() -> None:
    rng = np.random.default_rng(0)
    samples, target = rng.normal(size=(15, 6, 5, 3)), rng.normal(size=(6, 5, 3))
    mask = (rng.random((6, 5, 3)) < 0.6).astype(float)
    metric = QuantileCRPS()
    for part in (slice(0, 2), slice(2, 6)):  # sums accumulate over batches, like CSDI over the test set
        metric.update(*(torch.from_numpy(a[..., part, :, :]) for a in (samples, target, mask)))
    assert metric.compute().item() == pytest.approx(numpy_crps(samples, target, mask), rel=1e-9)
    crps_sum = QuantileCRPS(sum_features=True)
    crps_sum.update(*(torch.from_numpy(a) for a in (samples, target, mask)))
    expected = numpy_crps(samples.sum(-1), target.sum(-1), mask.mean(-1))
    assert crps_sum.compute().item() == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------------------ de-normalised CRPS (CSDI's convention)


def test_denormalised_crps_and_crps_sum_match_a_direct_numpy_computation() -> None:
    """CSDI maps samples and targets back with x·std + mean per channel, then scores (both metrics, two updates)."""
    rng = np.random.default_rng(1)
    samples, target = rng.normal(size=(9, 4, 5, 3)), rng.normal(size=(4, 5, 3))
    mask = (rng.random((4, 5, 3)) < 0.5).astype(float)
    mean, std = np.array([10.0, -3.0, 0.5]), np.array([2.0, 0.5, 4.0])
    raw_samples, raw_target = samples * std + mean, target * std + mean
    t = {name: torch.from_numpy(a) for name, a in (("mean", mean), ("std", std))}
    crps, crps_sum = QuantileCRPS(), QuantileCRPS(sum_features=True)
    for part in (slice(0, 1), slice(1, 4)):
        batch = [torch.from_numpy(a[..., part, :, :]) for a in (samples, target, mask)]
        crps.update(*batch, **t)
        crps_sum.update(*batch, **t)
    assert crps.compute().item() == pytest.approx(numpy_crps(raw_samples, raw_target, mask), rel=1e-9)
    expected_sum = numpy_crps(raw_samples.sum(-1), raw_target.sum(-1), mask.mean(-1))
    assert crps_sum.compute().item() == pytest.approx(expected_sum, rel=1e-9)
    normalised = numpy_crps(samples, target, mask)
    assert abs(crps.compute().item() - normalised) > 0.05 * normalised  # the space matters: the test can fail
    functional = quantile_crps(*(torch.from_numpy(a) for a in (samples, target, mask)), **t)
    assert functional.item() == pytest.approx(numpy_crps(raw_samples, raw_target, mask), rel=1e-9)
    functional_sum = quantile_crps(*(torch.from_numpy(a) for a in (samples, target, mask)), sum_features=True, **t)
    assert functional_sum.item() == pytest.approx(expected_sum, rel=1e-9)


def test_many_gaussian_samples_give_the_quantile_loss_of_the_exact_quantiles_and_nearly_the_exact_crps() -> None:
    """Samples z ~ N(m, s²) in z-scores, de-normalised with (mean, std): compare with scipy's Gaussian quantiles.

    With exact quantiles the 19-level rule overestimates the exact Gaussian CRPS
    s·[z(2Φ(z) − 1) + 2φ(z) − 1/√π] by 3–6 % (it leaves out the tails of the integral over q).
    """
    rng = np.random.default_rng(2)
    n_points, n_samples = 6, 200_000
    m, s = rng.normal(size=n_points), rng.uniform(0.5, 1.5, n_points)
    target_z = m + s * rng.normal(size=n_points)
    mean, std = np.array([20.0]), np.array([3.0])
    samples_z = m + s * rng.standard_normal((n_samples, n_points))
    metric = QuantileCRPS()
    metric.update(torch.from_numpy(samples_z[..., None]), torch.from_numpy(target_z[:, None]),
                  mean=torch.from_numpy(mean), std=torch.from_numpy(std))  # fmt: skip
    mu, sigma, y = mean + std * m, std * s, mean + std * target_z  # the de-normalised Gaussians and targets
    levels = np.array(CSDI_QUANTILES)
    quantiles = mu[None] + sigma[None] * norm.ppf(levels)[:, None]  # [Q, points]
    ql = 2 * np.abs((quantiles - y) * ((y <= quantiles) - levels[:, None])).sum(1) / np.abs(y).sum()
    assert metric.compute().item() == pytest.approx(ql.mean(), rel=5e-3)
    zs = (y - mu) / sigma
    exact = (sigma * (zs * (2 * norm.cdf(zs) - 1) + 2 * norm.pdf(zs) - 1 / np.sqrt(np.pi))).sum() / np.abs(y).sum()
    assert 1.0 < metric.compute().item() / exact < 1.07


def test_denormalise_needs_both_statistics() -> None:
    x = torch.ones(2, 3)
    assert denormalise(x) is x
    torch.testing.assert_close(denormalise(x, torch.tensor([1.0, 2, 3]), torch.tensor([2.0, 2, 2])),
                               torch.tensor([[3.0, 4, 5]] * 2))  # fmt: skip
    with pytest.raises(ValueError, match="both mean and std"):
        denormalise(x, mean=torch.zeros(3))
    with pytest.raises(ValueError, match="both mean and std"):
        QuantileCRPS().update(x[None], x, std=torch.ones(3))
