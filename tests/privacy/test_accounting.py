"""The ledger agrees with Opacus' accountants built directly."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from dplightning.privacy.accounting import PrivacyLedger, calibrate_noise_multiplier, compute_epsilon

DELTA = 1e-5


def _opacus_epsilon(cls: type, history: list[tuple[float, float, int]]) -> float:
    accountant = cls()
    accountant.history = list(history)
    return accountant.get_epsilon(delta=DELTA)


@pytest.mark.parametrize(("name", "cls"), [("prv", PRVAccountant), ("rdp", RDPAccountant)])
def test_ledger_matches_opacus_after_stepping(name: str, cls: type) -> None:
    ledger = PrivacyLedger(name)
    reference = cls()
    for sigma, q, steps in [(1.1, 0.02, 30), (0.9, 0.05, 20)]:
        for _ in range(steps):
            ledger.step(sigma, q)
            reference.step(noise_multiplier=sigma, sample_rate=q)
    assert ledger.history == ((1.1, 0.02, 30), (0.9, 0.05, 20))
    assert ledger.get_epsilon(DELTA) == pytest.approx(reference.get_epsilon(delta=DELTA), rel=1e-12)


def test_epsilon_bound_is_an_upper_bound_exact_on_grid_points() -> None:
    ledger = PrivacyLedger("rdp", grid_ratio=1.5)
    seen_exact = 0
    for _ in range(1, 40):
        ledger.step(1.0, 0.05)
        bound = ledger.epsilon_bound(DELTA)
        exact = ledger.get_epsilon(DELTA)
        assert bound >= exact - 1e-12
        seen_exact += math.isclose(bound, exact, rel_tol=1e-12)
    assert seen_exact >= 5  # grid points 1, 2, 3, 5, 8, 12, 18, 27, ...


def test_grid_min_gap_spaces_the_accountant_calls() -> None:
    ledger = PrivacyLedger("rdp", grid_ratio=1.1, grid_min_gap=10)
    for _ in range(35):
        ledger.step(1.0, 0.05)
        assert ledger.epsilon_bound(DELTA) >= ledger.get_epsilon(DELTA) - 1e-12
    points = next(iter(ledger._grids.values()))[0]
    assert points == [1, 11, 21, 31, 41]


def test_epsilon_bound_is_cached_between_grid_points() -> None:
    ledger = PrivacyLedger("prv", grid_ratio=2.0)
    ledger.step(1.0, 0.01, 100)
    ledger.epsilon_bound(DELTA)
    grid = next(iter(ledger._grids.values()))
    calls = len(grid[0])
    ledger.step(1.0, 0.01, 20)  # 120 <= 128, the next grid point
    ledger.epsilon_bound(DELTA)
    assert len(grid[0]) == calls


def test_zero_noise_is_infinite_and_empty_history_is_zero() -> None:
    assert compute_epsilon([], DELTA) == 0.0
    assert math.isinf(compute_epsilon([(0.0, 0.1, 3)], DELTA))


def test_gdp_refuses_a_changing_history() -> None:
    with pytest.raises(ValueError, match="gdp"):
        compute_epsilon([(1.0, 0.1, 3), (2.0, 0.1, 3)], DELTA, "gdp")


def test_state_round_trip() -> None:
    ledger = PrivacyLedger("prv")
    ledger.step(1.3, 0.01, 17)
    restored = PrivacyLedger("prv")
    restored.load_state_dict(ledger.state_dict())
    assert restored.history == ledger.history and restored.steps == 17


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_calibration_matches_opacus_and_meets_the_target(accountant: str) -> None:
    sigma = calibrate_noise_multiplier(2.0, DELTA, 0.05, 200, accountant)
    expected = get_noise_multiplier(
        target_epsilon=2.0,
        target_delta=DELTA,
        sample_rate=0.05,
        steps=200,
        accountant=accountant,
        epsilon_tolerance=0.01,
    )
    assert sigma == pytest.approx(expected)
    assert compute_epsilon([(sigma, 0.05, 200)], DELTA, accountant) <= 2.0


def test_calibration_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(0.0, DELTA, 0.1, 10)
    with pytest.raises(ValueError, match="steps"):
        calibrate_noise_multiplier(1.0, DELTA, 0.1, 0)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_is_never_negative(accountant: str) -> None:
    # At δ = 0.5 both accountants return ε < 0 for this history; (0, δ)-DP is what that certifies.
    assert compute_epsilon([(1.0, 0.25, 8)], 0.5, accountant) == 0.0


def test_the_planned_end_is_a_grid_point_so_the_last_bound_is_exact() -> None:
    """The progress bar showed 3.113 for a run calibrated to ε = 3 (exact 2.995): the end fell between points."""
    ledger = PrivacyLedger("rdp", grid_ratio=1.5)
    ledger.grid_end = 200
    for _ in range(200):
        ledger.step(1.0, 0.05)
        bound = ledger.epsilon_bound(DELTA)
        assert bound >= ledger.get_epsilon(DELTA) - 1e-12
    assert bound == pytest.approx(ledger.get_epsilon(DELTA), rel=1e-12)
    free = PrivacyLedger("rdp", grid_ratio=1.5)  # without the planned end, 200 is not a grid point
    for _ in range(200):
        free.step(1.0, 0.05)
    assert free.epsilon_bound(DELTA) > free.get_epsilon(DELTA) * 1.001
