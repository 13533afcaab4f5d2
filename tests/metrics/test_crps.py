"""QuantileCRPS against closed forms and a brute-force numpy computation of CSDI's formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dplightning.metrics import CSDI_QUANTILES, QuantileCRPS


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
