"""The public DP state of a run, one read-only object: ``trainer.strategy.dp_state``.

Callbacks, the CLI and user code read the run's privacy state here rather than from the
strategy: σ, q, δ, the ledger and ε (public: the same on every rank, and anything computed
from them may be released), and the last step's raw per-example statistics (**not
private**: this rank's examples only, never to be released with the model).

The object lives as long as its strategy, so a callback may keep it from ``setup`` on; its
values follow the run. It satisfies :class:`~dplightning.protocols.AccountingSource`,
:class:`~dplightning.protocols.NormSource` and
:class:`~dplightning.protocols.StepReleaseSource`.

When to read the per-step values: the strategy privatizes inside the optimizer closure, so
from ``on_before_optimizer_step`` on (once per optimizer step, also with
``accumulate_grad_batches=k``) :attr:`DPState.last_step_stats` holds the current step's
statistics and :attr:`DPState.ledger` already counts the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dplightning.privacy.accounting import PrivacyLedger
from dplightning.privacy.clipping import ClipGroup
from dplightning.privacy.matrix_mechanism import Strategy as NoiseStrategy
from dplightning.privacy.mechanism import MicroBatchStats
from dplightning.strategies.accounting import PrivacyAccounting
from dplightning.strategies.config import DPConfig

if TYPE_CHECKING:
    from dplightning.strategies.private_step import PrivateStep


@dataclass(frozen=True)
class CorrelatedPlan:
    """The public plan of a correlated noise mechanism, built when training starts.

    Attributes:
        strategy: The strategy matrix C, built for the planned steps and the optimizer's workload.
        sensitivity: The sensitivity of C x in units of Δ, which the noise is calibrated to.
        marginal: Std of z_t per unit std of w, for every step t.
    """

    strategy: NoiseStrategy
    sensitivity: float
    marginal: np.ndarray


@dataclass
class FitParts:
    """What the fits of a run add to its configuration and accounting.

    The strategy's Lightning hooks write these; :class:`DPState` reads them.

    Attributes:
        step: The private step of the fit running now (``None`` outside a fit).
        final_stats: The last step's statistics of the last fit, kept after its teardown.
        final_nonfinite: Its count of examples with a non-finite per-example gradient.
        correlated: The plan of a correlated mechanism, once training has started.
    """

    step: PrivateStep | None = None
    final_stats: list[MicroBatchStats] = field(default_factory=list)
    final_nonfinite: int = 0
    correlated: CorrelatedPlan | None = None


class DPState:
    """The public DP state of a run under a DP strategy, read-only (``trainer.strategy.dp_state``).

    Args:
        config: The strategy's DP arguments.
        accounting: Its σ, q, N, δ and ledger.
        fit: What its fits set up.
    """

    def __init__(self, config: DPConfig, accounting: PrivacyAccounting, fit: FitParts) -> None:
        self._config = config
        self._accounting = accounting
        self._fit = fit

    # ------------------------------------------------------------------ the configuration

    @property
    def poisson_sampling(self) -> bool:
        """Whether batches are Poisson-sampled (otherwise ε is infinite)."""
        return self._config.poisson_sampling

    @property
    def secure_mode(self) -> bool:
        """Whether noise and sampling come from the OS CSPRNG."""
        return self._config.secure_mode

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C (the joint sensitivity for group clipping)."""
        return self._config.max_grad_norm

    @property
    def target_epsilon(self) -> float | None:
        """The ε the run is calibrated for, if any."""
        return self._config.target_epsilon

    @property
    def noise_mechanism(self) -> str:
        """``"gaussian"`` (DP-SGD), ``"band_mf"`` or ``"blt"``."""
        return self._config.noise_mechanism

    # ------------------------------------------------------------------ the accounting (public)

    @property
    def noise_multiplier(self) -> float | None:
        """σ of the gradient; ``None`` until calibrated from ``target_epsilon`` (at the start of fit)."""
        return self._accounting.noise_multiplier

    @property
    def accounted_noise_multiplier(self) -> float | None:
        """σ the ledger records per step: σ_eff of the gradient and every registered step release."""
        return self._accounting.accounted_noise_multiplier

    @property
    def step_releases(self) -> dict[str, float]:
        """Registered per-step releases besides the gradient: name -> noise multiplier."""
        return self._accounting.step_releases

    @property
    def ledger(self) -> PrivacyLedger:
        """The (σ, q, steps) history of the run, its exact ε and a cheap bound (read it; never step it)."""
        return self._accounting.ledger

    @property
    def sample_rate(self) -> float | None:
        """Poisson sampling rate q (global), known once the train loader is set up."""
        return self._accounting.sample_rate

    @property
    def expected_batch_size(self) -> float | None:
        """Public expected batch size q·N that the noisy sum is divided by."""
        return self._accounting.expected_batch_size

    @property
    def delta(self) -> float | None:
        """δ: as given, or 1/(10·N) once the training set size N is known."""
        return self._accounting.delta

    @property
    def steps(self) -> int:
        """Noisy optimizer steps taken (and accounted), including resumed ones."""
        return self._accounting.released_steps

    def get_epsilon(self, delta: float | None = None) -> float:
        """Exact ε spent so far at ``delta`` (default: the run's δ); ``inf`` without Poisson sampling."""
        return self._accounting.get_epsilon(delta)

    def epsilon_bound(self, delta: float | None = None) -> float:
        """Cheap upper bound on ε for progress bars (see :meth:`PrivacyLedger.epsilon_bound`)."""
        return self._accounting.epsilon_bound(delta)

    # ------------------------------------------------------------------ the noise (public)

    @property
    def noise_strategy(self) -> NoiseStrategy | None:
        """The strategy matrix C of a correlated mechanism (public; built when training starts), else ``None``."""
        plan = self._fit.correlated
        return plan.strategy if plan is not None else None

    @property
    def noise_sensitivity(self) -> float:
        """Sensitivity of C x in units of Δ that the noise is calibrated to (1 for DP-SGD).

        Raises:
            RuntimeError: For a correlated mechanism before training starts (C is not built yet).
        """
        if not self._config.correlated:
            return 1.0
        plan = self._fit.correlated
        if plan is None:
            raise RuntimeError("The strategy matrix of the correlated noise is built when training starts.")
        return plan.sensitivity

    @property
    def noise_std(self) -> float:
        """Std of the noise added to the clipped sum: σ·Δ (Δ = joint sensitivity, C for flat).

        For a correlated mechanism, the std of its white noise w: σ · (sensitivity of C x) · Δ.
        """
        step = self._fit.step
        sensitivity = step.sensitivity if step is not None else self._config.max_grad_norm
        return (self._accounting.noise_multiplier or 0.0) * sensitivity * self.noise_sensitivity

    # ------------------------------------------------------------------ the step (raw: NOT private)

    @property
    def clip_groups(self) -> list[ClipGroup]:
        """The clipping groups (names, bounds, parameters) in :class:`MicroBatchStats` column order."""
        step = self._fit.step
        return list(step.groups) if step is not None else []

    @property
    def privatized_parameter_names(self) -> list[str]:
        """Names of the privatized parameters in :attr:`MicroBatchStats.param_sq_norms` column order."""
        step = self._fit.step
        return step.parameter_names() if step is not None else []

    @property
    def last_step_stats(self) -> list[MicroBatchStats]:
        """Per-micro-batch statistics of the last optimizer step, this rank's examples (raw norms: NOT private)."""
        step = self._fit.step
        return step.last_step_stats if step is not None else self._fit.final_stats

    @property
    def nonfinite_examples(self) -> int:
        """This rank's examples whose per-example gradient was not finite (they contributed zero; raw count)."""
        step = self._fit.step
        return step.nonfinite_examples if step is not None else self._fit.final_nonfinite

    @property
    def probing(self) -> bool:
        """Whether ``training_step`` is running on the coupling probe's batch, not a real one.

        On the first steps of a fit the strategy runs ``training_step`` a second time on a probe
        batch, with logging off, to check that each example's gradient depends on that example
        alone (``dplightning/strategies/coupling.py``). A step with side effects of its own
        (counters, recorded batches) can skip them while this is ``True``.
        """
        step = self._fit.step
        return step is not None and step.probing
