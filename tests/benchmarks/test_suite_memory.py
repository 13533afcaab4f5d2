"""benchmarks/suite_memory.py: step peaks read from a trace, and a smoke run in fresh processes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def sm(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("suite_memory")


def _memory(ts: int, total: int) -> dict:
    return {"name": "[memory]", "ts": ts, "args": {"Total Allocated": total, "Device Type": 0}}


def test_each_step_gets_the_peak_between_its_mark_and_the_next(sm: ModuleType) -> None:
    events = [
        _memory(1, 100),
        _memory(2, 40),
        {"name": sm.MARK, "ts": 10},
        _memory(11, 90),
        _memory(12, 70),
        {"name": sm.MARK, "ts": 20},  # a step whose first event frees memory still peaks at what it started with
        _memory(21, 50),
        {"name": "[memory]", "ts": 22, "args": {"Total Allocated": 10**9, "Device Type": 1}},  # a GPU event
        {"name": sm.MARK, "ts": 30},
        {"name": sm.MARK, "ts": 40},  # a step without events holds what was there
        _memory(41, 500),  # after the last mark: the step that only closes the clock
    ]
    assert sm.step_peaks({"traceEvents": events}) == [90, 70, 50]


def test_a_trace_without_marks_is_refused(sm: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="step marks"):
        sm.step_peaks({"traceEvents": [_memory(1, 10)]})


def test_smoke_run(sm: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "suite_memory.json"
    results = sm.main(["--smoke", "--threads", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["command"].startswith("python ") and set(record["results"]["mlp_mnist"]) == set(sm.SMOKE_RUNNERS)
    for runner, r in results["mlp_mnist"].items():
        assert len(r["step_peak_mib"]) == 3, runner  # 1 first step + 2 steady
        # The MLP's weights (2.6 MiB) and its data are left out; a step adds AdamW's two states at least.
        assert r["parameters_and_data_mib"] > 2.6 and r["steady_peak_mib_at_batch"] > 2 * 2.6, runner
        assert math.isfinite(record["ratios"]["mlp_mnist"][runner]["steady_peak_mib_at_batch"])
