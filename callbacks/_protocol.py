"""What the callbacks read from a DP strategy: three small structural interfaces.

The callbacks never import a concrete strategy class. Any ``trainer.strategy`` with these
members works; dplightning's ``DPStrategy`` and ``DPDDPStrategy`` satisfy all three.

* :class:`AccountingSource`: the public privacy state (ledger, δ, q, σ). Derived from
  public values only, so anything computed from it may be released.
* :class:`NormSource`: the raw per-example gradient norms of the last optimizer step,
  published by the strategy from the norms it already computes for clipping (no second
  backward pass, no extra per-example gradient). They are **not private**: statistics
  of them must be logged under ``nonprivate/`` and must not be released with the model.
* :class:`StepReleaseSource`: a seam to release one more noisy statistic per step and have
  its privacy cost accounted (used by :class:`~dplightning.callbacks.PrivateClipFraction`).

When to read: the strategy privatizes inside the optimizer closure, so from
``on_before_optimizer_step`` on (once per optimizer step, also with
``accumulate_grad_batches=k``), ``last_step_stats`` holds the current step's statistics and
the ledger already counts the step. Under DDP each rank only sees its own examples.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from dplightning.privacy.accounting import PrivacyLedger
from dplightning.privacy.clipping import ClipGroup
from dplightning.privacy.mechanism import MicroBatchStats


@runtime_checkable
class AccountingSource(Protocol):
    """Public privacy state of a DP strategy.

    Attributes:
        ledger: The (σ, q, steps) history, its exact ε and a cheap bound (identical on every rank).
        poisson_sampling: Whether batches are Poisson-sampled (otherwise ε is infinite).
    """

    ledger: PrivacyLedger
    poisson_sampling: bool

    @property
    def delta(self) -> float | None:
        """The strategy's δ (``None`` until the training set size is known)."""
        ...

    @property
    def sample_rate(self) -> float | None:
        """Poisson sampling rate q of every step."""
        ...

    @property
    def accounted_noise_multiplier(self) -> float | None:
        """σ the ledger records per step (σ_eff when the step releases more than the gradient)."""
        ...


@runtime_checkable
class NormSource(Protocol):
    """Raw per-example gradient norms of the last optimizer step (NOT private).

    Attributes:
        last_step_stats: One :class:`~dplightning.privacy.mechanism.MicroBatchStats` per
            backward pass of the last optimizer step, this rank's examples only: ``norms``
            ``[n, groups]`` fp32 per clip group (the norms that were clipped) and
            ``param_sq_norms`` ``[n, params]`` fp32 squared norms per privatized parameter.
    """

    last_step_stats: list[MicroBatchStats]

    @property
    def clip_groups(self) -> list[ClipGroup]:
        """Clip groups (name, ``max_norm``) in the column order of ``norms``."""
        ...

    @property
    def privatized_parameter_names(self) -> list[str]:
        """Parameter names in the column order of ``param_sq_norms``."""
        ...


@runtime_checkable
class StepReleaseSource(NormSource, Protocol):
    """A strategy that accounts extra per-step releases (see ``register_step_release``)."""

    secure_mode: bool

    @property
    def expected_batch_size(self) -> float | None:
        """The public expected batch size q·N."""
        ...

    def register_step_release(self, name: str, noise_multiplier: float) -> None:
        """Account a sensitivity-1 release with noise N(0, σ_r²) at every step."""
        ...


_S = TypeVar("_S")


def require(strategy: object, interface: type[_S], user: str) -> _S:
    """Return ``strategy`` typed as ``interface``, or raise a helpful error if it lacks members."""
    if not isinstance(strategy, interface):
        raise TypeError(
            f"{user} reads the per-step DP statistics of a DP strategy ({interface.__name__}); "
            f"{type(strategy).__name__} does not provide them. Use Trainer(strategy='dp') or 'dp_ddp'."
        )
    return strategy
