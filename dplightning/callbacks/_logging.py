"""Writing statistics to the Trainer's loggers and next to the logs (rank 0 writes; all ranks may call).

The statistics callbacks log on their own schedule (``every_n_steps``), not on Lightning's
``log_every_n_steps``, so they call the loggers directly. Histograms become TensorBoard
histograms for a ``TensorBoardLogger`` (tensorboard stays an optional dependency) and one
scalar column per bin for any other logger (CSV and the like).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from dplightning.data.prediction_writer import run_folder


def _logger_step(steps_done: int) -> int:
    # Lightning logs what happened in the t-th optimizer step (1-based) at logger step t - 1.
    return max(steps_done - 1, 0)


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float], steps_done: int) -> None:
    """Write the defined (non-NaN) ``metrics`` to every logger, aligned with Lightning's steps (rank 0 only)."""
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
    if not trainer.is_global_zero or not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=_logger_step(steps_done))


def bin_labels(edges: Sequence[float]) -> list[str]:
    """Column suffixes ``"0.00-0.25"``, ..., ``"4.00-inf"`` for bins (e_{j-1}, e_j] and a last open bin."""
    bounds = [*edges, float("inf")]
    return [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def log_histogram(
    trainer: pl.Trainer, tag: str, edges: Sequence[float], counts: Tensor, moments: tuple[float, float], steps_done: int
) -> None:
    """Write a fixed-bin histogram, aligned with Lightning's steps (rank 0 only).

    Args:
        trainer: The Trainer whose loggers receive it.
        tag: Metric name; CSV-like loggers get ``f"{tag}/{bin label}"`` columns.
        edges: Bin edges e_0 < ... < e_m; ``counts`` has m + 1 entries, the last for values > e_m.
        counts: Counts per bin.
        moments: (sum, sum of squares) of the finite values, for TensorBoard.
        steps_done: Optimizer steps done when the histogram was taken.
    """
    if not trainer.is_global_zero:
        return
    columns = {f"{tag}/{label}": float(c) for label, c in zip(bin_labels(edges), counts.tolist(), strict=True)}
    step = _logger_step(steps_done)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            _tensorboard_histogram(logger, tag, edges, counts, moments, step)
        else:
            logger.log_metrics(columns, step=step)


def _tensorboard_histogram(
    logger: TensorBoardLogger, tag: str, edges: Sequence[float], counts: Tensor, moments: tuple[float, float], step: int
) -> None:
    # TensorBoard wants finite upper limits: the open last bin is drawn one bin wide.
    limits = [*edges[1:], edges[-1] + (edges[-1] - edges[-2])]
    nonempty = [i for i, c in enumerate(counts.tolist()) if c > 0]
    if not nonempty:
        return
    logger.experiment.add_histogram_raw(
        tag,
        min=float(edges[nonempty[0]]),
        max=float(limits[nonempty[-1]]),
        num=int(counts.sum().item()),
        sum=moments[0],
        sum_squares=moments[1],
        bucket_limits=limits,
        bucket_counts=counts.tolist(),
        global_step=step,
    )


def output_dir(trainer: pl.Trainer) -> Path:
    """Where figures go: the run's log folder, as for predictions (call on every rank)."""
    return run_folder(trainer)
