"""A resumed run never releases part of a logical batch as a whole one (privacy round 4, part 3, item 4).

A resume under accumulation from a checkpoint written between the micro-batches of a step ran the
rest of that step's micro-batches only and released them as a whole step. Every release must cover
all ``accumulate_grad_batches`` micro-batches of its Poisson batch.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

N = 32


class _SaveBetweenMicroBatches(pl.Callback):
    """Writes a checkpoint after the first micro-batch of the second step (in the middle of its accumulation)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, i: int) -> None:  # type: ignore[no-untyped-def]
        if i == 2:
            trainer.save_checkpoint(self.path)


def test_a_resume_that_would_release_a_partial_logical_batch_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "mid_accumulation.ckpt"
    first = make_trainer(dp(noise_multiplier=1.0), max_steps=2, accumulate_grad_batches=2,
                         callbacks=[_SaveBetweenMicroBatches(ckpt)])  # fmt: skip
    first.fit(TinyModule(), loader(make_dataset(N), 8))
    resumed = make_trainer(dp(noise_multiplier=1.0), max_steps=4, accumulate_grad_batches=2)
    module = TinyModule()
    with pytest.raises(RuntimeError, match="covers 1 of the 2 micro-batches"):
        resumed.fit(module, loader(make_dataset(N), 8), ckpt_path=ckpt)
    assert resumed.strategy.dp_state.steps == 1 and len(module.batches) == 1  # nothing more was released


def test_a_resume_from_a_checkpoint_written_after_fit_completes_whole_steps(tmp_path: Path) -> None:
    first = make_trainer(dp(noise_multiplier=1.0), max_steps=2, accumulate_grad_batches=2)
    first.fit(TinyModule(), loader(make_dataset(N), 8))
    first.save_checkpoint(tmp_path / "after_fit.ckpt")
    resumed = make_trainer(dp(noise_multiplier=1.0), max_steps=4, accumulate_grad_batches=2)
    module = TinyModule()
    resumed.fit(module, loader(make_dataset(N), 8), ckpt_path=tmp_path / "after_fit.ckpt")
    assert resumed.strategy.dp_state.steps == 4 and len(module.batches) == 4  # two whole steps of 2


def test_every_release_covers_all_micro_batches_of_its_batch() -> None:
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=6, accumulate_grad_batches=3)
    trainer.fit(TinyModule(), loader(make_dataset(N), 8))
    assert trainer.strategy.dp_state.steps == 6
