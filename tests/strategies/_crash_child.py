"""A budget-limited DP run that checkpoints every step and SIGKILLs itself at a chosen point.

tests/strategies/test_crash_safety.py runs :func:`main` in a forked child process (importing
Lightning again in a fresh interpreter would cost more than the runs themselves); by hand:
``python -m tests.strategies._crash_child FOLDER STEP PHASE SEED``. Before each update and
after it, it appends ``pre``/``post``, the global step and the ledger's steps to
FOLDER/journal.txt (fsynced), so the parent can check that every update was accounted
before anyone could observe it.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dplightning.callbacks import PrivacyBudget
from dplightning.privacy.accounting import compute_epsilon
from dplightning.strategies import checkpoint as checkpoint_module
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

N, BATCH, SIGMA, TOTAL = 64, 16, 1.0, 8
Q = BATCH / N
PHASES = ("training_step", "before_update", "after_update", "mid_checkpoint", "before_rename")


def budget() -> float:
    """A target ε that allows exactly TOTAL steps (halfway between ε(TOTAL) and ε(TOTAL + 1))."""
    eps = [compute_epsilon([(SIGMA, Q, t)], 1 / (10 * N), "gdp") for t in (TOTAL, TOTAL + 1)]
    return (eps[0] + eps[1]) / 2


def strategy(seed: int, journal: str | None = None):
    return dp(noise_multiplier=SIGMA, accountant="gdp", seed=seed, privacy_journal=journal)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Journal(pl.Callback):
    def __init__(self, folder: str, kill_step: int, phase: str) -> None:
        self.path = os.path.join(folder, "journal.txt")
        self.kill_step, self.phase = kill_step, phase

    def _write(self, tag: str, trainer: pl.Trainer) -> None:
        with open(self.path, "a") as f:
            f.write(f"{tag} {trainer.global_step} {trainer.strategy.steps}\n")
            f.flush()
            os.fsync(f.fileno())

    def _step(self, trainer: pl.Trainer) -> int:
        return trainer.global_step + 1  # 1-based index of the step in progress

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.phase == "mid_checkpoint" and self._step(trainer) == self.kill_step:
            _kill_during_next_save(half=True)
        if self.phase == "before_rename" and self._step(trainer) == self.kill_step:
            _kill_during_next_save(half=False)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._write("pre", trainer)
        if self.phase == "before_update" and self._step(trainer) == self.kill_step:
            _die()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._write("post", trainer)
        if self.phase == "after_update" and trainer.global_step == self.kill_step:
            _die()  # before ModelCheckpoint (it runs after the other callbacks) saves this step


class _KillingModule(TinyModule):
    def __init__(self, kill_step: int, phase: str) -> None:
        super().__init__()
        self.kill_step, self.phase = kill_step, phase

    def training_step(self, batch, batch_idx):
        if self.phase == "training_step" and self.trainer.global_step + 1 == self.kill_step:
            _die()
        return super().training_step(batch, batch_idx)


def _kill_during_next_save(half: bool) -> None:
    real_save = torch.save

    def partial_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        _die()

    def no_rename(src, dst):
        _die()

    if half:
        checkpoint_module.torch.save = partial_save  # type: ignore[attr-defined]
    else:
        checkpoint_module.os.replace = no_rename  # type: ignore[attr-defined]


def main(folder: str, kill_step: int, phase: str, seed: int, journal: str | None = None) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    checkpoints = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0, every_n_train_steps=1)
    trainer = make_trainer(
        strategy(seed, journal),
        callbacks=[_Journal(folder, kill_step, phase), PrivacyBudget(budget()), checkpoints],
        enable_checkpointing=True,
        max_steps=50,
    )
    trainer.fit(_KillingModule(kill_step, phase), loader(make_dataset(N), BATCH))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
