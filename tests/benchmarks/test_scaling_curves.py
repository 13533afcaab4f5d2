"""benchmarks/scaling_curves.py: its smoke run end to end, auto's engine per layer, and the skipping rules."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


@pytest.fixture
def sc(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("scaling_curves")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_smoke_run_records_every_runner_at_every_point_autos_engines_and_the_figures(
    sc: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "scaling.json"
    threads = torch.get_num_threads()
    try:
        sc.main(["--smoke", "--out", str(out), "--figures", str(tmp_path / "fig")])
    finally:
        torch.set_num_threads(threads)  # main() runs on one thread
    record = json.loads(out.read_text())
    assert record["benchmark"] == "scaling_curves" and record["command"].startswith("python benchmarks/scaling_curves")
    assert record["environment"]["threads"] == 1
    layers = {"net.embed", "net.stack.0", "net.stack.2", "net.head"}
    for axis in ("seq", "batch"):
        curve = record["curves"][axis]
        assert curve["values"] == [8, 16]
        for x in curve["values"]:
            point = curve["points"][str(x)]
            assert list(point["runners"]) == sc.RUNNERS  # every runner measured, none skipped
            for r in point["runners"].values():
                assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0
                assert math.isfinite(r["median_ms_at_batch"]) and r["median_ms_at_batch"] > 0
                assert all(math.isfinite(t) and t > 0 for run in r["runs"] for t in run["step_ms"])
                assert math.isfinite(r["peak_rss_mib"]) and r["peak_rss_mib"] > 0 and r["rss_growth_mib"] >= 0
            auto = point["auto_engines"]
            assert set(auto["layers"]) == layers and "net.stack.0" in auto["table"]
            assert all(layer["tokens"] == point["seq"] for layer in auto["layers"].values())
            for metric in ("time", "peak", "growth"):
                compared = point["engines"][metric]
                assert compared["cheaper"] in ("book_keeping", "instantiate")
                assert compared[compared["cheaper"]] == min(compared["book_keeping"], compared["instantiate"])
    # B = 8, T = 8 lies on both curves and is measured once.
    assert record["curves"]["seq"]["points"]["8"] == record["curves"]["batch"]["points"]["8"]
    # auto's choice per layer (2T² < a·b): the 16x16 stack and the 16x10 head switch between T = 8 and T = 16,
    # the 64x16 embedding does not.
    points = record["curves"]["seq"]["points"]
    chosen = {
        x: {name: layer["engine"] for name, layer in points[x]["auto_engines"]["layers"].items()} for x in ("8", "16")
    }
    assert chosen["8"] == dict.fromkeys(layers, "book_keeping")
    switched = dict.fromkeys(["net.stack.0", "net.stack.2", "net.head"], "instantiate")
    assert chosen["16"] == {"net.embed": "book_keeping", **switched}
    for name in ("time_seq", "memory_seq", "time_batch", "memory_batch"):
        assert (tmp_path / "fig" / f"scaling_{name}.png").stat().st_size > 0
    table = (tmp_path / "scaling.md").read_text()
    assert "## auto's engine per layer against T" in table and "instantiate: stack.0, stack.2, head" in table


def _fake_run(job: tuple[Any, ...], args: Any, label: str) -> dict[str, Any]:
    """A measurement without training: opacus_ghost's step grows as T², the others' as T; opacus_hooks fails
    at T = 32 and dp_instantiate's process is killed at T = 16."""
    runner, _, batch, seq = job[:4]
    if seq == 32 and runner == "opacus_hooks":
        raise RuntimeError("boom")
    if seq == 16 and runner == "dp_instantiate":
        raise BrokenProcessPool("killed")
    ms = seq**2 / 10 if runner == "opacus_ghost" else float(seq)
    engines = {"net.stack.0": "book_keeping for T <= 11, else instantiate"} if runner == "dp_auto" else {}
    return {
        "step_ms": [ms, ms], "step_rows": [batch, batch], "mean_batch_rows": float(batch),
        "peak_rss_mib": 100.0 + seq, "rss_growth_mib": float(seq),
        "foreign_cpu_pct": 0.0, "threads": 1, "engines": engines, "engine_table": "",
    }  # fmt: skip


def test_points_predicted_over_a_cap_are_skipped_with_every_larger_one_and_failures_are_recorded(
    sc: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sc, "_run", _fake_run)
    args = sc._parse(["--axis", "seq", "--seqs", "8", "16", "32", "64", "--max-step-s", "0.1", "--repeats", "1",
                      "--out", str(tmp_path / "x.json")])  # fmt: skip
    saved: list[int] = []
    curve = sc.run_curves(args, lambda curves: saved.append(len(curves["seq"]["points"])))["seq"]
    assert saved == [1, 2, 3, 4]  # the record is rewritten after every point
    ghost = {x: curve["points"][str(x)]["runners"]["opacus_ghost"] for x in (8, 16, 32, 64)}
    assert ghost[16]["median_ms"] == 25.6 and ghost[16]["predicted"]["step_ms"] == pytest.approx(25.6)  # slope 2
    assert ghost[32]["skipped"] == "predicted 0.1 s per step > --max-step-s 0.1"  # 25.6 ms x (32 / 16)² = 102 ms
    assert ghost[64]["skipped"].startswith("not measured: its point at 32 was skipped")
    assert curve["points"]["64"]["runners"]["nonprivate"]["predicted"]["step_ms"] == pytest.approx(64.0)  # slope 1
    hooks = [curve["points"][str(x)]["runners"]["opacus_hooks"] for x in (32, 64)]
    assert hooks[0] == {"failed": "RuntimeError: boom", "out_of_memory": False} and hooks[1]["median_ms"] == 64.0
    killed = [curve["points"][str(x)]["runners"]["dp_instantiate"] for x in (16, 32)]
    assert killed[0]["out_of_memory"] and killed[1]["skipped"].startswith("not measured: its point at 16")
    assert curve["points"]["16"]["engines"] is None  # no comparison without both fixed engines
    assert curve["points"]["8"]["auto_engines"]["layers"]["net.stack.0"]["engine"] == "book_keeping"
    assert curve["points"]["32"]["auto_engines"]["layers"]["net.stack.0"]["engine"] == "instantiate"
    record = {"model": {"workload": "tokens"}, "repeats": 1, "steps": 3, "warmup": 2, "threads": 1,
              "runners": args.runners, "curves": {"seq": curve}, "command": "python x",
              "environment": {"dplightning": {"commit": "abc", "dirty": []}, "cpu": "cpu", "threads": 1,
                              "torch": "2", "python": "3"}}  # fmt: skip
    table = sc.markdown(record)
    assert "| opacus_ghost | 6 | 26 | skipped | skipped |" in table
    assert "| opacus_hooks | 8 | 16 | failed | 64 |" in table
    assert "- T=32, opacus_ghost: predicted 0.1 s per step > --max-step-s 0.1" in table
    assert "- T=32, opacus_hooks: failed: RuntimeError: boom" in table
