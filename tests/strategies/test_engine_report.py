"""The engine table: one line at setup, the table from ``strategy.engine_table()`` and in the log folder."""

from __future__ import annotations

import logging

import pytest
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from dplightning.strategies.engine_report import ENGINE_TABLE_FILE, engine_kind, engine_summary
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.GroupNorm(2, 8), nn.Tanh(), nn.Linear(8, 3))


def _setup_lines(caplog: pytest.LogCaptureFixture, **trainer: object):
    strategy = dp(noise_multiplier=1.0)
    with caplog.at_level(logging.INFO):
        make_trainer(strategy, **trainer).fit(TinyModule(_net()), loader(make_dataset(32), 8))
    return strategy, [m for m in caplog.messages if "Per-example gradients" in m]


def test_setup_prints_one_line_and_the_table_is_on_request(caplog: pytest.LogCaptureFixture) -> None:
    strategy, lines = _setup_lines(caplog)
    assert lines == [
        "Per-example gradients: 3 layers (book_keeping or instantiate by T: 2, instantiate: 1); "
        "engine per layer: strategy.engine_table() or dp_engines.txt in the log folder of a run with a logger"
    ]
    table = strategy.engine_table().splitlines()  # kept after fit
    assert table[0].split() == ["layer", "type", "params", "engine"]
    assert [row.split()[:2] for row in table[2:]] == [["net.0", "Linear"], ["net.1", "GroupNorm"], ["net.3", "Linear"]]


def test_the_table_is_written_to_the_log_folder(caplog: pytest.LogCaptureFixture, tmp_path) -> None:
    strategy, lines = _setup_lines(caplog, logger=CSVLogger(tmp_path))
    path = tmp_path / "lightning_logs" / "version_0" / ENGINE_TABLE_FILE
    assert path.read_text() == f"Per-example gradients, engine per layer:\n{strategy.engine_table()}\n"
    assert len(lines) == 1 and lines[0].endswith(f"strategy.engine_table() or {path}")


def test_no_table_before_fit() -> None:
    with pytest.raises(RuntimeError, match="start of fit"):
        dp(noise_multiplier=1.0).engine_table()


def test_the_summary_counts_engines_without_their_thresholds() -> None:
    assert engine_kind("book_keeping for T <= 33, else instantiate") == "book_keeping or instantiate by T"
    assert engine_kind("book_keeping (ghost norm for T <= 8)") == "book_keeping"
    assert engine_kind("instantiate (torch.func)") == "instantiate (torch.func)"
    engines = ["book_keeping (ghost norm for T <= 8)", "instantiate", "book_keeping (ghost norm for T <= 3)"]
    assert engine_summary(engines, ["here"]) == (
        "Per-example gradients: 3 layers (book_keeping: 2, instantiate: 1); engine per layer: here"
    )
