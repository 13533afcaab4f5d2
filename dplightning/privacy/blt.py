"""Buffered linear Toeplitz (BLT) strategies: correlated noise from a few decaying buffers.

A BLT strategy is the lower-triangular Toeplitz C with c_0 = 1 and c_k = Σ_i ω_i θ_i^{k-1} for
k ≥ 1 (Dvijotham et al. 2024, "Efficient and near-optimal noise generation for streaming
differential privacy"). Its generating function is rational, so C⁻¹ w is generated online with
one buffer per θ_i: ``z_t = w_t - Σ_i ω_i S_i`` and then ``S_i ← θ_i S_i + z_t``, where S_i holds
Σ_{k≥1} θ_i^{k-1} z_{t-k}. Memory is ``buffers`` tensors of the model's size whatever the run
length, against b - 1 for a b-banded strategy.

Privacy meaning. The parameters are kept in 0 ≤ θ_i < 1, ω_i ≥ 0, Σ ω_i ≤ 1, so the
coefficients are non-negative and non-increasing; the sensitivity of C x to one example (clipped
contribution ≤ the clip norm, at most k participations at least ``min_sep`` steps apart) is then
exact in closed form: the example participating at 0, min_sep, 2·min_sep, ... is the worst case
(:func:`~dplightning.privacy.matrix_mechanism.toeplitz_sensitivity`). C is not banded, so the
amplification of banded strategies by cyclic Poisson sampling does not apply to it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, signal
from torch import Tensor

from dplightning.privacy.matrix_mechanism import (
    Workload,
    _comb,
    _comb_adjoint,
    _total_error_and_grad,
    _unit,
    max_participations,
    toeplitz_matrix,
    toeplitz_sensitivity,
)

_BAD = 1e10


def _coefs(theta: np.ndarray, omega: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Toeplitz coefficients c (length n) and the powers θ_i^j, j < n - 1, they are made of."""
    powers = theta[None, :] ** np.arange(max(n - 1, 0))[:, None]
    return np.concatenate([[1.0], powers @ omega]), powers


def _polynomials(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q) in ascending powers of z with C(z) = P(z) / Q(z) and Q(z) = Π_i (1 - θ_i z)."""
    q = np.poly(theta)  # Π(x - θ_i) read in ascending powers of z = 1/x is Π(1 - θ_i z)
    p = q.copy()
    for i, w in enumerate(omega):
        p[1:] += w * np.poly(np.delete(theta, i))
    return p, q


@dataclass(frozen=True)
class BLTStrategy:
    """Buffered linear Toeplitz strategy C for ``n`` steps.

    Args:
        theta: Buffer decays θ_i in [0, 1).
        omega: Buffer weights ω_i ≥ 0 with Σ ω_i ≤ 1.
        n: Number of steps (the sensitivity is computed for them).
    """

    theta: tuple[float, ...]
    omega: tuple[float, ...]
    n: int

    def __post_init__(self) -> None:
        theta, omega = np.asarray(self.theta, dtype=np.float64), np.asarray(self.omega, dtype=np.float64)
        if len(theta) < 1 or theta.shape != omega.shape or self.n < 1:
            raise ValueError("Need n >= 1 and as many weights as decays (at least one).")
        if not (np.all((theta >= 0) & (theta < 1)) and np.all(omega >= 0) and omega.sum() <= 1 + 1e-12):
            # Outside this set the coefficients may rise or change sign; the closed-form sensitivity
            # would then be only an upper bound, and C⁻¹ may be unstable.
            raise ValueError(f"Need 0 <= theta < 1, omega >= 0 and sum(omega) <= 1, got {self.theta}, {self.omega}.")

    @property
    def buffers(self) -> int:
        """Tensors of the model's size the streaming noise keeps."""
        return len(self.theta)

    def coefs(self) -> np.ndarray:
        """First column of C (n entries)."""
        return _coefs(np.asarray(self.theta), np.asarray(self.omega), self.n)[0]

    def matrix(self) -> np.ndarray:
        """Dense C (n×n)."""
        return toeplitz_matrix(self.coefs(), self.n)

    def inverse_coefs(self) -> np.ndarray:
        """First column of C⁻¹, from the rational form in O(n · buffers)."""
        p, q = _polynomials(np.asarray(self.theta), np.asarray(self.omega))
        return signal.lfilter(q, p, _unit(self.n))

    def noise_scale(self) -> np.ndarray:
        """Row scale of C⁻¹ (none: ones)."""
        return np.ones(self.n)

    def sensitivity(self, min_sep: int = 1, max_count: int | None = None) -> float:
        """Exact sensitivity of C x in clip norms under ``min_sep``-separated participation (≤ ``max_count`` times)."""
        return toeplitz_sensitivity(self.coefs(), self.n, min_sep, max_count)

    def advance(self, state: list[Tensor], white: Tensor, step: int) -> Tensor:
        """z_t = w_t - Σ ω_i S_i, then S_i ← θ_i S_i + z_t (``state`` holds the S_i)."""
        z = white.clone()
        for weight, buffer in zip(self.omega, state):
            z.sub_(buffer.to(z.device), alpha=weight)
        for decay, buffer in zip(self.theta, state):
            buffer.mul_(decay).add_(z.to(buffer.device))
        return z


def _unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = len(x) // 2
    theta = np.minimum(1.0 / (1.0 + np.exp(-x[:m])), np.nextafter(1.0, 0.0))
    e = np.exp(x[m:])
    return theta, e / (1.0 + e.sum())


def _objective(x: np.ndarray, workload: Workload, n: int, min_sep: int, k: int) -> tuple[float, np.ndarray]:
    """log(sens² · ‖A C⁻¹‖_F²) over unconstrained parameters, and its gradient."""
    theta, omega = _unpack(x)
    c, powers = _coefs(theta, omega, n)
    p, q = _polynomials(theta, omega)
    with np.errstate(over="ignore", invalid="ignore"):  # unstable trial points are rejected below
        r = signal.lfilter(q, p, _unit(n))
        if not np.all(np.isfinite(r)):
            return _BAD, np.zeros_like(x)
        total, g_r = _total_error_and_grad(workload, r)
    v = _comb(c, min_sep, k)
    sens2 = float(v @ v)
    if not (math.isfinite(total) and total > 0.0):
        return _BAD, np.zeros_like(x)
    h = signal.lfilter(q, p, g_r[::-1])[::-1]  # C⁻ᵀ g_r
    # d C⁻¹ = -C⁻¹ dC C⁻¹, so ∂total/∂c_l = -Σ_m h_{l+m} r_m (a correlation).
    g_c = -signal.fftconvolve(h[::-1], r)[:n][::-1]
    g = 2.0 * _comb_adjoint(v, min_sep, k) / sens2 + g_c / total
    d_omega = g[1:] @ powers
    d_theta = omega * ((g[2:] * np.arange(1, n - 1)) @ powers[: n - 2]) if n > 2 else np.zeros_like(theta)
    d_a = d_theta * theta * (1.0 - theta)
    d_b = omega * (d_omega - omega @ d_omega)
    return math.log(sens2) + math.log(total), np.concatenate([d_a, d_b])


def _starts(n: int, buffers: int) -> list[np.ndarray]:
    """Initial points: decay times spread log-uniformly up to n, total weight 1/2 or 3/4."""
    starts = []
    for top, weight in ((1.0, 0.5), (0.5, 0.5), (1.0, 0.75)):
        memory = n ** (top * np.arange(1, buffers + 1) / buffers)  # 1 / (1 - θ)
        theta = np.clip(1.0 - 1.0 / np.maximum(memory, 2.0), 1e-3, 1 - 1e-9)
        omega = np.full(buffers, weight / buffers)
        starts.append(np.concatenate([np.log(theta / (1 - theta)), np.log(omega / (1 - omega.sum()))]))
    return starts


@functools.lru_cache(maxsize=64)
def fit_blt(
    workload: Workload,
    n: int,
    buffers: int,
    min_sep: int = 1,
    max_count: int | None = None,
    max_iter: int = 500,
) -> BLTStrategy:
    """The BLT strategy with ``buffers`` buffers minimising sens² · ‖A C⁻¹‖_F² (mean squared error).

    The sensitivity is the exact one for at most ``max_count`` participations (default: as many
    as fit) at least ``min_sep`` steps apart. L-BFGS from three starting points with an exact
    gradient, O(n log n) per evaluation (O(n²) with a learning-rate schedule); the best is kept.
    Cached by all arguments.

    Args:
        workload: The optimizer's workload A.
        n: Number of steps.
        buffers: Number of buffers (θ_i, ω_i pairs) ≥ 1.
        min_sep: Minimum separation of one example's participations.
        max_count: Most participations of one example (``None``: as many as ``min_sep`` allows).
        max_iter: L-BFGS iteration cap per start.
    """
    workload.check(n)
    if buffers < 1:
        raise ValueError(f"buffers must be >= 1, got {buffers}.")
    k = max_participations(n, min_sep, max_count)
    best: tuple[float, np.ndarray] | None = None
    for x0 in _starts(n, buffers):
        result = optimize.minimize(
            _objective, x0, args=(workload, n, min_sep, k), jac=True, method="L-BFGS-B", options={"maxiter": max_iter}
        )
        if best is None or result.fun < best[0]:
            best = (float(result.fun), result.x)
    if best is None or best[0] >= _BAD:
        raise RuntimeError("No stable BLT strategy found.")
    theta, omega = _unpack(best[1])
    return BLTStrategy(tuple(float(t) for t in theta), tuple(float(w) for w in omega), n)
