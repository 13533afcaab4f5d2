"""The callbacks every DP strategy adds to a fit: ε in the progress bar, the non-finite count, the optimizer's metrics.

The strategies add them themselves (``strategies/_dp.py``, at the start of each fit); users do not need to.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from dplightning.protocols import AccountingSource, ReportsMetrics, dp_state_of


class EpsilonProgress(Callback):
    """Logs ``epsilon`` (an upper bound, exact on a geometric grid of steps) every step, if anything reads it.

    Nothing is computed when the run has no logger, no progress bar and no callback monitoring
    ``epsilon`` (e.g. a benchmark's quiet Trainer); the strategy's final line still reports ε.

    Added automatically by the DP strategies unless a :class:`~dplightning.protocols.ShowsEpsilon`
    callback (e.g. ``dplightning.callbacks.PrivacyBudget``) is present; reads only public values (the ledger).
    """

    shows_epsilon = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = dp_state_of(trainer.strategy)
        if not isinstance(state, AccountingSource) or not state.poisson_sampling or state.steps == 0:
            return
        if not _epsilon_is_read(trainer):  # an exact ε at each grid step costs more than a tiny run's steps
            return
        # logger=False without a logger: Lightning would otherwise warn on every step
        logger = bool(trainer.loggers)
        eps = state.epsilon_bound()
        pl_module.log("epsilon", eps, on_step=True, on_epoch=False, prog_bar=True, logger=logger, rank_zero_only=True)


def _epsilon_is_read(trainer: pl.Trainer) -> bool:
    """Whether anything reads the logged ε: a logger, the progress bar, or a callback monitoring ``epsilon``."""
    if trainer.loggers or trainer.progress_bar_callback is not None:
        return True
    return any(getattr(cb, "monitor", None) == "epsilon" for cb in getattr(trainer, "callbacks", []))  # set at run time


NONFINITE_METRIC = "nonprivate/nonfinite_examples"
"""Logged count of examples whose per-example gradient was not finite (raw, not private)."""


class NonfiniteCount(Callback):
    """Logs :data:`NONFINITE_METRIC`, this rank's running count, once it is above zero (added by the strategies).

    The count is a raw statistic of the training data (not noised): it sits under ``nonprivate/``
    and must not be released with the model.
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        count = getattr(dp_state_of(trainer.strategy), "nonfinite_examples", 0)
        if count:
            logger = bool(trainer.loggers)
            pl_module.log(NONFINITE_METRIC, float(count), on_step=True, on_epoch=False, logger=logger)


class OptimizerMetrics(Callback):
    """Logs the optimizer's public diagnostics (:class:`~dplightning.protocols.ReportsMetrics`) every step."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, ReportsMetrics) and (metrics := dict(optimizer.dp_metrics())):
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=bool(trainer.loggers))
