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
k₊, k₋ and the scoring procedure must be fixed in advance (they are arguments here), and the
scores must never read which canaries were included.

:func:`audit` runs the whole experiment through the DP strategy on a white-box probe whose
canaries are gradient-space "Dirac" canaries (Steinke et al.; Nasr et al., "Tight Auditing of
Differentially Private Machine Learning", USENIX Security 2023): canary i's loss is linear in
a coordinate w_i that no other example touches, so its gradient is a constant of norm far
above C, which the mechanism clips to exactly C. Every released step t then carries, in that
coordinate, x_{t,i} = b_{t,i} + σ·z in units of C, where b_{t,i} = 1 if the canary was in the
step's Poisson batch. The DP guarantee covers all the released steps, so the score reads every
step (not only the final weights): the log-likelihood ratio of "included" against "not
included" for a Poisson(q) Gaussian mechanism that adds μ per sampled step and noise of std s,

    score_i = Σ_t log(1 − q + q · exp(μ (x_{t,i} − μ/2) / s²)),

with μ and s estimated from all canaries' steps (:func:`fit_canary_steps`; μ = 1, s = σ for a
correct mechanism). That is, up to the estimates, the most powerful test against the mechanism that actually ran,
whether it adds too little noise (s < σ) or clips too loosely (μ > 1); it never reads which
canaries were included, so the bound stays valid. :func:`sabotaged` breaks the mechanism in
these ways (noise off or scaled, clipping off or scaled), to validate the audit. The audit
checks the mechanism (sampling, clipping, noise and accounting of the strategy), not a
particular model of yours; for your own model, compute scores of your own canaries and call
:func:`epsilon_lower_bound`.

dplightning audit                                   # default budget: 10,000 canaries, 50 steps
dplightning audit --sabotage noise_scale --sabotage-factor 0.25   # the audit must flag this one
"""

from __future__ import annotations

import argparse
import inspect
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
from dplightning.losses import batch_loss
from dplightning.privacy import mechanism
from dplightning.privacy.noise import GaussianNoise

Sabotage = Literal["noise", "clipping", "noise_scale", "clipping_scale"]
SABOTAGES: tuple[str, ...] = ("noise", "clipping", "noise_scale", "clipping_scale")


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


def fit_canary_steps(updates: Tensor, sample_rate: float, inclusion_rate: float = 0.5) -> tuple[float, float]:
    """Shift μ and noise std s of a released canary coordinate, estimated from every canary's steps.

    Each entry of ``updates`` is μ·b + s·z with b ~ Bernoulli(q · inclusion_rate): s is the
    median absolute deviation (a 1.4826 factor makes it the std of a Gaussian; the few shifted
    entries barely move it), μ the mean over that Bernoulli rate. A post-processing of the
    released steps that never reads which canaries were included, so any bound built on it
    stays valid.

    Args:
        updates: ``[steps, m]`` released sums in each canary's coordinate, in units of C.
        sample_rate: Poisson sample rate q of a step.
        inclusion_rate: Probability that a canary is in the data set.

    Returns:
        (μ, s), s at least 10⁻³ (noise switched off).
    """
    x = updates.double().flatten()
    noise_std = 1.4826 * (x - x.median()).abs().median().item()
    return x.mean().item() / (sample_rate * inclusion_rate), max(noise_std, 1e-3)


def membership_scores(updates: Tensor, sample_rate: float, shift: float, noise_std: float) -> Tensor:
    """Per-canary log-likelihood ratio of "included" against "not included", from every step.

    Args:
        updates: ``[steps, m]`` released sums in each canary's coordinate, in units of C.
        sample_rate: Poisson sample rate q of a step.
        shift: μ, what a sampled canary adds to its coordinate (1 for a correct mechanism).
        noise_std: s, the std of the noise in that coordinate (σ for a correct mechanism).

    Returns:
        ``[m]`` scores Σ_t log((1 − q) φ_s(x) + q φ_s(x − μ)) − log φ_s(x), with φ_s the N(0, s²) density.
    """
    if not 0 < sample_rate <= 1 or noise_std <= 0:
        raise ValueError(f"Need 0 < sample_rate <= 1 and noise_std > 0, got {sample_rate}, {noise_std}.")
    x = updates.double()
    sampled = math.log(sample_rate) + shift * (x - shift / 2) / noise_std**2  # log q·φ_s(x − μ)/φ_s(x)
    if sample_rate == 1:
        return sampled.sum(0)
    return torch.logaddexp(torch.full_like(x, math.log1p(-sample_rate)), sampled).sum(0)


# ------------------------------------------------------------------ sabotage (validating the audit)


def _scaled_noise(factor: float) -> Any:
    sample = GaussianNoise.sample

    def scaled(self: GaussianNoise, like: Tensor, std: float) -> Tensor:
        return sample(self, like, std * factor)

    return scaled


def _scaled_clipping(factor: float) -> Any:
    clip_factors = mechanism.clip_factors

    def scaled(norms: Tensor, max_norm: float) -> Tensor:
        return clip_factors(norms, max_norm * factor)

    return scaled


@contextmanager
def sabotaged(kind: Sabotage | None, factor: float | None = None) -> Iterator[None]:
    """Break the mechanism on purpose, while the accountant still claims the full guarantee.

    ``"noise"``: no noise is added; ``"clipping"``: per-example gradients are not clipped;
    ``"noise_scale"``: the noise std is ``factor`` times what it should be (0.25: σ/4);
    ``"clipping_scale"``: gradients are clipped to ``factor`` · C instead of C (4: 4C).
    For validating the audit only; ``None`` changes nothing.

    Raises:
        ValueError: On an unknown ``kind``, or a ``factor`` missing, given to a kind without
            one, or not positive and finite.
    """
    scaled = kind in ("noise_scale", "clipping_scale")
    if scaled != (factor is not None):
        raise ValueError(f"Sabotage {kind!r} {'needs' if scaled else 'takes no'} factor (got {factor!r}).")
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"The sabotage factor must be positive and finite, got {factor}.")
    if kind is None:
        yield
    elif kind == "noise":
        with mock.patch.object(GaussianNoise, "sample", lambda self, like, std: torch.zeros_like(like)):
            yield
    elif kind == "clipping":
        with mock.patch.object(mechanism, "clip_factors", lambda norms, max_norm: torch.ones_like(norms)):
            yield
    elif kind == "noise_scale":
        with mock.patch.object(GaussianNoise, "sample", _scaled_noise(factor)):
            yield
    elif kind == "clipping_scale":
        with mock.patch.object(mechanism, "clip_factors", _scaled_clipping(factor)):
            yield
    else:
        raise ValueError(f"Unknown sabotage {kind!r}; choose one of {SABOTAGES} or None.")


# ------------------------------------------------------------------ the experiment


class _CanaryProbe(pl.LightningModule):
    """A linear classifier for the ordinary examples beside one Dirac coordinate per canary.

    A batch row is (features, label, canary index); ordinary rows have index m, which selects
    no coordinate. Canary i's loss is −canary_norm · w_i: its gradient is −canary_norm · e_i
    wherever the weights are, and it touches nothing else.
    """

    def __init__(self, features: int, classes: int, canaries: int, canary_norm: float, lr: float) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.canary = nn.Linear(canaries, 1, bias=False)
        nn.init.zeros_(self.canary.weight)
        self.canary_norm = canary_norm
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, index = batch
        m = self.canary.in_features
        ordinary = (index == m).float()
        dirac = F.one_hot(index, m + 1)[:, :m].to(x.dtype) * self.canary_norm  # an ordinary row's is all zero
        ce = F.cross_entropy(self.linear(x), y, reduction="none") * ordinary
        loss = ce - self.canary(dirac).squeeze(-1)
        return batch_loss(loss)  # a mean loss; not logged

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _CanaryRecorder(pl.Callback):
    """Keeps the canary coordinates after every optimizer step (the released iterates)."""

    def __init__(self) -> None:
        self.iterates: list[Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.iterates = [pl_module.canary.weight.detach()[0].double().clone()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.iterates.append(pl_module.canary.weight.detach()[0].double().clone())


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
    max_grad_norm: float
    sample_rate: float
    sabotage: str | None
    sabotage_factor: float | None

    @property
    def violation(self) -> bool:
        """Whether the audit refutes the claim (lower bound above the claimed ε)."""
        return self.epsilon_lower_bound > self.claimed_epsilon


def audit(
    canaries: int = 10_000,
    regular: int = 1000,
    features: int = 16,
    classes: int = 2,
    batch_size: int = 120,
    steps: int = 50,
    noise_multiplier: float = 1.0,
    max_grad_norm: float = 1.0,
    canary_scale: float = 100.0,
    lr: float = 1.0,
    delta: float = 1e-6,
    confidence: float = 0.95,
    k_pos: int = 200,
    k_neg: int = 0,
    seed: int | None = None,
    sabotage: Sabotage | None = None,
    sabotage_factor: float | None = None,
    accountant: str = "prv",
) -> AuditResult:
    """Train the Dirac-canary probe with ``strategy="dp"`` and bound ε from below.

    The defaults (claimed ε ≈ 1.5 at δ = 10⁻⁶) are sized so that the real mechanism's bound
    stays well below the claim and noise at σ/4 or clipping at 4C exceed it (see the
    detection-power table of docs/trust.md, made by ``benchmarks/audit_power.py``).

    Args:
        canaries: m, each included with probability 1/2; keep 2·m·δ well below 1 − confidence.
        regular: Ordinary examples, always included.
        features: Input features of the ordinary examples.
        classes: Classes of the ordinary examples' linear classifier.
        batch_size: Expected batch size; q = batch_size / N.
        steps: Optimizer steps.
        noise_multiplier: σ of the strategy.
        max_grad_norm: C of the strategy.
        canary_scale: A canary's gradient norm, in units of C (above every clipping bound that
            should show, e.g. 4C).
        lr: SGD learning rate (any positive value: the scores undo it).
        delta: δ of the strategy and of the audit.
        confidence: Confidence level of the lower bound.
        k_pos: Guesses "in" (highest scores), fixed before the scores are seen.
        k_neg: Guesses "out" (lowest scores).
        seed: Seeds the canary draw, the data, the sampling and the noise (``None``: OS entropy
            for the strategy, a fresh draw for the rest).
        sabotage: Break the mechanism (:func:`sabotaged`) to check that the audit notices.
        sabotage_factor: The factor of ``"noise_scale"`` and ``"clipping_scale"``.
        accountant: The strategy's accountant.
    """
    run = _train_probe(
        canaries, regular, features, classes, batch_size, steps, noise_multiplier, max_grad_norm,
        canary_scale, lr, delta, seed, sabotage, sabotage_factor, accountant,
    )  # fmt: skip
    shift, noise_std = fit_canary_steps(run.updates, run.sample_rate)
    scores = membership_scores(run.updates, run.sample_rate, shift, noise_std)
    r, v = guesses(scores, run.included, k_pos, k_neg)
    return AuditResult(
        epsilon_lower_bound=epsilon_lower_bound(canaries, r, v, delta, confidence),
        claimed_epsilon=run.claimed_epsilon,
        delta=delta,
        confidence=confidence,
        canaries=canaries,
        included=int(run.included.sum()),
        guesses=r,
        correct=v,
        steps=run.steps,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        sample_rate=run.sample_rate,
        sabotage=sabotage,
        sabotage_factor=sabotage_factor,
    )


@dataclass(frozen=True)
class _ProbeRun:
    updates: Tensor
    """``[steps, m]`` released sum of each step in each canary's coordinate, in units of C."""
    included: Tensor
    sample_rate: float
    claimed_epsilon: float
    steps: int


def _train_probe(
    canaries: int,
    regular: int,
    features: int,
    classes: int,
    batch_size: int,
    steps: int,
    noise_multiplier: float,
    max_grad_norm: float,
    canary_scale: float,
    lr: float,
    delta: float,
    seed: int | None,
    sabotage: Sabotage | None,
    sabotage_factor: float | None,
    accountant: str,
) -> _ProbeRun:
    """Draw the canaries, train the probe with ``strategy="dp"`` and read the released steps back."""
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    x = torch.randn(regular, features, generator=generator)
    y = (x @ torch.randn(features, classes, generator=generator)).argmax(1)
    included = torch.rand(canaries, generator=generator) < 0.5
    inside = int(included.sum())
    data = TensorDataset(
        torch.cat([x, torch.zeros(inside, features)]),
        torch.cat([y, torch.zeros(inside, dtype=torch.long)]),
        torch.cat([torch.full((regular,), canaries), torch.arange(canaries)[included]]),
    )
    module = _CanaryProbe(features, classes, canaries, canary_scale * max_grad_norm, lr)
    recorder = _CanaryRecorder()
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
            callbacks=[recorder],
        )
        with sabotaged(sabotage, sabotage_factor):
            trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=True))
    # SGD without momentum: w_{t+1} − w_t = lr · (clipped sum + noise) / (q·N), the public expected batch
    state = strategy.dp_state
    expected_batch = float(state.expected_batch_size or 0.0)
    updates = torch.stack(recorder.iterates).diff(dim=0) * expected_batch / (lr * max_grad_norm)
    return _ProbeRun(
        updates=updates,
        included=included,
        sample_rate=float(state.sample_rate or 0.0),
        claimed_epsilon=state.get_epsilon(delta),
        steps=state.steps,
    )


_OPTION_HELP = {
    "canaries": "Number m of canaries, each put into the training set with probability 1/2; keep 2·m·δ well "
    "below 1 − confidence.",
    "regular": "Ordinary training examples, always included (with the included canaries they make N).",
    "batch_size": "Expected Poisson batch size; q = batch_size / N.",
    "steps": "Optimizer steps of the audited run; the score reads every released step.",
    "noise_multiplier": "σ of the DP strategy under audit.",
    "max_grad_norm": "Clipping bound C of the DP strategy (a canary's gradient is far above it before clipping).",
    "delta": "δ of the claimed guarantee and of the audit's bound.",
    "confidence": "Confidence level of the empirical lower bound on ε.",
    "k_pos": "Guesses 'in' for the k₊ canaries with the highest scores, fixed before the scores are seen.",
    "k_neg": "Guesses 'out' for the k₋ canaries with the lowest scores.",
    "accountant": "Accountant of the claimed ε (prv, rdp or gdp).",
}
"""The --help text of each option that mirrors an argument of :func:`audit`."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplightning audit``; exit status 1 if the audit refutes the claimed ε."""
    defaults = inspect.signature(audit).parameters
    parser = argparse.ArgumentParser(prog="dplightning audit", description=__doc__.split("\n\n")[0])
    for name, kind in [("canaries", int), ("regular", int), ("batch_size", int), ("steps", int),
                       ("noise_multiplier", float), ("max_grad_norm", float), ("delta", float),
                       ("confidence", float), ("k_pos", int), ("k_neg", int),
                       ("accountant", str)]:  # fmt: skip
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=defaults[name].default,
                            help=_OPTION_HELP[name] + " (default: %(default)s)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None,
                        help="Seeds the canaries, data, sampling and noise, for reproducing a run (tests only: a "
                        "seeded mechanism is not private); default OS entropy.")  # fmt: skip
    parser.add_argument("--sabotage", choices=SABOTAGES, default=None,
                        help="Break the mechanism on purpose, to check that the audit notices: noise (none "
                        "added), clipping (none applied), or noise_scale / clipping_scale with --sabotage-factor. "
                        "The claimed ε stays that of the intact mechanism.")  # fmt: skip
    parser.add_argument("--sabotage-factor", type=float, default=None,
                        help="Factor of noise_scale (0.25: σ/4) and clipping_scale (4: 4C).")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="Print the result as JSON instead of two lines of text.")
    args = vars(parser.parse_args(argv))
    as_json = args.pop("json")
    torch.set_num_threads(1)
    result = audit(**args)
    if as_json:
        print(json.dumps(_as_dict(result), indent=2))
    else:
        print(_summary(result))
    return 1 if result.violation else 0


def _summary(result: AuditResult) -> str:
    verdict = "VIOLATION: the mechanism leaks more than claimed" if result.violation else "consistent with the claim"
    sabotage = f", sabotage = {result.sabotage}" if result.sabotage else ""
    if result.sabotage_factor is not None:
        sabotage += f" x {result.sabotage_factor:g}"
    return (
        f"empirical ε ≥ {result.epsilon_lower_bound:.3f} at {result.confidence:.0%} confidence vs claimed "
        f"ε = {result.claimed_epsilon:.3f} (δ = {result.delta:.3g}): {verdict}\n"
        f"  {result.correct}/{result.guesses} correct guesses on {result.canaries} canaries "
        f"({result.included} included), {result.steps} steps, σ = {result.noise_multiplier}, "
        f"C = {result.max_grad_norm}, q = {result.sample_rate:.4g}{sabotage}"
    )


def _as_dict(result: AuditResult) -> dict[str, Any]:
    return {**asdict(result), "violation": result.violation}
