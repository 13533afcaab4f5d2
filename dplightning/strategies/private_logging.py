"""Warns when ``training_step`` logs a value of the private batch without the ``nonprivate/`` label.

A loss or accuracy that ``training_step`` computes from its batch is a raw statistic of
private examples (no clipping, no noise). Logging it releases it to every logger, the
progress bar and ``trainer.callback_metrics`` (which checkpoint monitors read), outside the
(ε, δ) guarantee. The strategies' own raw statistics sit under :data:`NONPRIVATE_PREFIX`
(e.g. ``nonprivate/nonfinite_examples``); a user's keys without it get one warning per fit.

The keys are read from what Lightning recorded for ``training_step`` after each training
batch, so the coupling probe's replay of ``training_step`` (which logs nothing) is never
counted and the user's module is left as written.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from dplightning.strategies._trainer import trainer_callbacks

NONPRIVATE_PREFIX = "nonprivate/"
"""The label of a logged value that is a raw (not private) statistic of the training data."""


def unlabelled_training_step_keys(trainer: pl.Trainer) -> list[str]:
    """Keys logged from ``training_step`` in the running fit that lack :data:`NONPRIVATE_PREFIX`, sorted."""
    results = trainer._results
    if results is None:
        return []
    return sorted(
        {
            metric.meta.name
            for metric in results.result_metrics
            if metric.meta.fx == "training_step" and not metric.meta.name.startswith(NONPRIVATE_PREFIX)
        }
    )


def unlabelled_warning(keys: list[str]) -> str:
    """The warning for ``keys`` logged from ``training_step`` without the label."""
    quoted = ", ".join(f"'{k}'" for k in keys)
    return (
        f"training_step logs {quoted} without the '{NONPRIVATE_PREFIX}' label. Each is a raw statistic of the private "
        "batch (computed from its examples, no clipping, no noise), released to the loggers, the progress bar and "
        "callback_metrics (checkpoint monitors) outside the (ε, δ) guarantee. Label it as not private, e.g. "
        f"self.log('{NONPRIVATE_PREFIX}{keys[0]}', ...), and keep it out of anything you publish; or remove it "
        "and report validation metrics instead."
    )


class _UnlabelledPrivateLogs(Callback):
    """Warns once, after the first training batch whose ``training_step`` logged unlabelled keys."""

    def __init__(self) -> None:
        self.warned = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.warned:
            return
        keys = unlabelled_training_step_keys(trainer)
        if keys:
            self.warned = True
            rank_zero_warn(unlabelled_warning(keys))


class PrivateLogWatch:
    """The attached watch: :meth:`remove` detaches it (a hook handle, removed at the strategy's teardown)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self.callback = _UnlabelledPrivateLogs()
        trainer_callbacks(trainer).append(self.callback)

    def remove(self) -> None:
        """Detach the watch from the trainer (idempotent)."""
        if self.callback in trainer_callbacks(self._trainer):
            trainer_callbacks(self._trainer).remove(self.callback)


def watch_private_logs(trainer: pl.Trainer) -> PrivateLogWatch:
    """Attach, for one fit, the warning about ``training_step`` keys logged without :data:`NONPRIVATE_PREFIX`."""
    return PrivateLogWatch(trainer)
