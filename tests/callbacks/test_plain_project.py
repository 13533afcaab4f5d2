"""A plain Lightning project gains the callbacks with only ``Trainer(strategy="dp", callbacks=[...])``."""

from __future__ import annotations

import ast
import csv
import inspect
from types import ModuleType

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from dplightning.callbacks import ClippingHistogram, GradientTailStats, PrivacyBudget
from tests.callbacks import plain_project
from tests.callbacks.plain_project import PlainClassifier, plain_loader


def _imports(module: ModuleType) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
    }


def test_plain_module_gains_budget_histogram_and_tail_statistics(tmp_path) -> None:
    assert not any(name.startswith("dplightning") for name in _imports(plain_project))  # it knows nothing of DP
    budget, histogram, tails = PrivacyBudget(3.0), ClippingHistogram(), GradientTailStats(every_n_steps=2)
    trainer = pl.Trainer(
        strategy="dp", callbacks=[budget, histogram, tails],  # the change to the project
        accelerator="cpu", max_steps=20, logger=CSVLogger(tmp_path), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(PlainClassifier(), plain_loader(n=256, batch_size=4))  # q = 1/64
    strategy = trainer.strategy
    assert 0 < strategy.dp_state.steps <= 20 and budget.epsilon == strategy.get_epsilon() <= 3.0
    assert tails.group_names == ["encoder", "head", "all"]  # default: the top-level modules
    header = next(csv.reader(open(f"{trainer.log_dir}/metrics.csv")))
    assert {"epsilon", "delta", "train_loss", "nonprivate/clip_fraction", "nonprivate/tail/head/p99"} <= set(header)
    assert histogram.figure_path.exists() and tails.figure_path.exists()
    assert histogram.figure_path.parent == tails.figure_path.parent == tmp_path / "lightning_logs" / "version_0"
