"""benchmarks/grape_memory.py --curve: the planner beside each point, resuming, the ratio table and the figure.

The measurements themselves (minutes of fresh processes) are replaced by a fake here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def gm(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("grape_memory")


def test_the_planner_stands_beside_the_dp_runners_of_the_text_model_only(gm: ModuleType) -> None:
    assert gm.planned_mib("vit", "dp-adam", 8, 16) is None and gm.planned_mib("roberta", "adam", 8, 16) is None
    assert gm.planned_mib("roberta", "opacus-hooks", 8, 16) is None
    plans = {r: gm.planned_mib("roberta", r, 32, 16) for r in ("dp-adam", "dp-adam-inst", "dp-grape")}
    assert plans["dp-grape"] < plans["dp-adam"] < plans["dp-adam-inst"]  # projected states; formed per-example grads
    assert gm.planned_mib("roberta", "dp-adam-inst", 128, 16) > 3 * plans["dp-adam-inst"]  # grows with B


def test_the_curve_saves_every_point_and_resumes_without_measuring_again(gm: ModuleType, monkeypatch, tmp_path) -> None:
    calls: list[tuple[str, str, int]] = []

    def fake(fn: Any, args: tuple, max_other: float, label: str) -> dict[str, float]:
        model, runner, batch = args[:3]
        calls.append((model, runner, batch))
        return {"peak_mib": (50.0 if runner == "dp-grape" else 100.0) + batch}

    monkeypatch.setattr(gm, "in_fresh_process", fake)
    saved: list[int] = []
    runners = ["dp-adam", "dp-grape"]
    first = gm.curve(["vit"], runners, [1, 8], 16, 2, lambda r: saved.append(len(r["vit"]["dp-grape"]) if
                     "dp-grape" in r["vit"] else 0))  # fmt: skip
    assert len(calls) == 4 and len(saved) == 4  # one save per point
    assert first["vit"]["dp-grape_ratio"]["dp-adam"] == {"1": 51 / 101, "8": 58 / 108}
    del first["vit"]["dp-grape"]["8"]  # as if the run had crashed before this point
    calls.clear()
    again = gm.curve(["vit"], runners, [1, 8], 16, 2, lambda r: None, first)
    assert calls == [("vit", "dp-grape", 8)] and again["vit"]["dp-grape"]["8"]["measured_mib"] == 58.0
    table = gm.curve_markdown(again)
    assert "| dp-grape | 51 | 58 |" in table and "| dp-grape ÷ dp-adam | 0.50 | 0.54 |" in table
    gm.curve_figure(again, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
