"""What the parts of dplightning declare to each other, as small structural interfaces.

Nothing here is a base class to inherit from: any object with these members works.

* Strategy -> callbacks, CLI and progress bar: the strategy's DP state, one read-only object
  (``strategy.dp_state``, :class:`~dplightning.strategies.state.DPState`; found by
  :func:`dp_state_of`), read through :class:`AccountingSource` (the public privacy state),
  :class:`NormSource` (raw per-example norms, **not private**) and :class:`StepReleaseSource`
  (what a callback releasing a noisy statistic per step reads).
* Callback -> strategy: :class:`ShowsEpsilon` (the callback logs ε itself, so the strategy
  adds no ε progress bar of its own) and :class:`RegistersStepReleases` (the strategy accounts
  one more noisy statistic per step).
* Optimizer -> strategy: :class:`DPPlanned`, an optimizer's DP plan: its clipping groups and
  per-example transforms, and the noisy release it receives with its noise std.
* Optimizer -> memory planner: :class:`DeclaresStateSize`, the size of the state its steps keep.
* LightningModule -> strategy: :class:`MultiRowUnits`, privacy units of several rows.

When to read the strategy's statistics: it privatizes inside the optimizer closure, so
from ``on_before_optimizer_step`` on (once per optimizer step, also with
``accumulate_grad_batches=k``), ``last_step_stats`` holds the current step's statistics and
the ledger already counts the step. Under DDP each rank only sees its own examples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

from dplightning.privacy.accounting import PrivacyLedger
from dplightning.privacy.clipping import ClipGroup
from dplightning.privacy.grad_sample.transforms import SlotTransform
from dplightning.privacy.mechanism import MicroBatchStats


@runtime_checkable
class AccountingSource(Protocol):
    """Public privacy state of a DP strategy (identical on every rank; anything computed from it may be released).

    Attributes:
        ledger: The (σ, q, steps) history, its exact ε and a cheap bound.
        poisson_sampling: Whether batches are Poisson-sampled (otherwise ε is infinite).
    """

    ledger: PrivacyLedger
    poisson_sampling: bool

    @property
    def steps(self) -> int:
        """Noisy steps taken and accounted."""
        ...

    @property
    def delta(self) -> float | None:
        """The run's δ (``None`` until the training set size is known)."""
        ...

    @property
    def sample_rate(self) -> float | None:
        """Poisson sampling rate q of every step."""
        ...

    @property
    def accounted_noise_multiplier(self) -> float | None:
        """σ the ledger records per step (σ_eff when the step releases more than the gradient)."""
        ...

    def get_epsilon(self, delta: float | None = None) -> float:
        """Exact ε so far."""
        ...

    def epsilon_bound(self, delta: float | None = None) -> float:
        """A cheap upper bound on ε, for progress bars."""
        ...


@runtime_checkable
class NormSource(Protocol):
    """Raw per-example gradient norms of the last optimizer step (NOT private).

    Attributes:
        last_step_stats: One :class:`~dplightning.privacy.mechanism.MicroBatchStats` per
            micro-batch of the last optimizer step, this rank's examples only: ``norms``
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
    """What a callback that releases a noisy statistic of every step reads of the DP state, besides the norms.

    The release itself is accounted through the strategy (:class:`RegistersStepReleases`).

    Attributes:
        secure_mode: Whether the release's noise must come from the OS CSPRNG too.
    """

    secure_mode: bool

    @property
    def expected_batch_size(self) -> float | None:
        """The public expected batch size q·N."""
        ...


@runtime_checkable
class RegistersStepReleases(Protocol):
    """A DP strategy that accounts extra per-step releases (see ``register_step_release``)."""

    def register_step_release(self, name: str, noise_multiplier: float) -> None:
        """Account a sensitivity-1 release with noise N(0, σ_r²) at every step."""
        ...


@runtime_checkable
class ShowsEpsilon(Protocol):
    """A callback that logs ε itself (``shows_epsilon = True``), e.g. :class:`~dplightning.callbacks.PrivacyBudget`."""

    shows_epsilon: bool


@dataclass(frozen=True)
class DPPlan:
    """How an optimizer wants its gradients privatized.

    Attributes:
        groups: A partition of the privatized parameters into clip groups with their bounds;
            ``None`` keeps the strategy's ``clipping`` policy. The noise is calibrated to the
            joint sensitivity √(Σ C_b²) of all groups.
        transforms: Linear maps applied to each per-example gradient of a parameter inside the
            engine (e.g. :class:`~dplightning.privacy.grad_sample.Projection`); the parameter's
            slot (what is clipped, noised and released) then has the transformed shape.
    """

    groups: list[ClipGroup] | None = None
    transforms: dict[nn.Parameter, SlotTransform] = field(default_factory=dict)


@dataclass(frozen=True)
class DPRelease:
    """One noisy step's release, pushed to an optimizer with a DP plan before its ``step`` runs.

    Attributes:
        slots: The noisy mean of each parameter's slot, in slot coordinates (fp32). Slots of a
            parameter's own shape are also written to ``p.grad``.
        noise_std: The per-coordinate std of the Gaussian noise in each slot's mean, σΔ/(qN).
        groups: The clip groups of the step.
        step: Index of this noisy step in the run (0-based, counting resumed steps).
    """

    slots: dict[nn.Parameter, Tensor]
    noise_std: float
    groups: list[ClipGroup]
    step: int


@runtime_checkable
class DPPlanned(Protocol):
    """An optimizer that declares its DP plan and receives the release; it never reads the strategy.

    Optionally it may also define ``dp_bind_module(module)``: the strategy then calls it with
    the LightningModule before each :meth:`dp_plan`, for plans that select parameters by the
    type of the layer owning them (DP-GRAPE projects Linear weights only).
    """

    def dp_plan(self, named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float) -> DPPlan:
        """The plan for these privatized parameters (asked at setup, and again if they change)."""
        ...

    def dp_release(self, release: DPRelease) -> None:
        """Receive the step's release; called inside ``optimizer.step`` before the update."""
        ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """An optimizer with public per-step diagnostics, which the DP strategies log after every step.

    The values must be post-processing of the release (functions of the noisy update and of
    public settings), never of the raw batch: they are logged without the ``nonprivate/`` label.
    """

    def dp_metrics(self) -> Mapping[str, float]:
        """Name → value after the last step (an empty mapping logs nothing)."""
        ...


@runtime_checkable
class DeclaresStateSize(Protocol):
    """An optimizer that states the size of the state its steps keep, without stepping.

    ``dplightning memory-plan`` asks it on parameters of the ``meta`` device, where a step that
    draws random numbers or reads values (DP-GRAPE's projections, DP-Muon's norms) cannot run;
    an optimizer without it is planned by stepping it once on meta tensors.
    """

    def state_elements(self) -> dict[torch.dtype, int]:
        """Elements of the tensors its state holds after a step, by dtype (only dtypes it uses).

        Counts every parameter of its groups that requires grad (those the DP strategy
        privatizes), as placed by ``dp_bind_module`` and ``dp_plan`` if it has them (they are
        called first); what it keeps from step to step, not a step's temporaries.
        """
        ...


@runtime_checkable
class MultiRowUnits(Protocol):
    """A LightningModule whose privacy unit is ``dp_rows_per_unit`` consecutive rows of its forward batch.

    With K rows per unit (several noise draws or augmentations of one example), the train
    loader yields n units, the forward runs n·K rows, and each unit's gradient is the sum
    over its rows' gradients before it is clipped: clipping bounds each unit, not each row.
    """

    dp_rows_per_unit: int


@runtime_checkable
class CountsExamples(Protocol):
    """A LightningModule that says how many privacy units a training batch holds.

    The strategy must know the count n of every batch: it checks that each layer's input
    has n rows (or n·K for multi-row units) and scales a mean loss back to each unit's own
    gradient. It finds n as the leading dimension of the first tensor of a tensor, mapping,
    list, tuple or dataclass batch; a module whose batches are other objects defines
    ``dp_batch_size``, or training is refused.
    """

    def dp_batch_size(self, batch: Any) -> int:
        """The number of privacy units in ``batch`` (0 for an empty Poisson batch)."""
        ...


_S = TypeVar("_S")


def dp_state_of(strategy: object) -> object:
    """The DP state a strategy publishes as ``dp_state``; else the strategy itself.

    The DP strategies publish one read-only state object; a strategy of another library may
    implement the interfaces above directly, and is then read as it is.
    """
    return getattr(strategy, "dp_state", strategy)


def require(strategy: object, interface: type[_S], user: str) -> _S:
    """Return ``strategy`` typed as ``interface``, or raise a helpful error if it lacks members."""
    if not isinstance(strategy, interface):
        raise TypeError(
            f"{user} reads the per-step DP statistics of a DP strategy ({interface.__name__}); "
            f"{type(strategy).__name__} does not provide them. Use Trainer(strategy='dp') or 'dp_ddp'."
        )
    return strategy
