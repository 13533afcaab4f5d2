"""Matrix-factorization mechanisms against independent references: dense algebra, simulated SGD, brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import optimize

from dplightning.privacy.blt import BLTStrategy
from dplightning.privacy.matrix_mechanism import (
    BandedStrategy,
    Workload,
    expected_error,
    identity_strategy,
    optimize_banded,
    participation_patterns,
    row_squared_errors,
    sensitivity_brute_force,
    separated_max_weight,
    toeplitz_matrix,
    toeplitz_sensitivity,
)


def _random_banded(rng: np.random.Generator, bands: int, n: int, normalize: bool = True) -> BandedStrategy:
    c = rng.normal(size=bands)
    c[0] = 1.0 + abs(c[0])
    return BandedStrategy(tuple(c / np.linalg.norm(c)), n, normalize)


def _strategies(n: int) -> list:
    rng = np.random.default_rng(0)
    return [
        identity_strategy(n),
        _random_banded(rng, 4, n),
        _random_banded(rng, 3, n, normalize=False),
        BLTStrategy((0.9, 0.3), (0.4, 0.25), n),
    ]


# ----------------------------------------------------------------------------------------------- workloads


def _torch_sgd_workload(n: int, momentum: float, lrs: list[float]) -> np.ndarray:
    """A[t, r] = parameter change after step t from a unit gradient at step r, by torch.optim.SGD."""
    a = np.zeros((n, n))
    for r in range(n):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.SGD([p], lr=1.0, momentum=momentum)
        for t in range(n):
            opt.param_groups[0]["lr"] = lrs[t]
            p.grad = torch.tensor([1.0 if t == r else 0.0], dtype=torch.float64)
            opt.step()
            a[t, r] = -p.item()
    return a


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("schedule", [False, True])
def test_workload_is_what_torch_sgd_does(momentum: float, schedule: bool) -> None:
    n = 7
    lrs = list(np.linspace(1.0, 0.2, n)) if schedule else [1.0] * n
    workload = Workload(momentum, tuple(lrs) if schedule else None)
    np.testing.assert_allclose(workload.matrix(n), _torch_sgd_workload(n, momentum, lrs), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    "workload", [Workload(), Workload(0.8), Workload(0.0, tuple(np.linspace(2, 0.5, 40))), Workload(0.6, (1.0,) * 40)]
)
def test_errors_equal_dense_a_times_c_inverse(workload: Workload) -> None:
    n = 40
    for strategy in _strategies(n):
        dense = workload.matrix(n) @ np.linalg.inv(strategy.matrix())
        rows = row_squared_errors(workload, strategy.inverse_coefs(), strategy.noise_scale())
        np.testing.assert_allclose(rows, (dense**2).sum(axis=1), rtol=1e-11)


def test_column_normalised_banded_has_unit_columns() -> None:
    strategy = _random_banded(np.random.default_rng(1), 5, 20)
    np.testing.assert_allclose(np.linalg.norm(strategy.matrix(), axis=0), 1.0, rtol=1e-14)
    assert np.count_nonzero(np.triu(strategy.matrix(), 1)) == 0
    assert np.count_nonzero(np.tril(strategy.matrix(), -strategy.bands)) == 0


# --------------------------------------------------------------------------------------------- sensitivity


def test_participation_patterns_are_all_separated_sets() -> None:
    n, sep, k = 9, 2, 3
    expected = {
        s
        for size in range(1, k + 1)
        for s in itertools.combinations(range(n), size)
        if all(b - a >= sep for a, b in zip(s, s[1:]))
    }
    got = list(participation_patterns(n, sep, k))
    assert len(got) == len(set(got)) and set(got) == expected


def test_separated_max_weight_matches_enumeration() -> None:
    rng = np.random.default_rng(2)
    for n, sep, k in [(10, 1, 3), (11, 3, None), (9, 2, 2), (7, 4, 1)]:
        w = rng.uniform(0, 1, n)
        expected = max(w[list(s)].sum() for s in participation_patterns(n, sep, k))
        assert separated_max_weight(w, sep, k) == pytest.approx(expected, rel=1e-12)


def test_brute_force_bounds_every_contribution() -> None:
    """No choice of clipped contributions (‖g_t‖ ≤ 1) beats the brute-force sensitivity."""
    rng = np.random.default_rng(3)
    c = toeplitz_matrix(rng.normal(size=4), 8)
    for sep, k in [(1, None), (2, 2), (3, None)]:
        sens = sensitivity_brute_force(c, sep, k)
        for pattern in participation_patterns(8, sep, k):
            g = rng.normal(size=(len(pattern), 3))
            g /= np.linalg.norm(g, axis=1, keepdims=True)
            assert np.linalg.norm(c[:, list(pattern)] @ g) <= sens + 1e-12


@pytest.mark.parametrize("normalize", [True, False])
def test_banded_closed_form_equals_brute_force(normalize: bool) -> None:
    rng = np.random.default_rng(4)
    n = 11
    for bands in (1, 2, 3):
        strategy = _random_banded(rng, bands, n, normalize)  # signed coefficients
        for sep in (bands, bands + 1, 5):
            for k in (1, 2, None):
                expected = sensitivity_brute_force(strategy.matrix(), sep, k)
                assert strategy.sensitivity(sep, k) == pytest.approx(expected, rel=1e-12)
        # One participation: no cross terms, whatever the separation.
        assert strategy.sensitivity(1, 1) == pytest.approx(sensitivity_brute_force(strategy.matrix(), 1, 1), rel=1e-12)


def test_banded_refuses_bands_beyond_separation() -> None:
    with pytest.raises(ValueError, match="at least 3 steps apart"):
        _random_banded(np.random.default_rng(5), 3, 10).sensitivity(2)


def test_toeplitz_closed_form_is_exact_for_nonincreasing_coefficients() -> None:
    rng = np.random.default_rng(6)
    n = 10
    for _ in range(5):
        c = np.sort(rng.uniform(0, 1, n))[::-1]  # bands > separation: columns overlap
        for sep, k in [(1, None), (2, None), (3, 2), (4, 1)]:
            expected = sensitivity_brute_force(toeplitz_matrix(c, n), sep, k)
            assert toeplitz_sensitivity(c, n, sep, k) == pytest.approx(expected, rel=1e-12)


def test_toeplitz_bound_for_signed_coefficients_is_above_brute_force() -> None:
    rng = np.random.default_rng(7)
    for _ in range(5):
        c = rng.normal(size=6)
        for sep in (1, 2, 3):
            assert toeplitz_sensitivity(c, 9, sep) >= sensitivity_brute_force(toeplitz_matrix(c, 9), sep) - 1e-12


def test_blt_sensitivity_equals_brute_force() -> None:
    rng = np.random.default_rng(8)
    n = 10
    for _ in range(4):
        theta = rng.uniform(0, 0.99, 3)
        omega = rng.dirichlet(np.ones(4))[:3]
        blt = BLTStrategy(tuple(theta), tuple(omega), n)
        assert np.all(np.diff(blt.coefs()) <= 0)
        for sep, k in [(1, None), (2, 3), (3, None)]:
            assert blt.sensitivity(sep, k) == pytest.approx(sensitivity_brute_force(blt.matrix(), sep, k), rel=1e-12)


def test_blt_refuses_parameters_without_closed_form() -> None:
    with pytest.raises(ValueError):
        BLTStrategy((0.5, 0.9), (0.7, 0.6), 10)  # c_1 > c_0
    with pytest.raises(ValueError):
        BLTStrategy((1.0,), (0.5,), 10)


# ------------------------------------------------------------------------------------------------ optimizing


def test_optimised_banded_beats_dp_sgd_on_prefix_sums() -> None:
    n, bands = 256, 8
    banded = expected_error(optimize_banded(Workload(), n, bands), Workload(), 1.0, bands)
    sgd = expected_error(identity_strategy(n), Workload(), 1.0, bands)
    assert banded.sensitivity == pytest.approx(sgd.sensitivity)  # both √k at separation 8
    assert banded.rmse < sgd.rmse and banded.max_rmse < sgd.max_rmse


def test_error_does_not_grow_with_bands_at_fixed_separation() -> None:
    n, sep = 256, 16
    errors = [expected_error(optimize_banded(Workload(), n, b), Workload(), 1.0, sep).rmse for b in (1, 2, 4, 8, 16)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0]


def test_optimiser_reaches_the_dense_optimum() -> None:
    """Nelder–Mead on the dense objective ‖c‖² ‖A T(c)⁻¹‖_F² from several starts cannot do better."""
    n, bands, workload = 24, 3, Workload(0.5)
    a = workload.matrix(n)

    def dense(c: np.ndarray) -> float:
        return float(c @ c * np.sum((a @ np.linalg.inv(toeplitz_matrix(c, n))) ** 2))

    ours = dense(np.asarray(optimize_banded(workload, n, bands).coefs))
    starts = [(0.5, 0.3), (0.1, 0.0), (0.8, 0.6), (0.3, -0.2)]
    best = min(
        optimize.minimize(lambda x: dense(np.array([1.0, *x])), s, method="Nelder-Mead", options={"xatol": 1e-10}).fun
        for s in starts
    )
    assert ours <= best * (1 + 1e-6)


def test_schedule_aware_strategy_is_no_worse_than_the_constant_one() -> None:
    n, bands = 64, 4
    workload = Workload(0.9, tuple(np.where(np.arange(n) < n // 2, 1.0, 0.1)))
    aware = expected_error(optimize_banded(workload, n, bands), workload, 1.0, bands).rmse
    plain = expected_error(optimize_banded(Workload(0.9), n, bands), workload, 1.0, bands).rmse
    assert aware <= plain * (1 + 1e-9)


def test_results_are_cached() -> None:
    assert optimize_banded(Workload(), 300, 5) is optimize_banded(Workload(), 300, 5)


def test_expected_error_of_dp_sgd_in_closed_form() -> None:
    """Identity C on prefix sums: Var of the t-th sum is (t + 1) σ² k, so RMSE = σ √(k (n + 1) / 2)."""
    n, sigma, sep = 100, 1.7, 10
    report = expected_error(identity_strategy(n), Workload(), sigma, sep)
    assert report.rmse == pytest.approx(sigma * math.sqrt(10 * (n + 1) / 2), rel=1e-12)
    assert report.max_rmse == pytest.approx(sigma * math.sqrt(10 * n), rel=1e-12)
