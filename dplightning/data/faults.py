"""A pre-registered, data-independent fault process for windowed time series (issue 24, item 4).

Real sensor data has faults that sit in the *conditioning* of a forecaster or imputer: a channel logged in
the wrong unit or with a level error for a while, or a channel that is missing altogether. DP-aware
AdaLN-Zero is meant for such contexts, and ETT has too few of them, so this module puts them in on purpose,
in a share ``rate`` of the windows:

* ``level``: one channel's whole context plus s·k, s = ±1, k ~ U[``level_range``] (in the data's normalised
  units, i.e. train standard deviations);
* ``unit``: one channel's whole context times a factor drawn from ``unit_factors`` (×10: a value logged in
  the wrong unit). The factor scales the z-score, x' = μ + f·(x − μ) in the CSV's units, μ the scaler's mean:
  this keeps the transform free of any statistic beyond the scaler that every run already uses;
* ``missing``: one channel's whole context set to ``fill_value`` and its observation mask to 0.

The targets stay clean: the horizon of a forecasting window is never touched, and every item carries the
clean window beside the faulted one, so an imputation target (drawn by the model among the context's points)
is scored against its clean value.

**Which windows, which fault.** Exactly ``round(rate · N)`` of the N windows, chosen by a permutation of
their positions drawn from ``seed``; then, for each chosen window in order of position, the kind, the channel
and the magnitude, from the same generator. Nothing depends on a data value: the plan is a function of
(seed, N, number of channels) only, and is fixed for the whole run (the same windows are faulty in every
epoch and every Poisson batch, like a faulty stretch of a real log).

**Privacy.** The privacy unit stays one window, and the DP guarantee covers the data set the strategy
trains on: the faulted windows. The fault plan is a function of (seed, N, channels), not of any value, so
replacing one window's values (same N, same position) changes that faulted window only. It is not a
per-window map under add-or-remove: removing a window changes N and the positions, and with them which
other windows are faulted. That is no leak of the private data (the plan reads no value), but it means the
fault process is part of how this experiment's training set is built, not a transform with a guarantee
about the clean data.

**Interaction with centring** (``DPTimeSeriesDiffusion(center="context_mean")``, which subtracts each
window's per-channel context mean). A level fault shifts a channel's whole context by s·k: the centred
context is then exactly the clean centred context, and the fault reappears in the *target* instead (the
clean horizon minus a context mean that is k too high or low), so under centring a level fault is a
label-like error of size k that the network cannot see, not a conditioning outlier. A unit fault is a scale:
the centred context is f times the clean one (centring does not remove it), and the centred target is shifted
by (f − 1) times the channel's clean context mean. A missing channel has no conditioning point, so its
context mean is 0 and the horizon is left as it is. To study faults *in the conditioning*, use ``unit`` and
``missing`` with centring, or ``center="none"`` for ``level``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset

from dplightning.privacy.noise import derive_seed

FaultKind = Literal["level", "unit", "missing"]
FAULT_KINDS: tuple[FaultKind, ...] = ("level", "unit", "missing")


@dataclass(frozen=True)
class Fault:
    """One window's fault.

    Attributes:
        kind: ``"level"``, ``"unit"`` or ``"missing"``.
        channel: The channel it hits.
        value: The offset s·k (level), the factor (unit) or the fill value (missing).
    """

    kind: FaultKind
    channel: int
    value: float

    def apply(self, window: Tensor, observed: Tensor, context_len: int) -> None:
        """Fault the first ``context_len`` rows of ``window`` ``[L, K]`` (and of ``observed``) in place."""
        rows = slice(0, context_len)
        if self.kind == "level":
            window[rows, self.channel] += self.value
        elif self.kind == "unit":
            window[rows, self.channel] *= self.value
        else:
            window[rows, self.channel] = self.value
            observed[rows, self.channel] = 0.0


@dataclass(frozen=True)
class FaultProcess:
    """The pre-registered fault process: how many windows, which kinds, and their ranges.

    Attributes:
        rate: Share of the windows that get a fault, in [0, 1]; exactly ``round(rate · N)`` of N.
        seed: The public seed of the plan.
        kinds: The kinds drawn from, uniformly.
        level_range: (low, high) of k for level faults, in normalised units (train standard deviations).
        unit_factors: The factors unit faults draw from, uniformly.
        fill_value: What a missing channel is set to (0 is the train mean in normalised units).
    """

    rate: float = 0.0
    seed: int = 0
    kinds: tuple[FaultKind, ...] = FAULT_KINDS
    level_range: tuple[float, float] = (5.0, 20.0)
    unit_factors: tuple[float, ...] = (10.0,)
    fill_value: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"The fault rate must be in [0, 1], got {self.rate}.")
        if not self.kinds or any(k not in FAULT_KINDS for k in self.kinds):
            raise ValueError(f"Fault kinds must be a non-empty subset of {FAULT_KINDS}, got {self.kinds}.")
        low, high = self.level_range
        if not 0 <= low <= high:
            raise ValueError(f"level_range must be (low, high) with 0 <= low <= high, got {self.level_range}.")
        if not self.unit_factors:
            raise ValueError("unit_factors must name at least one factor.")

    def plan(self, windows: int, channels: int, stream: str = "train") -> dict[int, Fault]:
        """The faults of ``windows`` windows of ``channels`` channels: window index -> :class:`Fault`.

        Args:
            windows: N, the number of windows.
            channels: K, the number of channels.
            stream: Which split the plan is for; each split draws from its own stream of ``seed``.

        Returns:
            Exactly ``round(rate · N)`` entries, the same for the same arguments on any machine.
        """
        g = torch.Generator().manual_seed(derive_seed(self.seed, "faults", stream))
        chosen = torch.randperm(windows, generator=g)[: round(self.rate * windows)].sort().values
        low, high = self.level_range
        plan: dict[int, Fault] = {}
        for index in chosen.tolist():
            kind = self.kinds[int(torch.randint(len(self.kinds), (1,), generator=g))]
            channel = int(torch.randint(channels, (1,), generator=g))
            u, sign = torch.rand(2, generator=g, dtype=torch.float64).tolist()
            if kind == "level":
                value = (1.0 if sign < 0.5 else -1.0) * (low + (high - low) * u)
            elif kind == "unit":
                value = self.unit_factors[min(int(u * len(self.unit_factors)), len(self.unit_factors) - 1)]
            else:
                value = self.fill_value
            plan[index] = Fault(kind, channel, value)
        return plan


class FaultedWindows(Dataset):
    """A window dataset with a fault process: items ``(faulted window, observation mask, clean window)``.

    Every item has the three parts, faulted or not (a batch needs one structure); a clean window's first
    two parts are the window and a mask of ones. :class:`~dplightning.tasks.DPTimeSeriesDiffusion`
    conditions on the first two and scores its targets against the third.

    Args:
        windows: The clean windows (``[L, K]`` tensors, e.g. :class:`~dplightning.data.ett.WindowDataset`).
        process: The fault process.
        context_len: Rows of a window that are context (the input length of a forecasting window; the whole
            window for imputation, whose targets are drawn among its points).
        channels: K; default: read from the first window's shape (shape only, not its values).
        stream: The plan's stream of the seed (``"train"``, ``"test"``): splits get independent plans.
    """

    def __init__(
        self,
        windows: Dataset,
        process: FaultProcess,
        context_len: int,
        channels: int | None = None,
        stream: str = "train",
    ) -> None:
        self.windows = windows
        self.process = process
        self.context_len = context_len
        n = len(windows)  # type: ignore[arg-type]
        k = channels if channels is not None else (windows[0].shape[-1] if n else 0)
        self.faults = process.plan(n, k, stream)
        """Window index -> its fault (public: a function of the seed and the positions only)."""

    def __len__(self) -> int:
        return len(self.windows)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        clean = self.windows[i]
        window, observed = clean.clone(), torch.ones_like(clean)
        fault = self.faults.get(i)
        if fault is not None:
            fault.apply(window, observed, self.context_len)
        return window, observed, clean


def faulted_rows(batch: Sequence[Tensor]) -> Tensor:
    """``[B]`` bool: which windows of a ``(faulted, observed, clean)`` batch carry a fault (for diagnostics).

    A window is faulted when its input differs from its clean copy or a point is marked unobserved.
    """
    window, observed, clean = batch
    differs = (window != clean).flatten(1).any(1)
    return differs | (observed == 0).flatten(1).any(1)
