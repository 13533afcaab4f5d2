"""The one-run privacy audit: its statistics against the paper's code, and both directions end to end."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from dplightning.audit import audit, epsilon_lower_bound, guesses, one_run_p_value
from dplightning.cli import main as cli_main


def _paper_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """``p_value_DP_audit`` of Steinke, Nasr & Jagielski (NeurIPS 2023), Appendix D, as a loop."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1)


@pytest.mark.parametrize(("m", "r", "v", "eps", "delta"),
                         [(1000, 500, 500, 3.0, 1e-6), (1000, 500, 400, 1.0, 1e-5), (100, 50, 30, 0.5, 1e-3),
                          (1000, 500, 260, 0.1, 0.0)])  # fmt: skip
def test_p_value_is_the_papers(m: int, r: int, v: int, eps: float, delta: float) -> None:
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(_paper_p_value(m, r, v, eps, delta), rel=1e-9)


def test_lower_bound_is_the_largest_rejected_epsilon() -> None:
    eps = epsilon_lower_bound(1000, 200, 200, delta=0.0, confidence=0.95)
    # All r guesses right: P[Binomial(r, q) = r] = q^r = 0.05 at the bound, so q = 0.05^(1/r).
    q = 0.05 ** (1 / 200)
    assert eps == pytest.approx(math.log(q / (1 - q)), rel=1e-6)
    assert epsilon_lower_bound(1000, 200, 100, delta=1e-6) == 0.0  # chance accuracy rejects nothing


def test_guesses_take_the_top_and_bottom_scores() -> None:
    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = torch.tensor([1, 0, 1, 0, 0, 1])
    assert guesses(scores, included, 2, 2) == (4, 1 + 1)
    with pytest.raises(ValueError, match="k_pos"):
        guesses(scores, included, 4, 3)


@pytest.mark.parametrize("sabotage", [None, "noise", "clipping"])
def test_audit_passes_the_real_mechanism_and_catches_a_broken_one(sabotage: str | None) -> None:
    result = audit(seed=0, sabotage=sabotage)
    assert result.steps == 50 and 0 < result.claimed_epsilon < 2
    if sabotage is None:
        assert result.epsilon_lower_bound <= result.claimed_epsilon and not result.violation
    else:
        assert result.epsilon_lower_bound > result.claimed_epsilon and result.violation


def test_cli_exit_status_says_whether_the_claim_is_refuted(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["audit", "--seed", "1", "--canaries", "200", "--steps", "10", "--sabotage", "noise"])
    assert exit_info.value.code == 1 and "VIOLATION" in capsys.readouterr().out
