"""An empirical privacy audit: a lower bound on ε from membership inference on canaries, in one run.

The statistics are those of Steinke, Nasr and Jagielski, "Privacy Auditing with One (1)
Training Run" (NeurIPS 2023): m canaries are each put into the training set independently
with probability 1/2; after training, the auditor guesses "in" for the k₊ canaries with the
highest scores, "out" for the k₋ with the lowest, and abstains on the rest. Under (ε, δ)-DP
the number v of correct guesses among those r = k₊ + k₋ is dominated by Binomial(r, e^ε/(1+e^ε))
up to a δ term (their Corollary 5.4, code of their Appendix D):

    p(ε) = P[Binomial(r, q_ε) ≥ v] + 2mδ · max_{i=1..v} P[v > Binomial(r, q_ε) ≥ v − i] / i,
    q_ε = 1 / (1 + e^{−ε}),

so every ε with p(ε) < 1 − confidence is rejected; the largest such ε is the lower bound.
k₊, k₋ must be fixed before the scores are seen (they are arguments here).

:func:`audit` runs the whole experiment through the DP strategy on a white-box probe that
makes the canaries as strong as the mechanism allows (after Steinke et al.'s "Dirac"
canaries): a linear classifier whose inputs have one extra coordinate per canary, which
only that canary sets. Its gradient then lands in its own weight column, which no other
example touches, and the score of a canary is how far training moved that column towards
its label. With the real mechanism the lower bound stays below the claimed ε; with the
noise switched off or the clipping disabled (:func:`sabotaged`, for validating the audit)
it exceeds it. The audit checks the mechanism (clipping, noise, sampling and accounting of
the strategy), not a particular model of yours; for your own model, compute scores of your
own canaries and call :func:`epsilon_lower_bound`.

dplightning audit --canaries 1000 --steps 50 --noise-multiplier 3.0
dplightning audit --sabotage noise      # the audit must flag this one
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal
from unittest import mock

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from scipy import stats
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.privacy import mechanism
from dplightning.privacy.noise import GaussianNoise

Sabotage = Literal["noise", "clipping"]


# ------------------------------------------------------------------ the statistics


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of ≥ ``v`` correct guesses out of ``r`` on ``m`` canaries under (ε, δ)-DP (Cor. 5.4)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"Need 0 <= v <= r <= m, got v={v}, r={r}, m={m}.")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"Need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}.")
    q = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of ε-DP randomized response
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(beta, 1.0)
    i = torch.arange(1, v + 1, dtype=torch.float64)
    # P[v > Binomial(r, q) >= v - i] = P[B >= v - i] - P[B >= v], for i = 1..v
    below = torch.from_numpy(stats.binom.sf((v - i - 1).numpy(), r, q)) - beta
    alpha = float((below / i).max().clamp(min=0.0))
    return min(beta + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """Largest ε that ``v`` correct guesses out of ``r`` (``m`` canaries) reject at ``confidence``.

    Bisection on :func:`one_run_p_value`, which falls as ε falls; returns the low end of the
    bracket (conservative), 0 if not even ε = 0 is rejected.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}.")
    alpha = 1.0 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0  # p(lo) < alpha <= p(hi)
    while one_run_p_value(m, r, v, hi, delta) < alpha:
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return lo
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) < alpha else (lo, mid)
    return lo


def guesses(scores: Tensor, included: Tensor, k_pos: int, k_neg: int) -> tuple[int, int]:
    """(r, v): guess "in" for the ``k_pos`` highest scores and "out" for the ``k_neg`` lowest.

    Raises:
        ValueError: If the guesses overlap (``k_pos + k_neg`` > number of canaries).
    """
    m = scores.numel()
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
        raise ValueError(f"Need k_pos, k_neg >= 0 and k_pos + k_neg <= {m} canaries, got {k_pos}, {k_neg}.")
    order = torch.argsort(scores, descending=True, stable=True)
    inside = included.bool()[order]
    correct = int(inside[:k_pos].sum()) + int((~inside[m - k_neg :]).sum())
    return k_pos + k_neg, correct


# ------------------------------------------------------------------ sabotage (validating the audit)


@contextmanager
def sabotaged(kind: Sabotage | None) -> Iterator[None]:
    """Break the mechanism on purpose, while the accountant still claims the full guarantee.

    ``"noise"``: no noise is added; ``"clipping"``: per-example gradients are not clipped.
    For validating the audit only (it must detect both); ``None`` changes nothing.
    """
    if kind is None:
        yield
    elif kind == "noise":
        with mock.patch.object(GaussianNoise, "sample", lambda self, like, std: torch.zeros_like(like)):
            yield
    elif kind == "clipping":
        with mock.patch.object(mechanism, "clip_factors", lambda norms, max_norm: torch.ones_like(norms)):
            yield
    else:
        raise ValueError(f"Unknown sabotage {kind!r}; choose 'noise', 'clipping' or None.")


# ------------------------------------------------------------------ the experiment


class _LinearProbe(pl.LightningModule):
    def __init__(self, features: int, classes: int, lr: float) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.linear(x), y, reduction="sum") / max(len(y), 1)  # Poisson batches can be empty

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _NoEpsilonProgress(pl.Callback):
    """Stands in for the strategy's per-step ε display: the audit needs ε once, at the end."""

    shows_epsilon = True


@dataclass(frozen=True)
class AuditResult:
    """The outcome of :func:`audit`."""

    epsilon_lower_bound: float
    """Empirical ε: the mechanism is not (ε, δ)-DP for any smaller ε, at ``confidence``."""
    claimed_epsilon: float
    """ε the strategy's accountant reports for the run, at the same δ."""
    delta: float
    confidence: float
    canaries: int
    included: int
    guesses: int
    correct: int
    steps: int
    noise_multiplier: float
    sample_rate: float
    sabotage: str | None

    @property
    def violation(self) -> bool:
        """Whether the audit refutes the claim (lower bound above the claimed ε)."""
        return self.epsilon_lower_bound > self.claimed_epsilon


def audit(
    canaries: int = 1000,
    regular: int = 500,
    features: int = 16,
    classes: int = 2,
    batch_size: int = 100,
    steps: int = 50,
    noise_multiplier: float = 3.0,
    max_grad_norm: float = 1.0,
    canary_scale: float = 100.0,
    lr: float = 1.0,
    delta: float = 1e-6,
    confidence: float = 0.95,
    guess_fraction: float = 0.25,
    seed: int | None = None,
    sabotage: Sabotage | None = None,
    accountant: str = "prv",
) -> AuditResult:
    """Train the white-box canary probe with ``strategy="dp"`` and bound ε from below.

    Args:
        canaries: m, each included with probability 1/2.
        regular: Ordinary examples, always included.
        features: Input features of the ordinary examples (the canaries use their own coordinates).
        classes: Classes of the linear classifier.
        batch_size: Expected batch size; q = batch_size / N.
        steps: Optimizer steps.
        noise_multiplier: σ of the strategy.
        max_grad_norm: C of the strategy.
        canary_scale: Magnitude of a canary's own input coordinate (its gradient is about
            that large before clipping, so disabling clipping shows).
        lr: SGD learning rate.
        delta: δ of the strategy and of the audit; keep 2·m·δ well below 1 − confidence.
        confidence: Confidence level of the lower bound.
        guess_fraction: k₊ = k₋ = this fraction of m, fixed before the scores are seen.
        seed: Seeds the canary draw, the data, the sampling and the noise (``None``: OS entropy
            for the strategy, a fresh draw for the rest).
        sabotage: Break the mechanism (:func:`sabotaged`) to check that the audit notices.
        accountant: The strategy's accountant.
    """
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    dim = features + canaries
    x_regular = torch.zeros(regular, dim)
    x_regular[:, :features] = torch.randn(regular, features, generator=generator)
    y_regular = (x_regular[:, :features] @ torch.randn(features, classes, generator=generator)).argmax(1)
    x_canary = torch.zeros(canaries, dim)
    x_canary[torch.arange(canaries), features + torch.arange(canaries)] = canary_scale
    y_canary = torch.randint(classes, (canaries,), generator=generator)
    included = torch.rand(canaries, generator=generator) < 0.5
    data = TensorDataset(torch.cat([x_regular, x_canary[included]]), torch.cat([y_regular, y_canary[included]]))

    module = _LinearProbe(dim, classes, lr)
    with torch.no_grad():
        module.linear.weight[:, features:] = 0.0  # each canary's column starts at zero
    start = module.linear.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-data warnings of Lightning
        strategy = dplightning.DPStrategy(
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            delta=delta,
            accountant=accountant,
            seed=seed,
        )
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[_NoEpsilonProgress()],
        )
        with sabotaged(sabotage):
            trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=True))

    moved = (module.linear.weight.detach() - start)[:, features:]  # [classes, m]: column j is canary j's
    towards_label = moved[y_canary, torch.arange(canaries)] - moved.mean(0)
    k = int(guess_fraction * canaries)
    r, v = guesses(towards_label, included, k, k)
    return AuditResult(
        epsilon_lower_bound=epsilon_lower_bound(canaries, r, v, delta, confidence),
        claimed_epsilon=strategy.get_epsilon(delta),
        delta=delta,
        confidence=confidence,
        canaries=canaries,
        included=int(included.sum()),
        guesses=r,
        correct=v,
        steps=strategy.steps,
        noise_multiplier=noise_multiplier,
        sample_rate=float(strategy.sample_rate or 0.0),
        sabotage=sabotage,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplightning audit``; exit status 1 if the audit refutes the claimed ε."""
    parser = argparse.ArgumentParser(prog="dplightning audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--regular", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--noise-multiplier", type=float, default=3.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--guess-fraction", type=float, default=0.25)
    parser.add_argument("--accountant", default="prv")
    parser.add_argument("--seed", type=int, default=None, help="For reproducing a run (tests); default OS entropy.")
    parser.add_argument("--sabotage", choices=["noise", "clipping"], default=None,
                        help="Break the mechanism on purpose, to check that the audit notices.")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = audit(
        canaries=args.canaries,
        regular=args.regular,
        batch_size=args.batch_size,
        steps=args.steps,
        noise_multiplier=args.noise_multiplier,
        max_grad_norm=args.max_grad_norm,
        delta=args.delta,
        confidence=args.confidence,
        guess_fraction=args.guess_fraction,
        seed=args.seed,
        sabotage=args.sabotage,
        accountant=args.accountant,
    )
    if args.json:
        print(json.dumps(_as_dict(result), indent=2))
    else:
        verdict = "consistent with the claim"
        if result.violation:
            verdict = "VIOLATION: the mechanism leaks more than claimed"
        print(
            f"empirical ε ≥ {result.epsilon_lower_bound:.3f} at {result.confidence:.0%} confidence vs claimed "
            f"ε = {result.claimed_epsilon:.3f} (δ = {result.delta:.3g}): {verdict}\n"
            f"  {result.correct}/{result.guesses} correct guesses on {result.canaries} canaries "
            f"({result.included} included), {result.steps} steps, σ = {result.noise_multiplier}, "
            f"q = {result.sample_rate:.4g}" + (f", sabotage = {result.sabotage}" if result.sabotage else "")
        )
    return 1 if result.violation else 0


def _as_dict(result: AuditResult) -> dict[str, Any]:
    return {**asdict(result), "violation": result.violation}
