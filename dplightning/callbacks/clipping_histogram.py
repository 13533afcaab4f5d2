"""``ClippingHistogram``: per-example gradient norms relative to the clipping bound (NOT private)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from dplightning.callbacks._figures import plot_clipping
from dplightning.callbacks._logging import log_histogram, log_scalars
from dplightning.callbacks._windowed import WindowedStatistics
from dplightning.privacy.mechanism import MicroBatchStats
from dplightning.protocols import NormSource

PREFIX = "nonprivate"
FIGURE_NAME = "nonprivate_clipping.png"


@dataclass
class ClippingRecord:
    """One logged window of optimizer steps, summed over ranks.

    Attributes:
        step: Optimizer steps done at the end of the window.
        examples: Examples seen in the window (all ranks).
        counts: ``[groups, bins + 1]`` examples per bin of ‖g_{i,b}‖ / C_b per clip group.
        clipped: ``[groups]`` examples clipped in each clip group.
        clip_fraction: Share of examples clipped in any group (NaN for an empty window).
    """

    step: int
    examples: int
    counts: Tensor
    clipped: Tensor
    clip_fraction: float


class ClippingHistogram(WindowedStatistics[ClippingRecord]):
    """**nonprivate**: the distribution of per-example gradient norms relative to the clipping bound.

    Reads the per-example norms the DP strategy computed for clipping (no extra backward
    pass). They come from the private training data, so these statistics are NOT
    differentially private: they are logged under ``nonprivate/`` and must not be released
    with the model. ``enabled=False`` turns the callback off (nothing is computed, logged or
    saved); :class:`~dplightning.callbacks.PrivateClipFraction` is the private alternative
    for the clip fraction.

    Per window of ``every_n_steps`` optimizer steps it logs, summed over all ranks with one
    small all-reduce:

    * ``nonprivate/clip_fraction``: share of examples with ‖g_i‖ > C (any clip group; a
      non-finite norm counts as clipped); per group as ``nonprivate/clip_fraction/<group>``
      when there are several clip groups;
    * ``nonprivate/norm_over_C/<group>``: histogram of ‖g_{i,b}‖ / C_b over bins
      (e_{j-1}, e_j] of [0, ``range_max``] plus a last bin for larger (and non-finite) norms.
      A TensorBoard histogram for a ``TensorBoardLogger``, else one column per bin.

    At the end of training it saves ``nonprivate_clipping.png`` (norm distribution over
    training, clip fraction per window) next to the logs (``trainer.log_dir``, or
    ``default_root_dir`` without a logger).

    Args:
        every_n_steps: Optimizer steps pooled per logged window (every step counts once).
        bins: Number of equal bins over [0, ``range_max``].
        range_max: Upper edge of the binned range, in units of the clipping bound.
        save_figure: Save the PNG at the end of training.
        enabled: ``False`` disables the callback, e.g. for runs whose logs will be released.
    """

    figure_name = FIGURE_NAME

    def __init__(
        self,
        every_n_steps: int = 1,
        bins: int = 20,
        range_max: float = 4.0,
        save_figure: bool = True,
        enabled: bool = True,
    ) -> None:
        if bins < 1 or not range_max > 0:
            raise ValueError(f"Need bins >= 1 and range_max > 0; got {bins} and {range_max}.")
        super().__init__(every_n_steps, save_figure, enabled)
        self.edges = torch.linspace(0.0, range_max, bins + 1, dtype=torch.float64)
        self._groups: list[tuple[str, float]] = []

    @override
    def _start(self, source: NormSource) -> None:
        self._groups = [(g.name, g.max_norm) for g in source.clip_groups]

    @override
    def _summarize_step(self, stats: list[MicroBatchStats]) -> Tensor:
        """One fp64 vector: counts, clipped per group, clipped in any group, n, sums, sums of squares."""
        groups = self._groups
        norms = torch.cat([s.norms.detach().cpu() for s in stats]) if stats else torch.zeros(0, len(groups))
        bounds = torch.tensor([c for _, c in groups], dtype=torch.float64)
        ratio = torch.nan_to_num(norms.double() / bounds, nan=torch.inf)  # non-finite: clipped, last bin
        finite = torch.where(torch.isfinite(ratio), ratio, torch.zeros_like(ratio))
        index = torch.bucketize(ratio, self.edges[1:])
        counts = torch.stack([torch.bincount(index[:, j], minlength=len(self.edges)) for j in range(len(groups))])
        clipped = ratio > 1.0
        parts = [counts.flatten(), clipped.sum(0), clipped.any(1).sum().view(1), torch.tensor([len(ratio)])]
        return torch.cat([*(p.double() for p in parts), finite.sum(0), finite.square().sum(0)])

    @override
    def _close_window(self, trainer: pl.Trainer, window: list[Tensor], steps_done: int) -> ClippingRecord:
        local = torch.stack(window).sum(0).to(trainer.strategy.root_device)  # NCCL reduces on the GPU
        total = trainer.strategy.reduce(local, reduce_op="sum").cpu()  # the one collective per window
        record, moments = self._record(total, steps_done)
        self._log(trainer, record, moments)
        return record

    def _record(self, total: Tensor, step: int) -> tuple[ClippingRecord, Tensor]:
        g, width = len(self._groups), len(self.edges)
        counts, rest = total[: g * width].view(g, width), total[g * width :]
        clipped, clipped_any, n, moments = rest[:g], rest[g], int(rest[g + 1].item()), rest[g + 2 :].view(2, g)
        fraction = float(clipped_any / n) if n else float("nan")
        return ClippingRecord(step, n, counts.round().long(), clipped.round().long(), fraction), moments

    def _log(self, trainer: pl.Trainer, record: ClippingRecord, moments: Tensor) -> None:
        if not record.examples:
            return
        groups = self._groups
        metrics = {f"{PREFIX}/clip_fraction": record.clip_fraction}
        if len(groups) > 1:
            for (name, _), clipped in zip(groups, record.clipped.tolist(), strict=True):
                metrics[f"{PREFIX}/clip_fraction/{name}"] = clipped / record.examples
        log_scalars(trainer, metrics, record.step)
        edges = self.edges.tolist()
        for j, (name, _) in enumerate(groups):
            sums = (float(moments[0, j]), float(moments[1, j]))
            log_histogram(trainer, f"{PREFIX}/norm_over_C/{name}", edges, record.counts[j], sums, record.step)

    @override
    def _plot(self, path: Path) -> Path:
        names = [name for name, _ in self._groups]
        counts = {name: np.stack([r.counts[j].numpy() for r in self.history]) for j, name in enumerate(names)}
        steps = [r.step for r in self.history]
        return plot_clipping(path, steps, self.edges.tolist(), counts, [r.clip_fraction for r in self.history])
