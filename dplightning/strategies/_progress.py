"""Shows ε in the progress bar and the logger while a DP strategy trains."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class _EpsilonProgress(Callback):
    """Logs ``epsilon`` (an upper bound, exact on a geometric grid of steps) every step.

    Added automatically by the DP strategies; reads only public values (the ledger).
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        if not getattr(strategy, "poisson_sampling", False) or strategy.steps == 0:  # type: ignore[attr-defined]
            return
        eps = strategy.epsilon_bound()  # type: ignore[attr-defined]
        pl_module.log("epsilon", eps, on_step=True, on_epoch=False, prog_bar=True, logger=True, rank_zero_only=True)
