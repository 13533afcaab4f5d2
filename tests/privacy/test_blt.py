"""BLT strategies: the rational inverse, the fit, and how they compare with banded strategies."""

from __future__ import annotations

import numpy as np
import pytest

from dplightning.privacy.blt import BLTStrategy, fit_blt
from dplightning.privacy.matrix_mechanism import Workload, expected_error, identity_strategy, optimize_banded


def test_inverse_coefficients_equal_the_dense_inverse() -> None:
    blt = BLTStrategy((0.95, 0.6, 0.1), (0.3, 0.2, 0.1), 30)
    np.testing.assert_allclose(np.linalg.inv(blt.matrix())[:, 0], blt.inverse_coefs(), rtol=1e-12, atol=1e-15)
    expected = np.concatenate(
        [[1.0], [sum(w * t ** (k - 1) for t, w in zip(blt.theta, blt.omega)) for k in range(1, 30)]]
    )
    np.testing.assert_allclose(blt.coefs(), expected, rtol=1e-14)


@pytest.mark.parametrize("sep", [4, 16])
def test_fitted_blt_beats_dp_sgd_under_min_separation(sep: int) -> None:
    n, workload = 256, Workload()
    blt = fit_blt(workload, n, 2, sep)
    ours = expected_error(blt, workload, 1.0, sep)
    sgd = expected_error(identity_strategy(n), workload, 1.0, sep)
    assert ours.rmse < sgd.rmse
    assert ours.sensitivity == pytest.approx(blt.sensitivity(sep))


def test_fitted_blt_under_single_participation_beats_short_bands() -> None:
    """With one participation any Toeplitz C is allowed; a few buffers reach far beyond 4 bands."""
    n, workload = 1024, Workload()
    blt = expected_error(fit_blt(workload, n, 3, 1, 1), workload, 1.0, 1, 1).rmse
    banded = expected_error(optimize_banded(workload, n, 4), workload, 1.0, 4, 1).rmse
    assert blt < banded


def test_more_buffers_never_hurt_much_and_fit_is_cached() -> None:
    n, workload = 512, Workload(0.9)
    errors = [expected_error(fit_blt(workload, n, m, 1, 1), workload, 1.0, 1, 1).rmse for m in (1, 2, 3)]
    assert errors[2] <= errors[0] * (1 + 1e-6), errors
    assert fit_blt(workload, n, 2, 1, 1) is fit_blt(workload, n, 2, 1, 1)
