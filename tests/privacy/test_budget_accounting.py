"""Budget arithmetic: steps within a target ε (against Opacus' accountants) and σ_eff of joint releases."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import RDPAccountant

from dplightning.privacy.accounting import combined_noise_multiplier, split_noise_multiplier, steps_within_budget

DELTA = 1e-5


def _opacus_epsilon(history: list[tuple[float, float, int]]) -> float:
    accountant = RDPAccountant()
    accountant.history = [s for s in history if s[2] > 0]
    return accountant.get_epsilon(delta=DELTA) if accountant.history else 0.0


@pytest.mark.parametrize("prefix", [(), ((1.3, 0.05, 7),)])
def test_steps_within_budget_is_the_last_step_at_or_below_target(prefix: tuple) -> None:
    sigma, q = 1.0, 0.02
    target = (_opacus_epsilon([*prefix, (sigma, q, 40)]) + _opacus_epsilon([*prefix, (sigma, q, 41)])) / 2
    n = steps_within_budget(prefix, sigma, q, target, DELTA, "rdp")
    assert n == 40
    assert _opacus_epsilon([*prefix, (sigma, q, n)]) <= target < _opacus_epsilon([*prefix, (sigma, q, n + 1)])


def test_steps_within_budget_respects_the_cap_and_an_exhausted_prefix() -> None:
    target = _opacus_epsilon([(1.0, 0.02, 40)])
    assert steps_within_budget((), 1.0, 0.02, target, DELTA, "rdp", limit=25) == 25
    assert steps_within_budget((), 1.0, 0.02, target, DELTA, "rdp", limit=100) == 40
    assert steps_within_budget(((1.0, 0.02, 60),), 1.0, 0.02, target, DELTA, "rdp") == 0
    assert steps_within_budget((), 0.0, 0.02, target, DELTA, "rdp") == 0  # σ = 0: ε is infinite after one step


def test_combined_noise_multiplier_adds_precisions() -> None:
    assert combined_noise_multiplier([1.3]) == 1.3  # unchanged, bit for bit
    assert combined_noise_multiplier([1.0, 2.0]) == pytest.approx(1 / math.sqrt(1 + 1 / 4))
    assert combined_noise_multiplier([1.0, 0.0]) == 0.0
    sigma = split_noise_multiplier(0.9, [4.0])
    assert combined_noise_multiplier([sigma, 4.0]) == pytest.approx(0.9, rel=1e-14)
    assert split_noise_multiplier(0.9, []) == 0.9
    with pytest.raises(ValueError, match="alone exceed"):
        split_noise_multiplier(0.9, [0.9])
