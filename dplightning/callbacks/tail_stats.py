"""``GradientTailStats``: per-group quantiles, kurtosis and tail index of per-example gradient norms."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from dplightning.callbacks._figures import plot_tail_stats
from dplightning.callbacks._grouping import ALL, parameter_groups
from dplightning.callbacks._logging import log_scalars
from dplightning.callbacks._statistics import clip_shares, excess_kurtosis, hill_tail_index, norm_quantiles
from dplightning.callbacks._windowed import WindowedStatistics
from dplightning.privacy.mechanism import MicroBatchStats
from dplightning.protocols import NormSource

PREFIX = "nonprivate/tail"
FIGURE_NAME = "nonprivate_tail_stats.png"


@dataclass
class TailRecord:
    """Statistics of one window of optimizer steps over all ranks' examples.

    Attributes:
        step: Optimizer steps done at the end of the window.
        examples: Examples in the window.
        stats: ``{group: {statistic: value}}``, statistics as in :class:`GradientTailStats`.
    """

    step: int
    examples: int
    stats: dict[str, dict[str, float]]


class GradientTailStats(WindowedStatistics[TailRecord]):
    """**nonprivate**: how heavy the tail of per-example gradient norms is, per parameter group.

    For every window of ``every_n_steps`` optimizer steps, it pools the per-example norms
    ‖g_i^G‖ of each parameter group G (from the squared per-parameter norms the DP strategy
    computed for clipping: no extra backward pass) over all ranks, and logs under
    ``nonprivate/tail/<group>/``:

    * ``p50``, ``p90``, ``p99`` (``quantiles``) and ``max``;
    * ``kurtosis``: excess kurtosis m4/m2² − 3;
    * ``hill_alpha``: Hill's tail index on the top ``tail_fraction`` of norms (smaller is heavier);
    * ``clip_share`` (not for ``all``): the group's share of the clipping events, the mean of
      ‖g_i^G‖² / ‖g_i‖² over the clipped examples (shares sum to 1 over disjoint groups).

    These come from the private training data and are NOT differentially private: they
    are logged under ``nonprivate/`` and must not be released with the model; use probe or
    public data for released diagnostics. ``enabled=False`` turns the callback off.

    To compare the conditioning path of a diffusion transformer with the rest (DP-aware
    AdaLN-Zero), name the conditioning parameters:
    ``GradientTailStats(groups={"cond": ["*t_embedder*", "*adaLN_modulation*"]})`` gives
    the groups ``cond``, ``rest`` and ``all``.

    Args:
        groups: Group name -> glob pattern(s) on parameter names; unmatched parameters form
            ``rest``. Default: one group per top-level module. ``all`` is always added.
        quantiles: Quantiles to log besides the maximum.
        tail_fraction: Share of the largest norms the Hill estimator uses.
        every_n_steps: Optimizer steps pooled per window (Hill on the top 5% needs
            a few hundred examples per window to be meaningful).
        save_figure: Save ``nonprivate_tail_stats.png`` next to the logs at the end of training.
        enabled: ``False`` disables the callback, e.g. for runs whose logs will be released.
    """

    figure_name = FIGURE_NAME

    def __init__(
        self,
        groups: dict[str, str | list[str]] | None = None,
        quantiles: Sequence[float] = (0.5, 0.9, 0.99),
        tail_fraction: float = 0.05,
        every_n_steps: int = 50,
        save_figure: bool = True,
        enabled: bool = True,
    ) -> None:
        if not 0 < tail_fraction < 1 or not all(0 <= q <= 1 for q in quantiles):
            raise ValueError(f"Need 0 < tail_fraction < 1 and quantiles in [0, 1]; got {tail_fraction}, {quantiles}.")
        super().__init__(every_n_steps, save_figure, enabled)
        self.groups = groups
        self.quantiles = tuple(quantiles)
        self.tail_fraction = tail_fraction
        self._columns: dict[str, Tensor] = {}
        self._bounds = torch.zeros(0)

    @property
    def group_names(self) -> list[str]:
        """The groups, ``all`` last (known once training starts)."""
        return list(self._columns)

    @override
    def _start(self, source: NormSource) -> None:
        names = source.privatized_parameter_names
        self._columns = {g: torch.tensor(c, dtype=torch.long) for g, c in parameter_groups(names, self.groups).items()}
        self._bounds = torch.tensor([g.max_norm for g in source.clip_groups], dtype=torch.float64)

    @override
    def _summarize_step(self, stats: list[MicroBatchStats]) -> Tensor:
        """``[n, groups + 1]``: squared norm per group (``all`` last), then 1 if the example was clipped."""
        rows = [self._rows(s.param_sq_norms, s.norms) for s in stats]
        return torch.cat(rows) if rows else torch.zeros(0, len(self._columns) + 1, dtype=torch.float64)

    def _rows(self, param_sq: Tensor, clip_norms: Tensor) -> Tensor:
        sq = param_sq.detach().double()
        group_sq = torch.stack([sq[:, cols.to(sq.device)].sum(1) for cols in self._columns.values()], dim=1)
        clipped = ~(clip_norms.detach().double() <= self._bounds.to(sq.device)).all(dim=1)  # non-finite: clipped
        return torch.cat([group_sq, clipped.double().unsqueeze(1)], dim=1)

    @override
    def _close_window(self, trainer: pl.Trainer, window: list[Tensor], steps_done: int) -> TailRecord:
        local = torch.cat([w.to(trainer.strategy.root_device) for w in window])
        rows = _gather_rows(local).cpu().numpy()
        record = TailRecord(steps_done, len(rows), self._statistics(rows))
        metrics = {f"{PREFIX}/{g}/{k}": v for g, stats in record.stats.items() for k, v in stats.items()}
        log_scalars(trainer, metrics if record.examples else {}, steps_done)
        return record

    @override
    def _plot(self, path: Path) -> Path:
        return plot_tail_stats(path, [r.step for r in self.history], [r.stats for r in self.history])

    def _statistics(self, rows: np.ndarray) -> dict[str, dict[str, float]]:
        group_sq, clipped = rows[:, :-1], rows[:, -1] > 0
        names = self.group_names
        shares = clip_shares(group_sq[:, :-1], group_sq[:, -1], clipped)
        stats: dict[str, dict[str, float]] = {}
        for j, group in enumerate(names):
            norms = np.sqrt(group_sq[:, j])
            stats[group] = {
                **norm_quantiles(norms, self.quantiles),
                "kurtosis": excess_kurtosis(norms),
                "hill_alpha": hill_tail_index(norms, self.tail_fraction),
            }
            if group != ALL:
                stats[group]["clip_share"] = float(shares[j])
        return stats


def _gather_rows(local: Tensor) -> Tensor:
    """All ranks' rows (different counts per rank) on every rank: two small collectives, no noise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    from torchmetrics.utilities.distributed import gather_all_tensors

    return torch.cat(gather_all_tensors(local))
