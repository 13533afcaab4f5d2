"""The release seam: the one place where noise meets the clipped sum, observable and substitutable.

Every noisy step of every mechanism (Gaussian DP-SGD, ``band_mf``, ``blt``; every engine,
optimizer and clipping mode) releases through :meth:`GradientPrivatizer.release
<dplightning.privacy.mechanism.GradientPrivatizer.release>`, which hands each release to the
observers registered with :func:`observe_releases` as a :class:`Release`: this rank's clipped
sum before noise, the declared sensitivity Δ, the noise std σΔ, the release index and the
mechanism (with the strategy matrix C of a correlated one, so that a whole run can be audited
as one Gaussian mechanism on C·X). An observer may return a replacement for the released
(noisy, cross-rank summed) vector: a record/replay audit records the outputs on a data set D
and replays them on a neighbour D′, so that both runs follow one trajectory and only the
clipped sums can differ (``docs/trust.md``, "The audit contract").

Without observers the seam costs nothing: no copy of the buckets is made.

The runtime checks report their decisions the same way (:func:`observe_decisions`): each
check that can refuse a step (the gradient verification, the coupling and shape probes, the
state watch, the cyclic position, the whole-logical-batch rule) emits a :class:`Decision`
when it accepts or refuses, so an audit can assert that no decision depends on one example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from torch import Tensor


@dataclass(frozen=True)
class ReleaseSpec:
    """What the strategy declares about one release, before it happens (public values only).

    Attributes:
        index: The release's index in the run (the ledger's step count before it).
        mechanism: ``"gaussian"``, ``"band_mf"`` or ``"blt"``.
        sensitivity: Δ, the bound on one privacy unit's contribution to the clipped sum of this
            release (C for flat clipping, √(Σ C_b²) for groups).
        noise_std: Std of the noise on the clipped sum at this release, over all ranks: σΔ for
            Gaussian; for a correlated mechanism the marginal std of (C⁻¹ w)_t.
        expected_batch_size: The public q·N the released sum is divided by.
        rank: This process' rank.
        world_size: Number of processes.
        strategy: The strategy matrix C of a correlated mechanism (``None`` for Gaussian).
        run_sensitivity: A correlated mechanism's charged sensitivity of C·X over the whole run,
            in units of Δ (``None`` for Gaussian, where each release is its own mechanism).
    """

    index: int
    mechanism: str
    sensitivity: float
    noise_std: float
    expected_batch_size: float
    rank: int = 0
    world_size: int = 1
    strategy: np.ndarray | None = None
    run_sensitivity: float | None = None


@dataclass(frozen=True)
class Release:
    """One release as it passes through the seam.

    Attributes:
        spec: What the strategy declared about it.
        clipped_sum: This rank's clipped sum before noise, all buckets concatenated (fp32, a copy).
    """

    spec: ReleaseSpec
    clipped_sum: Tensor


class ReleaseObserver(Protocol):
    """Sees every release; may substitute its output."""

    def __call__(self, release: Release, output: Tensor) -> Tensor | None:
        """Called once per release, after noise and the cross-rank sum, before the division by q·N.

        Args:
            release: The release (its clipped sum is a copy: changing it changes nothing).
            output: The noisy sum over all ranks, buckets concatenated (a copy).

        Returns:
            ``None`` to release ``output`` as it is, or a tensor of its shape to release instead.
        """


_observers: list[ReleaseObserver] = []


@contextmanager
def observe_releases(observer: ReleaseObserver) -> Iterator[ReleaseObserver]:
    """Hand every release of this process to ``observer`` while the context is open.

    Observers are called in the order they were registered; each sees the output the previous
    one returned. For tests and audits: an observer that substitutes outputs changes the run.
    """
    _observers.append(observer)
    try:
        yield observer
    finally:
        _observers.remove(observer)


def observers() -> tuple[ReleaseObserver, ...]:
    """The observers registered now (empty outside :func:`observe_releases`)."""
    return tuple(_observers)


@dataclass(frozen=True)
class Decision:
    """One runtime check's outcome at one point of the run.

    Attributes:
        check: ``"gradient_verification"``, ``"coupling_probe"``, ``"shape_probe"``, ``"state_watch"``,
            ``"cyclic_position"`` or ``"whole_logical_batch"``.
        accepted: Whether the check let the step go on.
    """

    check: str
    accepted: bool


_decision_observers: list[Callable[[Decision], None]] = []


@contextmanager
def observe_decisions(observer: Callable[[Decision], None]) -> Iterator[Callable[[Decision], None]]:
    """Hand every check's decision in this process to ``observer`` while the context is open."""
    _decision_observers.append(observer)
    try:
        yield observer
    finally:
        _decision_observers.remove(observer)


@contextmanager
def decision(check: str) -> Iterator[None]:
    """Report the block's outcome as ``check``'s decision: refused if it raises, accepted otherwise."""
    if not _decision_observers:
        yield
        return
    try:
        yield
    except BaseException:
        for observer in list(_decision_observers):
            observer(Decision(check, False))
        raise
    for observer in list(_decision_observers):
        observer(Decision(check, True))
