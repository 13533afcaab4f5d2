"""Tail statistics of per-example gradient norms: pure numpy functions, testable without a Trainer."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def quantile_key(q: float) -> str:
    """Metric name of quantile ``q``: 0.5 -> ``"p50"``, 0.999 -> ``"p99.9"``."""
    return f"p{round(100 * q, 6):g}"


def norm_quantiles(x: np.ndarray, quantiles: Sequence[float]) -> dict[str, float]:
    """Quantiles (numpy's linear interpolation) and the maximum of the finite values of ``x``."""
    x = x[np.isfinite(x)]
    if not len(x):
        return {**{quantile_key(q): math.nan for q in quantiles}, "max": math.nan}
    values = np.quantile(x, list(quantiles))
    return {**{quantile_key(q): float(v) for q, v in zip(quantiles, values, strict=True)}, "max": float(x.max())}


def excess_kurtosis(x: np.ndarray) -> float:
    """m4 / m2² − 3 of the finite values (moment estimator; 0 for a Gaussian, large for heavy tails)."""
    x = x[np.isfinite(x)].astype(np.float64)
    centred = x - x.mean() if len(x) else x
    m2 = float(np.mean(centred**2)) if len(x) else 0.0
    if len(x) < 2 or m2 == 0.0:
        return math.nan
    return float(np.mean(centred**4)) / m2**2 - 3.0


def hill_tail_index(x: np.ndarray, tail_fraction: float = 0.05) -> float:
    """Hill's estimate of the tail index α from the k = ⌊tail_fraction · n⌋ largest values.

    With x_(1) ≥ x_(2) ≥ ... the finite values in decreasing order,
    α̂ = k / Σ_{i ≤ k} ln(x_(i) / x_(k+1)). For a Pareto tail P(X > x) ∝ x^(−α) it is the
    maximum-likelihood estimate of α, with standard error about α / √k. A smaller α
    means a heavier tail (the variance is infinite for α ≤ 2).

    Returns:
        α̂, or NaN when k < 2 or the threshold x_(k+1) is not positive.
    """
    x = np.sort(x[np.isfinite(x)].astype(np.float64))[::-1]
    k = int(tail_fraction * len(x))
    if k < 2 or k >= len(x) or x[k] <= 0.0:
        return math.nan
    mean_log_excess = float(np.mean(np.log(x[:k] / x[k])))
    return 1.0 / mean_log_excess if mean_log_excess > 0.0 else math.nan


def clip_shares(group_sq: np.ndarray, total_sq: np.ndarray, clipped: np.ndarray) -> np.ndarray:
    """Each group's share of the clipping events: mean over clipped examples of ‖g_i^G‖² / ‖g_i‖².

    Args:
        group_sq: ``[n, groups]`` squared per-example norms per parameter group.
        total_sq: ``[n]`` squared per-example norms over all privatized parameters.
        clipped: ``[n]`` whether each example was clipped.

    Returns:
        ``[groups]`` shares; they sum to 1 when the groups partition the parameters.
        NaN where no example was clipped.
    """
    keep = clipped & np.isfinite(total_sq) & (total_sq > 0)
    if not keep.any():
        return np.full(group_sq.shape[1], math.nan)
    return (group_sq[keep] / total_sq[keep, None]).mean(axis=0)
