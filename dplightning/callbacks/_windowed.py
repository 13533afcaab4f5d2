"""Shared schedule of the non-private statistics callbacks: one summary per step, one record per window."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from dplightning.callbacks._logging import output_dir
from dplightning.privacy.mechanism import MicroBatchStats
from dplightning.protocols import NormSource, dp_state_of, require

R = TypeVar("R")


class WindowedStatistics(Callback, Generic[R]):
    """Summarises every optimizer step once and closes a window every ``every_n_steps`` steps.

    Each step's summary is taken in ``on_before_optimizer_step``: the strategy privatizes
    inside the optimizer closure, so ``last_step_stats`` then holds this step's backward
    passes (all k micro-batches). A window is closed after every ``every_n_steps``-th step
    and, for the remainder, at the end of training; every rank closes the same windows at
    the same steps, so a subclass may use one collective per window. Rank 0 saves the
    figure next to the logs at the end of training.

    Args:
        every_n_steps: Optimizer steps per window.
        save_figure: Save the figure at the end of training.
        enabled: ``False`` turns the callback off: nothing is computed, logged or saved.
    """

    figure_name: ClassVar[str]

    def __init__(self, every_n_steps: int, save_figure: bool, enabled: bool) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.save_figure = save_figure
        self.enabled = enabled
        self.history: list[R] = []
        """One record per closed window (identical on every rank)."""
        self.figure_path: Path | None = None
        self._source: NormSource | None = None
        self._window: list[Tensor] = []

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        self._source = require(dp_state_of(trainer.strategy), NormSource, type(self).__name__)
        self._start(self._source)
        self.history, self._window = [], []

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._source is None:
            return
        self._window.append(self._summarize_step(self._source.last_step_stats))
        if (trainer.global_step + 1) % self.every_n_steps == 0:
            self._close(trainer, trainer.global_step + 1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._source is None:
            return
        if self._window:
            self._close(trainer, trainer.global_step)
        if self.save_figure and self.history:
            folder = output_dir(trainer)  # a collective under DDP: every rank calls it
            if trainer.is_global_zero:
                folder.mkdir(parents=True, exist_ok=True)
                self.figure_path = self._plot(folder / self.figure_name)

    def _close(self, trainer: pl.Trainer, steps_done: int) -> None:
        window, self._window = self._window, []
        self.history.append(self._close_window(trainer, window, steps_done))

    def _start(self, source: NormSource) -> None:
        """Read what the strategy fixed at setup (groups, parameter names) from its DP state."""

    def _summarize_step(self, stats: list[MicroBatchStats]) -> Tensor:
        """This rank's summary of one step (one entry per backward pass in ``stats``)."""
        raise NotImplementedError

    def _close_window(self, trainer: pl.Trainer, window: list[Tensor], steps_done: int) -> R:
        """Combine the window's summaries over ranks, log them and return the record."""
        raise NotImplementedError

    def _plot(self, path: Path) -> Path:
        """Draw :attr:`history` into ``path``."""
        raise NotImplementedError
