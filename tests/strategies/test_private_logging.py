"""Values of the private batch logged from ``training_step`` without the ``nonprivate/`` label warn once per fit."""

from __future__ import annotations

import warnings

import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

from dplightning.strategies.private_logging import NONPRIVATE_PREFIX
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

MATCH = "without the 'nonprivate/' label"


class Logs(TinyModule):
    """Logs what Lightning projects log: a loss and an accuracy of the batch, and some labelled or public values."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        loss = F.cross_entropy(out, y)
        self.log("train_loss", loss)
        self.log_dict({"train_acc": (out.argmax(1) == y).float().mean(), "nonprivate/rows": float(len(x))})
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.log("lr", self.lr)  # outside training_step: not the private batch's statistic

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean())


def _private_log_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if MATCH in str(w.message)]


def _fit(module: TinyModule, steps: int = 3, **kwargs) -> list[str]:
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=steps, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(make_dataset(64), 16), loader(make_dataset(16, seed=1), 8))
    return _private_log_warnings(caught)


def test_unlabelled_keys_of_training_step_warn_once_listing_them() -> None:
    found = _fit(Logs(), steps=4, limit_val_batches=1, val_check_interval=2)
    assert len(found) == 1
    assert "training_step logs 'train_acc', 'train_loss' without" in found[0]
    assert "raw statistic of the private batch" in found[0] and "outside the (ε, δ) guarantee" in found[0]
    assert "self.log('nonprivate/train_acc', ...)" in found[0] and "remove it" in found[0]
    for public in ("nonprivate/rows", "'lr'", "val_acc", "epsilon"):
        assert public not in found[0]


def test_each_fit_warns_again() -> None:
    module = Logs()
    trainer = make_trainer(dp(noise_multiplier=1.0), max_epochs=1, max_steps=-1, limit_train_batches=2)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, loader(make_dataset(64), 16))
        assert len(_private_log_warnings(caught)) == 1
        trainer.fit_loop.max_epochs = trainer.current_epoch + 1
    assert not [cb for cb in trainer.callbacks if type(cb).__name__ == "_UnlabelledPrivateLogs"]  # detached


class Labelled(TinyModule):
    """Logs under the label only; and a key in the coupling probe's replay of training_step alone."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log(f"{NONPRIVATE_PREFIX}train_loss", loss)
        if self.trainer.strategy.probing:
            self.log("probe_loss", loss)  # the probe silences logging: never released, never counted
        return loss


def test_labelled_keys_and_the_coupling_probes_replay_do_not_warn(tmp_path) -> None:
    module = Labelled()
    assert _fit(module, logger=CSVLogger(tmp_path), log_every_n_steps=1) == []
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "nonprivate/train_loss" in header and "probe_loss" not in header


def test_no_warning_without_logging() -> None:
    assert _fit(TinyModule()) == []
