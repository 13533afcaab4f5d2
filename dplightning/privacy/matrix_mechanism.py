"""Correlated-noise (matrix factorization) mechanisms: the strategy matrix C, its sensitivity and its noise.

A training run follows a linear *workload* A (n×n, lower triangular) of the per-step gradient
sums x_t ∈ R^d: row t of A x is the parameter change after step t (prefix sums for SGD). The
matrix mechanism factors A = B C, privatizes C x by adding white noise w (iid N(0, std²) per
coordinate) and releases B (C x + w) = A x + A C⁻¹ w. In training this is the same as adding
z_t = (C⁻¹ w)_t to the clipped gradient sum of step t (DP-SGD is C = I: z = w).

Privacy meaning. x_t is the sum of clipped per-example gradients; one example contributes
g_t with ‖g_t‖ ≤ the clip norm at each step t of its *participation pattern* S. The
sensitivity of C x to that example is ``max_S max_g ‖Σ_{t∈S} C[:, t] g_tᵀ‖_F`` in units of the
clip norm. Patterns here are *min-separated*: any two participations are at least ``min_sep``
steps apart (cyclic Poisson over ``min_sep`` partitions guarantees it), at most
``max_participations`` of them. With ``std = σ · sensitivity · clip_norm`` the release is a
Gaussian mechanism with noise multiplier σ. For a banded C with ``bands ≤ min_sep`` the columns
an example can touch have disjoint supports, so its sensitivity over k participations is the
root of the sum of k squared column norms, and one participation costs the largest column norm
(1 for the column-normalised strategies here): the quantity amplified accounting composes.

Everything here is float64 numpy (coefficients, errors, sensitivities);
:mod:`dplightning.privacy.blt` holds the buffered-linear-Toeplitz strategy and
:mod:`dplightning.privacy.correlated_noise` streams the noise of either as torch tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import scipy.linalg
from numpy.lib.stride_tricks import sliding_window_view
from scipy import optimize, signal
from torch import Tensor

_CHUNK = 256  # columns of A C⁻¹ per block in the O(n²) error path (≈ 20 MB at n = 10⁴)
_BAD = 1e10  # objective returned where C⁻¹ overflows, so the line search backs off


def _unit(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e


def _padded(coefs: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n)
    m = min(n, len(coefs))
    out[:m] = coefs[:m]
    return out


def toeplitz_matrix(coefs: np.ndarray, n: int) -> np.ndarray:
    """Dense n×n lower-triangular Toeplitz matrix whose first column is ``coefs`` (zero-padded)."""
    return scipy.linalg.toeplitz(_padded(np.asarray(coefs, dtype=np.float64), n), np.zeros(n))


def toeplitz_inverse_coefs(coefs: np.ndarray, n: int) -> np.ndarray:
    """First column of T⁻¹ for the lower-triangular Toeplitz T with first column ``coefs``, O(n·len(coefs))."""
    return signal.lfilter([1.0], np.asarray(coefs, dtype=np.float64)[:n], _unit(n))


def _reverse_cumsum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.flip(np.cumsum(np.flip(x, axis), axis), axis)


# ---------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """What the optimizer does with the noisy gradients: the lower-triangular matrix A.

    Heavy-ball SGD, ``m_t = β m_{t-1} + g_t`` and ``θ_t = θ_{t-1} - η_t m_t`` (PyTorch SGD with
    ``momentum=β``, ``dampening=0``), moves the parameters by ``-(A g)_t`` after step t with
    ``A[t, r] = Σ_{s=r}^{t} η_s β^{s-r}``. β = 0 and η ≡ 1 is the prefix-sum workload.

    Args:
        momentum: β in [0, 1).
        learning_rates: Per-step η_t (length n), or ``None`` for a constant rate (A is then
            Toeplitz and every error evaluation costs O(n); with a schedule it costs O(n²)).
    """

    momentum: float = 0.0
    learning_rates: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}.")
        if self.learning_rates is not None and not all(math.isfinite(x) for x in self.learning_rates):
            raise ValueError("learning_rates must be finite.")

    @property
    def is_toeplitz(self) -> bool:
        """Whether A is Toeplitz (no learning-rate schedule)."""
        return self.learning_rates is None

    def check(self, n: int) -> None:
        """Raise unless the workload can describe ``n`` steps."""
        if self.learning_rates is not None and len(self.learning_rates) != n:
            raise ValueError(f"learning_rates has {len(self.learning_rates)} entries for {n} steps.")

    def coefs(self, n: int) -> np.ndarray:
        """First column of A without the schedule: a_k = Σ_{i≤k} β^i."""
        return np.cumsum(self.momentum ** np.arange(n))

    def matrix(self, n: int) -> np.ndarray:
        """Dense A (n×n)."""
        self.check(n)
        lr = np.ones(n) if self.learning_rates is None else np.asarray(self.learning_rates, dtype=np.float64)
        return np.tril(np.ones((n, n))) @ np.diag(lr) @ toeplitz_matrix(self.momentum ** np.arange(n), n)


def _toeplitz_error_coefs(workload: Workload, r: np.ndarray) -> np.ndarray:
    """First column of A T(r) for a Toeplitz workload: the momentum filter, then prefix sums."""
    u = r if workload.momentum == 0.0 else signal.lfilter([1.0], [1.0, -workload.momentum], r)
    return np.cumsum(u)


def _toeplitz_error_coefs_adjoint(workload: Workload, g: np.ndarray) -> np.ndarray:
    u = _reverse_cumsum(g)
    return u if workload.momentum == 0.0 else signal.lfilter([1.0], [1.0, -workload.momentum], u[::-1])[::-1]


def _diagonal_block(workload: Workload, r: np.ndarray, scale: np.ndarray, j0: int, j1: int) -> np.ndarray:
    """P[i, m] = (A diag(scale) T(r))[j + m, j] for the columns j = j0 + i < j1 (0 past row n-1)."""
    n = len(r)
    width = n - j0
    window = sliding_window_view(np.concatenate([scale, np.zeros(n)]), width)[j0:j1]
    v = window * r[:width]
    if workload.momentum != 0.0:
        v = signal.lfilter([1.0], [1.0, -workload.momentum], v, axis=1)
    if workload.learning_rates is not None:
        lr = np.concatenate([np.asarray(workload.learning_rates, dtype=np.float64), np.zeros(n)])
        v = v * sliding_window_view(lr, width)[j0:j1]
    valid = np.arange(width)[None, :] < (width - np.arange(j1 - j0))[:, None]
    return np.cumsum(v, axis=1) * valid


def _dense_path_rows(workload: Workload, r: np.ndarray, scale: np.ndarray) -> np.ndarray:
    n = len(r)
    rows = np.zeros(n)
    for j0 in range(0, n, _CHUNK):
        block = _diagonal_block(workload, r, scale, j0, min(n, j0 + _CHUNK))
        for i, p in enumerate(block):
            rows[j0 + i :] += p[: n - j0 - i] ** 2
    return rows


def row_squared_errors(workload: Workload, inverse_coefs: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """Squared norms of the rows of A C⁻¹ for C⁻¹ = diag(scale) T(inverse_coefs).

    Entry t is the noise variance of the t-th released parameter change per coordinate, per
    unit variance of the white noise w. O(n) for a Toeplitz workload whose ``scale`` differs
    from 1 only on a short tail (column-normalised banded C); O(n²) otherwise.
    """
    r = np.asarray(inverse_coefs, dtype=np.float64)
    n = len(r)
    workload.check(n)
    scale = np.ones(n) if scale is None else np.asarray(scale, dtype=np.float64)
    off = np.flatnonzero(scale != 1.0)
    if not workload.is_toeplitz or (len(off) and n - off[0] > 4 * _CHUNK):
        return _dense_path_rows(workload, r, scale)
    rows = np.cumsum(_toeplitz_error_coefs(workload, r) ** 2)
    a = workload.coefs(n)
    for t in range(off[0] if len(off) else n, n):
        # Rows that reach a rescaled column: E[t, j] = Σ_u a_{t-u} s_u r_{u-j}, a correlation.
        w = a[t - np.arange(t + 1)] * scale[: t + 1]
        e = signal.fftconvolve(w[::-1], r[: t + 1])[: t + 1]
        rows[t] = e @ e
    return rows


def _total_error_and_grad(workload: Workload, r: np.ndarray) -> tuple[float, np.ndarray]:
    """‖A T(r)‖_F² and its gradient with respect to r."""
    n = len(r)
    if workload.is_toeplitz:
        beta = _toeplitz_error_coefs(workload, r)
        weights = n - np.arange(n)  # coefficient k appears in n - k rows
        return float(weights @ beta**2), _toeplitz_error_coefs_adjoint(workload, 2.0 * weights * beta)
    # M_β T(r) = T(u) is Toeplitz, so only the schedule breaks the structure: column j of
    # A T(r) has entries Σ_{k≤m} η_{j+k} u_k at rows j + m.
    u = r if workload.momentum == 0.0 else signal.lfilter([1.0], [1.0, -workload.momentum], r)
    lr = np.concatenate([np.asarray(workload.learning_rates, dtype=np.float64), np.zeros(n)])
    total, grad_u = 0.0, np.zeros(n)
    for j0 in range(0, n, _CHUNK):
        j1 = min(n, j0 + _CHUNK)
        window = sliding_window_view(lr, n - j0)[j0:j1]  # zero past row n - 1, so no mask is needed
        block = np.cumsum(window * u[: n - j0], axis=1)
        block *= np.arange(n - j0)[None, :] < (n - j0 - np.arange(j1 - j0))[:, None]
        total += float(np.sum(block**2))
        grad_u[: n - j0] += np.sum(_reverse_cumsum(2.0 * block, axis=1) * window, axis=0)
    if workload.momentum != 0.0:
        grad_u = signal.lfilter([1.0], [1.0, -workload.momentum], grad_u[::-1])[::-1]
    return total, grad_u


# -------------------------------------------------------------------------------------------- sensitivity


def max_participations(n: int, min_sep: int, limit: int | None = None) -> int:
    """Most participations ``min_sep``-separated steps allow in ``n`` steps, capped at ``limit``."""
    if min_sep < 1 or n < 1:
        raise ValueError(f"Need n >= 1 and min_sep >= 1, got n={n}, min_sep={min_sep}.")
    most = -(-n // min_sep)
    return most if limit is None else max(1, min(most, int(limit)))


def participation_patterns(n: int, min_sep: int, max_count: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every non-empty set of steps in ``range(n)`` with gaps ≥ ``min_sep`` and at most ``max_count`` steps."""
    k = max_participations(n, min_sep, max_count)

    def extend(prefix: tuple[int, ...], start: int) -> Iterator[tuple[int, ...]]:
        for t in range(start, n):
            pattern = (*prefix, t)
            yield pattern
            if len(pattern) < k:
                yield from extend(pattern, t + min_sep)

    return extend((), 0)


def sensitivity_brute_force(strategy: np.ndarray, min_sep: int, max_count: int | None = None) -> float:
    """Sensitivity of C x by enumerating every participation pattern (small n only).

    Returns ``max_S sqrt(Σ_{i,j∈S} |(CᵀC)_ij|)``. This bounds ``‖Σ_{t∈S} C[:, t] g_tᵀ‖_F`` for
    any contributions with ‖g_t‖ ≤ 1 (|⟨g_i, g_j⟩| ≤ 1) and is attained by equal g_t when the
    entries of CᵀC within the pattern are ≥ 0, so it is exact for non-negative C.
    """
    x = np.abs(strategy.T @ strategy)
    best = max(x[np.ix_(s, s)].sum() for s in participation_patterns(len(x), min_sep, max_count))
    return math.sqrt(best)


def separated_max_weight(weights: np.ndarray, min_sep: int, max_count: int | None = None) -> float:
    """Largest total weight of at most ``max_count`` indices with gaps ≥ ``min_sep`` (weights ≥ 0), O(n·k)."""
    n = len(weights)
    k = max_participations(n, min_sep, max_count)
    # best[t][c]: the best choice among indices ≥ t with at most c picks; rows past n are zero.
    later = [np.zeros(k + 1) for _ in range(min_sep)]  # best[t + 1], ..., best[t + min_sep]
    for t in range(n - 1, -1, -1):
        take = np.concatenate([[0.0], weights[t] + later[-1][:-1]])
        later = [np.maximum(later[0], take), *later[:-1]]
    return float(later[0][k])


def _comb(c: np.ndarray, min_sep: int, k: int) -> np.ndarray:
    """v_t = Σ_{m<k} c_{t - m·min_sep}: the sum of the k earliest separated columns of T(c)."""
    n = len(c)
    rows = -(-n // min_sep)
    v = np.cumsum(np.concatenate([c, np.zeros(rows * min_sep - n)]).reshape(rows, min_sep), axis=0).ravel()[:n]
    lag = k * min_sep
    if lag < n:  # drop the participations beyond the k-th
        v[lag:] -= v[: n - lag].copy()
    return v


def _comb_adjoint(g: np.ndarray, min_sep: int, k: int) -> np.ndarray:
    return _comb(g[::-1].copy(), min_sep, k)[::-1]


def toeplitz_sensitivity(coefs: np.ndarray, n: int, min_sep: int, max_count: int | None = None) -> float:
    """Sensitivity of a lower-triangular Toeplitz C under ``min_sep``-separated participation, O(n).

    For non-negative, non-increasing coefficients the worst pattern participates as early and
    as often as allowed (steps 0, min_sep, 2·min_sep, ...; McKenna 2024, Thm. 2), so the value is
    exact. Other coefficients are first replaced by the smallest non-negative, non-increasing
    sequence above their absolute values, which can only raise every |CᵀC| entry: an upper bound.
    """
    c = np.maximum.accumulate(np.abs(_padded(np.asarray(coefs, dtype=np.float64), n))[::-1])[::-1]
    v = _comb(c, min_sep, max_participations(n, min_sep, max_count))
    return math.sqrt(float(v @ v))


# ------------------------------------------------------------------------------------------------ strategies


class Strategy(Protocol):
    """A strategy matrix C for ``n`` steps that can generate C⁻¹ w one step at a time."""

    @property
    def n(self) -> int: ...  # read-only: the strategies are frozen dataclasses

    @property
    def buffers(self) -> int: ...

    def matrix(self) -> np.ndarray: ...

    def inverse_coefs(self) -> np.ndarray: ...

    def noise_scale(self) -> np.ndarray: ...

    def sensitivity(self, min_sep: int = 1, max_count: int | None = None) -> float: ...

    def advance(self, state: list[Tensor], white: Tensor, step: int) -> Tensor: ...


@dataclass(frozen=True)
class BandedStrategy:
    """Banded lower-triangular Toeplitz C with ``len(coefs)`` bands, columns rescaled to unit norm.

    C = T D⁻¹ with T the Toeplitz matrix of ``coefs`` and D the column norms of T (only the last
    ``bands - 1`` columns are truncated by the end of training and get scaled up), so every
    column of C has norm 1: one participation of an example with clipped contribution ≤ the clip
    norm moves C x by at most the clip norm. ``coefs = (1.0,)`` is DP-SGD (C = I).

    Args:
        coefs: c_0, ..., c_{b-1} with c_0 ≠ 0.
        n: Number of steps.
        column_normalize: Rescale the columns (default); ``False`` keeps C = T.
    """

    coefs: tuple[float, ...]
    n: int
    column_normalize: bool = True

    def __post_init__(self) -> None:
        c = np.asarray(self.coefs, dtype=np.float64)
        if self.n < 1 or c.ndim != 1 or len(c) < 1 or not np.all(np.isfinite(c)) or c[0] == 0.0:
            raise ValueError(f"Need n >= 1 and finite coefficients with c_0 != 0, got n={self.n}, {self.coefs}.")

    @property
    def bands(self) -> int:
        """Number of non-zero diagonals b."""
        return len(self.coefs)

    @property
    def buffers(self) -> int:
        """Tensors of the model's size the streaming noise keeps (b - 1 past values)."""
        return self.bands - 1

    @functools.cached_property
    def _column_norms(self) -> np.ndarray:
        c = _padded(np.asarray(self.coefs, dtype=np.float64), self.n)
        return np.sqrt(np.cumsum(c**2))[::-1]

    def matrix(self) -> np.ndarray:
        """Dense C (n×n)."""
        t = toeplitz_matrix(np.asarray(self.coefs), self.n)
        return t / self._column_norms if self.column_normalize else t

    def inverse_coefs(self) -> np.ndarray:
        """First column of T⁻¹ (C⁻¹ = diag(noise_scale) T⁻¹)."""
        return toeplitz_inverse_coefs(np.asarray(self.coefs), self.n)

    def noise_scale(self) -> np.ndarray:
        """Row scale s of C⁻¹ = diag(s) T⁻¹: the column norms of T when normalised, else ones."""
        return self._column_norms.copy() if self.column_normalize else np.ones(self.n)

    def sensitivity(self, min_sep: int = 1, max_count: int | None = None) -> float:
        """Sensitivity of C x in clip norms when an example participates ≤ ``max_count`` times, ``min_sep`` apart.

        Exact when ``bands ≤ min_sep`` (columns of one pattern have disjoint supports, so it is
        the root of the largest separated sum of squared column norms) or ``max_count=1`` (the
        largest column norm: the per-participation value amplified accounting composes).

        Raises:
            ValueError: If ``bands > min_sep`` and an example may participate more than once
                (overlapping columns; use :func:`toeplitz_sensitivity` on an un-normalised
                strategy for a bound).
        """
        if self.bands > min_sep and max_participations(self.n, min_sep, max_count) > 1:
            raise ValueError(
                f"A {self.bands}-banded strategy needs participations at least {self.bands} steps apart, "
                f"got min_sep={min_sep}: the closed form does not hold."
            )
        weights = np.ones(self.n) if self.column_normalize else self._column_norms**2
        return math.sqrt(separated_max_weight(weights, min_sep, max_count))

    def advance(self, state: list[Tensor], white: Tensor, step: int) -> Tensor:
        """z_t = s_t y_t with T y = w solved online; ``state`` holds y_{t-1}, ..., y_{t-b+1}, newest first."""
        y = white.clone()
        for coef, past in zip(self.coefs[1:], state):
            y.sub_(past.to(y.device), alpha=coef)
        y.div_(self.coefs[0])
        if state:
            oldest = state.pop()
            oldest.copy_(y)
            state.insert(0, oldest)
        return y.mul_(float(self._column_norms[step])) if self.column_normalize else y


def identity_strategy(n: int) -> BandedStrategy:
    """C = I: independent noise at every step (DP-SGD)."""
    return BandedStrategy((1.0,), n)


def _sqrt_series(a: np.ndarray, m: int) -> np.ndarray:
    """First m coefficients of the power series √(a(z)) (a_0 > 0)."""
    s = np.zeros(m)
    s[0] = math.sqrt(a[0])
    for k in range(1, m):
        s[k] = (a[k] - s[1:k] @ s[k - 1 : 0 : -1]) / (2.0 * s[0])
    return s


def _banded_objective(x: np.ndarray, workload: Workload, n: int) -> tuple[float, np.ndarray]:
    """log(‖c‖² ‖A T(c)⁻¹‖_F²) over c = (1, x) and its gradient (scale-invariant in c)."""
    c = np.concatenate([[1.0], x])
    with np.errstate(over="ignore", invalid="ignore"):  # unstable trial points are rejected below
        r = toeplitz_inverse_coefs(c, n)
        if not np.all(np.isfinite(r)):
            return _BAD, np.zeros_like(x)
        total, g_r = _total_error_and_grad(workload, r)
    if not math.isfinite(total) or total <= 0.0:
        return _BAD, np.zeros_like(x)
    h = signal.lfilter([1.0], c, g_r[::-1])[::-1]  # T⁻ᵀ g_r
    # d T⁻¹ = -T⁻¹ dT T⁻¹, so ∂total/∂c_l = -Σ_k h_k r_{k-l}.
    g_c = -np.array([h[lag:] @ r[: n - lag] for lag in range(len(c))])
    grad = 2.0 * c / (c @ c) + g_c / total
    return math.log(c @ c) + math.log(total), grad[1:]


@functools.lru_cache(maxsize=64)
def optimize_banded(workload: Workload, n: int, bands: int, max_iter: int = 500) -> BandedStrategy:
    """The b-banded column-normalised Toeplitz C minimising the expected total squared error.

    Minimises ``sens² · ‖A C⁻¹‖_F²`` (the *mean* over steps of the squared error of the
    released parameter changes, not the max) with the sensitivity of one participation, ‖c‖,
    which also fixes the error under any ``min_sep ≥ bands`` participation up to the common
    factor √k. L-BFGS over c_1..c_{b-1} (c_0 = 1) from the truncated √A(z) series, with an exact
    O(n·b) gradient (O(n²) with a learning-rate schedule). Results are cached by
    ``(workload, n, bands, max_iter)``.

    Args:
        workload: The optimizer's workload A.
        n: Number of steps.
        bands: b ≥ 1 (1 is DP-SGD).
        max_iter: L-BFGS iteration cap.

    Returns:
        The strategy, coefficients scaled to ‖c‖ = 1, columns normalised for ``n``.
    """
    workload.check(n)
    bands = min(int(bands), n)
    if bands < 1:
        raise ValueError(f"bands must be >= 1, got {bands}.")
    if bands == 1:
        return identity_strategy(n)
    if workload.is_toeplitz:
        x0 = _sqrt_series(workload.coefs(bands), bands)[1:]
    else:  # each evaluation costs O(n²): start from the optimum without the schedule
        c0 = np.asarray(optimize_banded(Workload(workload.momentum), n, bands, max_iter).coefs)
        x0 = c0[1:] / c0[0]
    result = optimize.minimize(
        _banded_objective, x0, args=(workload, n), jac=True, method="L-BFGS-B", options={"maxiter": max_iter}
    )
    best = result.x if result.fun <= _banded_objective(x0, workload, n)[0] else x0
    c = np.concatenate([[1.0], best])
    return BandedStrategy(tuple(float(v) for v in c / np.linalg.norm(c)), n)


# ------------------------------------------------------------------------------------------------ reporting


@dataclass(frozen=True)
class ErrorReport:
    """Expected error of the noisy workload A x + A C⁻¹ w, per coordinate, in clip norms.

    Attributes:
        sensitivity: Of C x under the participation pattern asked for.
        rmse: √(mean_t Var[(A C⁻¹ w)_t]) with w ~ N(0, (σ · sensitivity)²).
        max_rmse: The same at the worst step.
    """

    sensitivity: float
    rmse: float
    max_rmse: float


def expected_error(
    strategy: Strategy, workload: Workload, noise_multiplier: float, min_sep: int = 1, max_count: int | None = None
) -> ErrorReport:
    """RMSE of the noisy workload (prefix sums for SGD) when the noise is calibrated to the sensitivity.

    Strategies compared at one (``min_sep``, ``max_count``) and σ are at equal privacy only
    without amplification; with amplification σ itself depends on the strategy (accounting).
    """
    rows = row_squared_errors(workload, strategy.inverse_coefs(), strategy.noise_scale())
    sens = strategy.sensitivity(min_sep, max_count)
    std = noise_multiplier * sens
    return ErrorReport(sens, std * math.sqrt(float(rows.mean())), std * math.sqrt(float(rows.max())))
