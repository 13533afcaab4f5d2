"""benchmarks/_harness.py: the quiet Trainer, the step clock on tuple and mapping batches, and the provenance."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def harness(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("_harness")


def test_the_quiet_trainer_has_no_logger_checkpoints_bar_or_summary_unless_asked(harness: ModuleType) -> None:
    from lightning.pytorch.callbacks import ModelSummary

    quiet = harness.quiet_trainer(accelerator="cpu", max_steps=3)
    assert quiet.logger is None and quiet.checkpoint_callback is None and quiet.progress_bar_callback is None
    assert not any(isinstance(c, ModelSummary) for c in quiet.callbacks) and quiet.max_steps == 3
    loud = harness.quiet_trainer(accelerator="cpu", enable_progress_bar=True)  # the caller's arguments win
    assert loud.progress_bar_callback is not None


def test_the_clock_counts_rows_of_tuple_and_mapping_batches_and_stops_after_its_steps(harness: ModuleType) -> None:
    import lightning.pytorch as pl

    class Mapped(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.layer(batch["x"]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    assert harness.batch_rows((torch.zeros(3, 2), torch.zeros(3))) == 3
    assert harness.batch_rows({"input_ids": torch.zeros(5, 7), "labels": torch.zeros(5, 7)}) == 5
    rows = [{"x": x} for x in torch.randn(40, 2)]
    clock = harness.StepClock(4)
    trainer = harness.quiet_trainer(accelerator="cpu", max_steps=100, callbacks=[clock])
    trainer.fit(Mapped(), DataLoader(rows, batch_size=4))  # type: ignore[arg-type]
    assert trainer.global_step == 5  # four timed steps and the one whose start closes the last gap
    assert clock.rows == [4] * 5 and len(clock.step_ms(1)) == 3 and all(t > 0 for t in clock.step_ms(0))
    assert len(clock.step_cpu_ms(1)) == 3 and all(t >= 0 for t in clock.step_cpu_ms(0))
    loop = harness.StepClock(2)
    stopped = [
        i
        for i, (x, _) in enumerate(DataLoader(TensorDataset(torch.zeros(9, 1), torch.zeros(9)), 3))
        if loop.tick(len(x))
    ]
    assert stopped == [2] and loop.rows == [3, 3, 3]


def test_the_time_at_the_nominal_batch_scales_each_step_by_its_rows(harness: ModuleType) -> None:
    """Poisson batches of 24 and 40 rows at B = 32: each step counts as if it had 32 rows."""
    runs = [
        {"step_ms": [30.0, 50.0], "step_rows": [24, 40], "mean_batch_rows": 32.0, "peak_rss_mib": 1.0,
         "rss_growth_mib": 0.0, "foreign_cpu_pct": 0.0},
        {"step_ms": [20.0, 99.0], "step_rows": [16, 0], "mean_batch_rows": 8.0, "peak_rss_mib": 2.0,
         "rss_growth_mib": 0.0, "foreign_cpu_pct": 0.0},
    ]  # fmt: skip
    summary = harness.summarise(runs, expected_rows=32)
    assert summary["median_ms_at_batch"] == pytest.approx(40.0)  # 40, 40, 40; the empty batch is left out
    assert math.isnan(summary["median_cpu_ms_at_batch"])  # no run recorded CPU time
    runs[0]["step_cpu_ms"], runs[1]["step_cpu_ms"] = [15.0, 25.0], [10.0, 1.0]
    assert harness.summarise(runs, expected_rows=32)["median_cpu_ms_at_batch"] == pytest.approx(20.0)
    assert summary["median_ms"] == pytest.approx(40.0) and "median_ms_at_batch" not in harness.summarise(runs)


def test_the_command_shows_the_script_from_the_repository_and_hides_other_absolute_paths(harness: ModuleType) -> None:
    argv = [str(ROOT / "benchmarks" / "engines.py"), "--out", "/somewhere/x.json", "--quick", "results/y.json"]
    assert harness.command(argv) == "python benchmarks/engines.py --out <path> --quick results/y.json"
    assert harness.command(["benchmarks/engines.py"]) == "python benchmarks/engines.py"  # relative to the cwd (root)
    assert harness.command(["/elsewhere/tool.py", "-v"]) == "python tool.py -v"


def test_every_report_carries_the_command_machine_and_commit(harness: ModuleType, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["benchmarks/demo.py", "--out", str(tmp_path / "r.json")])
    record = harness.provenance(2)
    assert list(record) == ["command", "environment"]
    assert record["command"] == "python benchmarks/demo.py --out <path>"
    env = record["environment"]
    assert env["threads"] == 2 and env["cpu"] and env["torch"] == torch.__version__
    assert set(env["dplightning"]) == {"commit", "dirty"}
    settings = {"out": "x", "steps": 3, "figures": Path("outputs/figures")}  # argparse's vars(), paths included
    harness.write_report(tmp_path / "r.json", "demo", 2, settings, results=[1])
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["benchmark"] == "demo" and written["steps"] == 3 and written["results"] == [1]
    assert written["figures"] == "outputs/figures"
    assert written["command"] == record["command"] and written["environment"]["cpu"] == env["cpu"]
    assert "out" not in written
    line = harness.provenance_line(written)
    assert line.startswith("Command: `python benchmarks/demo.py --out <path>`; commit ") and "2 thread(s)" in line


def test_reports_show_setting_paths_relative_to_the_repository_or_hidden(harness: ModuleType, tmp_path) -> None:
    settings = {"figures": ROOT / "docs" / "figures", "data": "/elsewhere/data.csv", "folder": Path("x/y"),
                "name": "abc", "out": tmp_path / "r.json"}  # fmt: skip
    harness.write_report(tmp_path / "r.json", "demo", 1, settings)
    record = json.loads((tmp_path / "r.json").read_text())
    shown = (record["figures"], record["data"], record["folder"], record["name"])
    assert shown == ("docs/figures", "<path>", "x/y", "abc")
    assert "out" not in record
