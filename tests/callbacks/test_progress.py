"""EpsilonProgress: ε in the progress bar and the logs, computed only when something reads it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping

from dplightning.privacy.accounting import PrivacyLedger
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer


def _fit(monkeypatch: pytest.MonkeyPatch, **trainer_kwargs: Any) -> tuple[pl.Trainer, list[int]]:
    calls: list[int] = []
    bound = PrivacyLedger.epsilon_bound

    def counting(self: PrivacyLedger, delta: float) -> float:
        calls.append(1)
        return bound(self, delta)

    monkeypatch.setattr(PrivacyLedger, "epsilon_bound", counting)
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=4, **trainer_kwargs)
    trainer.fit(TinyModule(), loader(make_dataset(32), 4))
    return trainer, calls


def test_no_logger_no_progress_bar_computes_no_epsilon(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, calls = _fit(monkeypatch)
    assert calls == [] and "epsilon" not in trainer.callback_metrics
    assert trainer.strategy.get_epsilon() > 0  # the run's ε is still known


@pytest.mark.parametrize("reader", ["progress_bar", "monitor"])
def test_a_progress_bar_or_a_monitoring_callback_gets_epsilon_every_step(
    monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    kwargs: dict[str, Any] = (
        {"enable_progress_bar": True}
        if reader == "progress_bar"
        else {"callbacks": [EarlyStopping(monitor="epsilon", check_on_train_epoch_end=False)]}
    )
    trainer, calls = _fit(monkeypatch, **kwargs)
    assert len(calls) == 4 and trainer.callback_metrics["epsilon"] >= trainer.strategy.get_epsilon()
