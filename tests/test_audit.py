"""The one-run privacy audit: its statistics against the paper's code and the likelihood ratio, the sabotage
modes, and both directions end to end at the default budget (σ/4 and 4C must be flagged)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from dplightning.cli import main as cli_main
from dplightning.commands.audit import (
    _train_probe,
    audit,
    epsilon_lower_bound,
    fit_canary_steps,
    guesses,
    membership_scores,
    one_run_p_value,
    sabotaged,
)
from dplightning.privacy import mechanism
from dplightning.privacy.clipping import clip_factors
from dplightning.privacy.noise import GaussianNoise


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


def test_membership_scores_are_the_likelihood_ratio_of_a_poisson_gaussian_step() -> None:
    x = torch.tensor([[-1.0, 0.0, 0.4, 1.0, 3.0], [0.5, 2.0, -0.3, 0.0, 1.5]])
    q, mu, s = 0.02, 2.0, 0.5
    mixture = torch.from_numpy((1 - q) * stats.norm.pdf(x.numpy(), 0, s) + q * stats.norm.pdf(x.numpy(), mu, s))
    expected = (mixture.log() - torch.from_numpy(stats.norm.logpdf(x.numpy(), 0, s))).sum(0)
    assert torch.allclose(membership_scores(x, q, mu, s), expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(membership_scores(x, 1.0, mu, s), (mu * (x - mu / 2) / s**2).double().sum(0))
    with pytest.raises(ValueError, match="noise_std"):
        membership_scores(x, q, mu, 0.0)


@pytest.mark.parametrize(("mu", "s"), [(1.0, 1.0), (4.0, 1.0), (1.0, 0.25)])
def test_canary_step_fit_recovers_the_shift_and_the_noise(mu: float, s: float) -> None:
    generator = torch.Generator().manual_seed(0)
    q, steps, m = 0.02, 50, 10_000
    sampled = (torch.rand(steps, m, generator=generator) < q) & (torch.rand(m, generator=generator) < 0.5)
    updates = mu * sampled + s * torch.randn(steps, m, generator=generator)
    fitted_mu, fitted_s = fit_canary_steps(updates, q)
    assert fitted_mu == pytest.approx(mu, abs=0.2 * s) and fitted_s == pytest.approx(s, rel=0.03)
    assert fit_canary_steps(mu * sampled.double(), q)[1] == 1e-3  # noise switched off: the floor


def test_sabotage_scales_the_noise_std_and_the_clipping_bound() -> None:
    norms = torch.tensor([0.5, 2.0, 8.0])
    with sabotaged("clipping_scale", 4.0):
        assert torch.allclose(mechanism.clip_factors(norms, 1.0), clip_factors(norms, 4.0))
    with sabotaged("noise_scale", 0.25):
        noise = GaussianNoise(seed=0)
        noise.start_step(0)
        assert noise.sample(torch.zeros(20_000), 2.0).std().item() == pytest.approx(0.5, rel=0.03)
    assert torch.allclose(mechanism.clip_factors(norms, 1.0), clip_factors(norms, 1.0))  # restored
    for kind, factor in [("noise_scale", None), ("noise", 0.5), ("clipping_scale", 0.0), ("wrong", None)]:
        with pytest.raises(ValueError), sabotaged(kind, factor):  # type: ignore[arg-type]
            pass


@pytest.mark.filterwarnings(r"error:strategy\.\w+ is deprecated:DeprecationWarning")  # no alias read by the library
def test_canary_updates_are_in_units_of_the_clipping_bound() -> None:
    # Without noise, a step's released sum in a canary's coordinate is exactly 1 (one clipped gradient of
    # norm C) if the canary was in the Poisson batch, else 0; a canary left out of the data set never moves.
    run = _train_probe(
        canaries=300, regular=100, features=4, classes=2, batch_size=50, steps=8, noise_multiplier=1.0,
        max_grad_norm=0.3, canary_scale=100.0, lr=0.7, delta=1e-6, seed=0, sabotage="noise",
        sabotage_factor=None, accountant="prv",
    )  # fmt: skip
    assert run.updates.shape == (8, 300)
    counts = run.updates.round()
    assert torch.allclose(run.updates, counts, atol=1e-5) and set(counts.unique().tolist()) == {0.0, 1.0}
    assert run.updates[:, ~run.included].abs().max() < 1e-6
    per_step = counts[:, run.included].mean().item()  # the sample rate, up to sampling error
    assert per_step == pytest.approx(run.sample_rate, rel=0.25)


@pytest.mark.parametrize(("sabotage", "factor"),
                         [(None, None), ("noise_scale", 0.25), ("clipping_scale", 4.0), ("noise", None),
                          ("clipping", None)])  # fmt: skip
def test_default_audit_passes_the_real_mechanism_and_flags_sigma_over_4_and_4c(
    sabotage: str | None, factor: float | None
) -> None:
    result = audit(seed=0, sabotage=sabotage, sabotage_factor=factor)  # the default budget  # type: ignore[arg-type]
    assert result.steps == 50 and result.canaries == 10_000 and 1 < result.claimed_epsilon < 2
    if sabotage is None:
        assert result.epsilon_lower_bound <= result.claimed_epsilon and not result.violation
    else:
        assert result.epsilon_lower_bound > result.claimed_epsilon and result.violation


def test_cli_exit_status_says_whether_the_claim_is_refuted(capsys) -> None:
    small = ["audit", "--seed", "1", "--canaries", "1000", "--regular", "100", "--batch-size", "12", "--steps", "20",
             "--k-pos", "50"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*small, "--sabotage", "noise_scale", "--sabotage-factor", "0.25"])
    assert exit_info.value.code == 1 and "VIOLATION" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(small)
    assert exit_info.value.code == 0 and "consistent with the claim" in capsys.readouterr().out
