"""The privacy accounting of a DP run: sampling, σ, the ledger and its checkpoint state (no Trainer).

Everything here is a public value (σ, q, N, δ, the steps taken), identical on every rank,
so it may be logged and checkpointed. The strategy tells it the sampling (when the train
loader is known) and the planned number of steps (for calibration); it counts one
subsampled Gaussian step per release.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from dplightning._state import known
from dplightning.privacy.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    combined_noise_multiplier,
    compute_epsilon,
    split_noise_multiplier,
)
from dplightning.privacy.record import PrivacyRecord
from dplightning.strategies.config import DPConfig
from dplightning.strategies.correlated import NoiseMechanism

RECORDED_LIBRARIES = ("dplightning", "torch", "lightning", "opacus", "transformers", "peft")
"""Libraries whose versions a checkpoint records (the accountant's numbers depend on opacus')."""

SEEDED_RISK = (
    "a test seed (seed=) fixed the noise and the Poisson sampling, so the (ε, δ) guarantee does not hold against "
    "anyone who knows the seed"
)
"""What a run with a test seed does not guarantee (the fit warning, privacy-report and the model card say it)."""


def library_versions() -> dict[str, str | None]:
    """Installed versions of :data:`RECORDED_LIBRARIES` and Python (``None`` if not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in RECORDED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


class PrivacyAccounting:
    """σ, q, N, δ and the ledger of one run.

    Args:
        config: The strategy's DP arguments.
    """

    def __init__(self, config: DPConfig) -> None:
        self.config = config
        self.mechanism = NoiseMechanism.from_config(config)
        self.ledger = PrivacyLedger(config.accountant)
        self.noise_multiplier: float | None = config.noise_multiplier
        """σ of the gradient; ``None`` until calibrated from ``target_epsilon``."""
        self.sample_rate: float | None = None
        self.num_samples: int | None = None
        self._delta = config.delta
        self._step_releases: dict[str, float] = {}
        self._resumed_sampling: tuple[float | None, int | None] | None = None
        self._warned_seed = False
        self.planned_steps: int | None = None
        """Steps the run plans (known when the train loader is); a correlated mechanism's C is built for them."""
        self._released = 0  # steps released by a correlated mechanism (its ledger counts compositions)

    # ------------------------------------------------------------------ public values

    @property
    def delta(self) -> float | None:
        """δ: as given, or 1/(10·N) once the training set size N is known."""
        if self._delta is None and self.num_samples:
            return 1.0 / (10 * self.num_samples)
        return self._delta

    @property
    def expected_batch_size(self) -> float | None:
        """The public expected batch size q·N (q·N/partitions under cyclic Poisson) that the noisy sum is divided by."""
        if self.sample_rate is None or self.num_samples is None:
            return None
        return self.sample_rate * self.num_samples / self.mechanism.partitions

    @property
    def released_steps(self) -> int:
        """Noisy steps released so far (the ledger's steps for DP-SGD; a correlated mechanism counts its own)."""
        return self._released if self.mechanism.correlated else self.ledger.steps

    @property
    def step_releases(self) -> dict[str, float]:
        """Registered per-step releases besides the gradient: name -> noise multiplier."""
        return dict(self._step_releases)

    @property
    def accounted_noise_multiplier(self) -> float | None:
        """σ the ledger records per step: σ_eff of the gradient and every registered step release."""
        if self.noise_multiplier is None or not self._step_releases:
            return self.noise_multiplier
        return combined_noise_multiplier([self.noise_multiplier, *self._step_releases.values()])

    def get_epsilon(self, delta: float | None = None) -> float:
        """Exact ε spent so far at ``delta`` (default: the run's δ); ``inf`` without Poisson sampling."""
        if not self.config.poisson_sampling:
            return math.inf
        delta = delta if delta is not None else self.delta
        if delta is None:
            raise RuntimeError("δ is unknown until the training set size is known; pass delta explicitly.")
        return self.ledger.get_epsilon(delta)

    def epsilon_bound(self, delta: float | None = None) -> float:
        """Cheap upper bound on ε for progress bars (see :meth:`PrivacyLedger.epsilon_bound`)."""
        if not self.config.poisson_sampling:
            return math.inf
        delta = delta if delta is not None else self.delta
        return self.ledger.epsilon_bound(delta) if delta is not None else math.nan

    # ------------------------------------------------------------------ the run

    def register_step_release(self, name: str, noise_multiplier: float) -> None:
        """Account one more Gaussian release made at every step from the step's Poisson sample.

        See :meth:`dplightning.DPStrategy.register_step_release`.
        """
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"Step release {name!r} needs a finite noise multiplier > 0, got {noise_multiplier}.")
        if self.mechanism.correlated:
            raise ValueError(
                f"Step release {name!r} is not supported with noise_mechanism={self.mechanism.name!r}: the "
                "accounting of correlated noise covers the gradient alone."
            )
        calibrated = self.config.target_epsilon is not None and self.noise_multiplier is not None
        if calibrated and self._step_releases.get(name) != float(noise_multiplier):
            raise RuntimeError(
                f"σ was already calibrated for target_epsilon={self.config.target_epsilon} without step release "
                f"{name!r}; register step releases before fit starts (in Callback.setup)."
            )
        self._step_releases[name] = float(noise_multiplier)

    def set_sampling(self, num_samples: int, sample_rate: float) -> None:
        """Record N and q of the train loader; check a resumed run's sampling against them; warn of a test seed.

        Raises:
            ValueError: If q is outside (0, 1], or a ``target_epsilon`` run resumes at another q.
        """
        if not 0 < sample_rate <= 1:
            raise ValueError(
                f"Sampling rate q = batch_size x world_size / N = {sample_rate:.4g} must lie in (0, 1]; "
                f"lower the train loader's batch_size (N = {num_samples})."
            )
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self._warn_if_seeded()
        if self.delta is not None and self.delta >= 1.0 / num_samples:
            rank_zero_warn(
                f"delta = {self.delta:.3g} >= 1/N = {1 / num_samples:.3g}: a mechanism that releases one random "
                "example satisfies this δ. Use δ << 1/N (default 1/(10N)).",
                stacklevel=2,
            )
        self._check_resumed_sampling()

    def _warn_if_seeded(self) -> None:
        if self.config.seed is None or self._warned_seed:
            return
        self._warned_seed = True
        rank_zero_warn(
            f"seed= is FOR TESTS ONLY: {SEEDED_RISK}. Checkpoints, privacy-report and exports record 'seeded'; "
            "train without seed= for a model you will release.",
            stacklevel=3,
        )

    def plan(self, total_steps: int | None) -> None:
        """Calibrate σ for ``target_epsilon`` over ``total_steps``, or warn if a resumed run will overspend it.

        Raises:
            ValueError: If a correlated mechanism's run has no finite length, or its length changed
                (its strategy matrix is built for the planned steps).
        """
        if self.mechanism.correlated:
            self._plan_correlated(total_steps)
        self.planned_steps = total_steps
        if total_steps is not None:
            # ~100 accountant calls for the progress bar
            self.ledger.grid_min_gap = max(1, self.mechanism.compositions(total_steps) // 100)
            self.ledger.grid_end = self.mechanism.compositions(total_steps)
        if self.config.target_epsilon is None:
            self._announce_planned_epsilon(total_steps)
            return
        if total_steps is None:
            raise ValueError("target_epsilon needs a finite training length: set max_epochs or max_steps.")
        if self.noise_multiplier is None:
            self._calibrate(total_steps)
        elif self.ledger.steps and not self.mechanism.correlated:  # a correlated run never resumes
            self._warn_if_resumed_run_overspends(total_steps)

    def _announce_planned_epsilon(self, total: int | None) -> None:
        """Without a target, say up front which ε the given σ reaches at the planned steps (one line)."""
        projected = None if self.mechanism.correlated else self._epsilon_at_end(total)
        if projected is None:
            return
        rank_zero_info(
            f"No target_epsilon: σ = {self.noise_multiplier:.4g} reaches ε = {projected[0]:.4g} "
            f"(δ = {self.delta:.3g}) at the {total} planned steps; pass target_epsilon to choose ε and have σ "
            "calibrated instead."
        )

    def _epsilon_at_end(self, total: int | None) -> tuple[float, int] | None:
        """ε after ``total`` planned steps at the accounted σ and q, and the steps still to come.

        ``None`` if a value is unknown or no step remains.
        """
        sigma, q, delta = self.accounted_noise_multiplier, self.sample_rate, self.delta
        remaining = None if total is None else total - self.ledger.steps
        if remaining is None or remaining <= 0 or sigma is None or q is None or delta is None:
            return None
        history = [*self.ledger.history, (sigma, q, remaining)]
        return compute_epsilon(history, delta, self.config.accountant), remaining

    def _plan_correlated(self, total: int | None) -> None:
        name = self.mechanism.name
        if total is None:
            raise ValueError(
                f"noise_mechanism={name!r} needs a finite training length (max_steps, or max_epochs): its strategy "
                "matrix and sensitivity are computed for the planned number of steps."
            )
        if self.planned_steps is not None and total != self.planned_steps:
            raise ValueError(
                f"The planned number of steps changed from {self.planned_steps} to {total} (reloaded train loader?); "
                f"noise_mechanism={name!r} built its strategy matrix for {self.planned_steps} steps."
            )
        if total < 1:
            raise ValueError(f"noise_mechanism={name!r} needs at least one planned step, got {total}.")

    def _calibrate(self, total: int) -> None:
        target = known(self.config.target_epsilon, "target_epsilon")
        q = known(self.sample_rate, "the sample rate q")
        delta = known(self.delta, "δ")
        compositions = self.mechanism.compositions(total)
        rate = self.mechanism.accounted_rate(q)
        counted = f" = {compositions} compositions at q = {rate:.4g}" if self.mechanism.correlated else ""
        rank_zero_info(
            f"Calibrating σ for ε = {self.config.target_epsilon} over {total} steps{counted} "
            f"({self.config.accountant})..."
        )
        effective = calibrate_noise_multiplier(target, delta, rate, compositions, self.config.accountant)
        # The ledger records σ_eff of everything released per step; the gradient gets what the releases leave.
        self.noise_multiplier = split_noise_multiplier(effective, self._step_releases.values())
        shared = f" (σ_eff = {effective:.4f} with step releases {self.step_releases})" if self._step_releases else ""
        rank_zero_info(f"Calibrated noise multiplier σ = {self.noise_multiplier:.4f}{shared}.")

    def _check_resumed_sampling(self) -> None:
        resumed, self._resumed_sampling = self._resumed_sampling, None
        if resumed is None:
            return
        old_q, old_n = resumed
        if old_q is None or (old_q == self.sample_rate and old_n == self.num_samples):
            return
        change = (
            f"This run resumes a checkpoint that sampled at q = {old_q:.4g} from N = {old_n} examples; now "
            f"q = {self.sample_rate:.4g} from N = {self.num_samples} (another world size, batch size or data set)."
        )
        if self.config.target_epsilon is not None:
            raise ValueError(
                f"{change} σ = {self.noise_multiplier:.4g} was calibrated for target_epsilon = "
                f"{self.config.target_epsilon} at the old q, so the budget would be overspent. Resume with the same "
                "world size, batch size and data set, or continue with an explicit noise_multiplier (ε is then "
                "accounted at the new q)."
            )
        rank_zero_warn(f"{change} The ledger accounts the new q from here on; ε stays exact.", stacklevel=3)

    def _warn_if_resumed_run_overspends(self, total: int) -> None:
        if (at_end := self._epsilon_at_end(total)) is None:
            return
        projected, remaining = at_end
        if projected > self.config.target_epsilon:  # type: ignore[operator]
            rank_zero_warn(
                f"The resumed run keeps σ = {self.noise_multiplier:.4g}, calibrated for target_epsilon = "
                f"{self.config.target_epsilon} over the original run, but now plans {remaining} more steps: it will "
                f"end at ε = {projected:.4g} > {self.config.target_epsilon}. The reported ε stays exact; add "
                "dplightning.callbacks.PrivacyBudget to stop at the budget, or keep max_steps / max_epochs.",
                stacklevel=3,
            )

    def step(self) -> None:
        """Count one noisy release (one subsampled Gaussian step at σ_eff and q).

        A correlated mechanism charges a composition only on the steps its rule says
        (:meth:`NoiseMechanism.charges`: the first step of each cycle for ``band_mf``, the first
        step for ``blt``).
        """
        if self.mechanism.correlated:
            planned = known(self.planned_steps, "the planned number of steps")
            if self._released >= planned:
                raise RuntimeError(
                    f"Step {self._released} is past the {planned} steps the strategy matrix of "
                    f"noise_mechanism={self.mechanism.name!r} was built and accounted for."
                )
            charges, self._released = self.mechanism.charges(self._released), self._released + 1
            if not charges:
                return
        if self.config.poisson_sampling:
            sigma = known(self.accounted_noise_multiplier, "the accounted σ")
            q = known(self.sample_rate, "the sample rate q")
            rate = self.mechanism.accounted_rate(q)
            self.ledger.step(sigma, rate)

    def report(self, engine: str, clipping: str | None = None) -> str:
        """One line with the final (ε, δ) and the parameters that produced it (``clipping``: as applied)."""
        releases = self._step_releases
        shared = f"; σ_eff = {self.accounted_noise_multiplier:.4g} with {releases}" if releases else ""
        if self.mechanism.correlated:
            shared += f"; {self.ledger.steps} composition(s) charged; {self.mechanism.describe()}"
        name = "DP-SGD" if not self.mechanism.correlated else f"noise_mechanism={self.mechanism.name}"
        q = f"{self.sample_rate:.4g}"
        accounted = self.mechanism.accounted_rate(self.sample_rate) if self.sample_rate is not None else None
        if accounted is not None and accounted != self.sample_rate:  # BLT: sampled at q, accounted without it
            q += f" sampled, accounted at q = {accounted:.4g}"
        return (
            f"{name}: (ε = {self.get_epsilon():.4g}, δ = {self.delta:.3g}) after {self.released_steps} steps "
            f"[σ = {self.noise_multiplier:.4g}, q = {q}, C = {self.config.max_grad_norm}, "
            f"clipping = {clipping or self.config.clipping}, engine = {engine}, "
            f"accountant = {self.config.accountant}{shared}]"
        )

    # ------------------------------------------------------------------ checkpoints

    def record(self) -> PrivacyRecord:
        """The privacy record of the accounting (the strategy adds what it knows of the run).

        Public values only, never any seed or generator state; ε is the exact ε at the run's δ
        now (``None`` while δ is unknown).
        """
        delta = self.delta
        return PrivacyRecord(
            ledger=self.ledger.state_dict(),
            noise_multiplier=self.noise_multiplier,
            target_epsilon=self.config.target_epsilon,
            max_grad_norm=self.config.max_grad_norm,
            sample_rate=self.sample_rate,
            num_samples=self.num_samples,
            delta=delta,
            clipping=self.config.clipping,
            clipping_engine=self.config.clipping_engine,
            poisson_sampling=self.config.poisson_sampling,
            step_releases=dict(self._step_releases),
            noise_mechanism={
                **self.mechanism.record(),
                "planned_steps": self.planned_steps,
                "released_steps": self.released_steps,
            },
            epsilon=self.get_epsilon() if delta is not None else None,
            accountant=self.config.accountant,
            secure_mode=self.config.secure_mode,
            seeded=self.config.seed is not None,  # never the seed itself
            versions=library_versions(),
        )

    def restore(self, record: PrivacyRecord) -> None:
        """Continue the run of ``record`` (its sampling is checked against the new one in :meth:`set_sampling`)."""
        self.ledger.load_state_dict(dict(record.ledger))
        self._resumed_sampling = (record.sample_rate, record.num_samples)
        if self.config.target_epsilon is not None and record.noise_multiplier is not None:
            self.noise_multiplier = float(record.noise_multiplier)  # keep the σ the run was calibrated with
        if self._delta is None and record.delta is not None:
            self._delta = float(record.delta)
        rank_zero_info(f"Resumed privacy ledger: {self.ledger.steps} steps, history {list(self.ledger.history)}.")

    def state_dict(self) -> dict[str, Any]:
        """:meth:`record` as the checkpoint stores it."""
        return self.record().to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`restore` from the stored record ``state``."""
        self.restore(PrivacyRecord.from_dict(state))


class InconsistentLedger(ValueError):
    """A checkpoint's privacy ledger contradicts the rest of its record (tampered or corrupted)."""


RECORD_RTOL = 1e-9
"""Relative tolerance between σ/q in the record and in the ledger (both are the same stored floats)."""


def _segment_problems(history: list[Any]) -> list[str]:
    problems = []
    for i, segment in enumerate(history):
        try:
            sigma, q, steps = segment
            valid = sigma >= 0 and math.isfinite(sigma) and 0 < q <= 1 and int(steps) == steps >= 1
        except (TypeError, ValueError):
            valid = False
        if not valid:
            problems.append(f"history segment {i} = {segment!r} is not (σ >= 0, q in (0, 1], steps >= 1)")
    return problems


def _sampling_problems(record: PrivacyRecord, last: tuple[float, float, int], mechanism: NoiseMechanism) -> list[str]:
    """The recorded σ (σ_eff with step releases) and q against the ledger's latest segment.

    A mechanism accounted without amplification records q = 1 in its ledger whatever it sampled at.
    """
    sigma, releases = record.noise_multiplier, record.step_releases.values()
    if sigma is None:
        return ["the record has no noise multiplier σ but the ledger charged steps"]
    recorded = combined_noise_multiplier([sigma, *releases])
    problems = []
    if not math.isclose(recorded, last[0], rel_tol=RECORD_RTOL):
        shared = f" (σ_eff with step releases {dict(record.step_releases)})" if releases else ""
        problems.append(f"the record's σ = {recorded:.6g}{shared} is not the ledger's latest σ = {last[0]:.6g}")
    q = record.sample_rate
    accounted = None if q is None else mechanism.accounted_rate(q)
    if accounted is None or not math.isclose(accounted, last[1], rel_tol=RECORD_RTOL):
        problems.append(f"the record's q = {q} is not the ledger's latest q = {last[1]:.6g}")
    return problems


def mechanism_of(record: PrivacyRecord) -> NoiseMechanism:
    """The noise mechanism ``record`` states (DP-SGD for records written before correlated noise).

    Raises:
        ValueError: If the record names a mechanism this version does not know.
    """
    return NoiseMechanism.from_record(dict(record.noise_mechanism) if record.noise_mechanism else None)


def ledger_problems(record: PrivacyRecord | Mapping[str, Any], global_step: int | None) -> list[str]:
    """What in a checkpoint's privacy record contradicts its ledger.

    ε is computed from the ledger's (σ, q, steps) history alone, so the history must agree
    with the rest of the record: every optimizer step releases one noisy gradient that the
    ledger charges, so it holds at least ``global_step`` steps (more when a privacy journal
    charged steps of a killed attempt); its latest segment ran at the recorded σ (σ_eff with
    step releases) and q.

    Args:
        record: The checkpoint's record (or the dict it is stored as, :meth:`PrivacyRecord.to_dict`).
        global_step: The checkpoint's optimizer steps (``None``: not recorded).

    Returns:
        One sentence per disagreement; empty if the record is consistent.

    Raises:
        IncompletePrivacyRecord: If a stored record lacks a required field.
    """
    record = record if isinstance(record, PrivacyRecord) else PrivacyRecord.from_dict(record)
    history = record.history
    problems = _segment_problems(history)
    if problems or not record.poisson_sampling:
        return problems  # without Poisson sampling nothing is charged (ε = ∞)
    try:
        mechanism = mechanism_of(record)
    except (KeyError, TypeError, ValueError) as err:
        return [f"the record's noise mechanism {record.noise_mechanism!r} is unreadable ({err})"]
    steps = record.steps
    due = mechanism.compositions(global_step) if global_step is not None else 0
    if global_step is not None and steps < due:
        per = "" if not mechanism.correlated else f" ({mechanism.describe()} charges {due} for them)"
        problems.append(
            f"the ledger charges {steps} steps but the checkpoint's global_step is {global_step}{per}: every optimizer "
            "step releases a noisy gradient the ledger charges, so it must hold at least what global_step costs"
        )
    if history:
        problems += _sampling_problems(record, history[-1], mechanism)
    return problems


def check_ledger(record: PrivacyRecord | Mapping[str, Any], global_step: int | None) -> None:
    """Refuse a checkpoint whose ledger contradicts its record (see :func:`ledger_problems`).

    Raises:
        InconsistentLedger: Naming every disagreement.
    """
    problems = ledger_problems(record, global_step)
    if problems:
        raise InconsistentLedger(
            "The privacy ledger contradicts the rest of the checkpoint, so no ε can be claimed from it (a tampered "
            "or corrupted checkpoint): " + "; ".join(problems) + "."
        )
