"""``init_from``: a run that starts from an earlier DP run's checkpoint composes both runs' ε (finding 40.8).

Fine-tuning a private model on the same data in a new run used to start a fresh ledger: the
follow-up's checkpoint claimed ε = 0.51 after a first run of 3.40. References: the accountant
over the concatenated histories, computed here.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import dplightning
from dplightning.commands.export import load_checkpoint
from dplightning.commands.report import privacy_report
from dplightning.privacy.accounting import compute_epsilon
from tests.helpers import TinyModule, loader, make_dataset, make_trainer, params_of

N = 64


def _dp(**kwargs: Any) -> dplightning.DPStrategy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dplightning.DPStrategy(noise_multiplier=kwargs.pop("noise_multiplier", 1.0), **kwargs)


class _StartWeights(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = params_of(pl_module)


@pytest.fixture
def first_run(tmp_path: Path) -> tuple[Path, TinyModule, list]:
    module = TinyModule()
    trainer = make_trainer(_dp(), max_steps=5)
    trainer.fit(module, loader(make_dataset(N), 16))
    trainer.save_checkpoint(tmp_path / "first.ckpt")
    return tmp_path / "first.ckpt", module, list(trainer.strategy.dp_state.ledger.history)


def test_a_run_from_an_earlier_runs_checkpoint_composes_both_ledgers(first_run, tmp_path: Path) -> None:
    path, first, history = first_run
    start = _StartWeights()
    trainer = make_trainer(_dp(noise_multiplier=1.5, init_from=str(path)), max_steps=3, callbacks=[start])
    trainer.fit(TinyModule(), loader(make_dataset(N), 16))
    for name, value in params_of(first).items():
        torch.testing.assert_close(start.weights[name], value, rtol=0, atol=0)
    state = trainer.strategy.dp_state
    assert list(state.ledger.history) == [*history, (1.5, 0.25, 3)]
    composed = compute_epsilon([*history, (1.5, 0.25, 3)], state.delta, "prv")
    alone = compute_epsilon([(1.5, 0.25, 3)], state.delta, "prv")
    assert trainer.strategy.get_epsilon() == pytest.approx(composed, rel=1e-9) and composed > alone
    trainer.save_checkpoint(tmp_path / "second.ckpt")
    report = privacy_report(load_checkpoint(tmp_path / "second.ckpt"))
    assert report["epsilon"] == pytest.approx(composed, rel=1e-9) and report["epsilon_matches"]
    assert report["history"] == [list(h) for h in [*history, (1.5, 0.25, 3)]]

    # Resuming the second run (init_from still given) does not charge the first run twice.
    resumed = make_trainer(_dp(noise_multiplier=1.5, init_from=str(path)), max_steps=4)
    resumed.fit(TinyModule(), loader(make_dataset(N), 16), ckpt_path=tmp_path / "second.ckpt")
    assert list(resumed.strategy.dp_state.ledger.history) == [*history, (1.5, 0.25, 4)]


def test_init_from_refuses_a_checkpoint_without_a_ledger_and_a_target_epsilon(tmp_path: Path) -> None:
    plain = make_trainer("auto", max_steps=1)
    plain.fit(TinyModule(), loader(make_dataset(N), 16))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="has no privacy record"):
        make_trainer(_dp(init_from=str(tmp_path / "plain.ckpt")), max_steps=1).fit(
            TinyModule(), loader(make_dataset(N), 16)
        )
    with pytest.raises(ValueError, match="init_from carries the earlier run's ledger"):
        dplightning.DPStrategy(target_epsilon=3.0, init_from=str(tmp_path / "plain.ckpt"))
