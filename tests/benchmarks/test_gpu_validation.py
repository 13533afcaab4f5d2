"""benchmarks/gpu_validation.py: its CPU smoke run end to end, and its budget rules.

The GPU run happens once, on a lent machine, with no second try: the smoke run keeps every
code path of it (all but the CUDA calls) working in CI, and the unit tests pin down what a
row that does not fit, fails or overruns leaves in the records.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_validation.py"


@pytest.fixture
def gv(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (the benchmarks import each other by their file names)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_validation")


def _context(gv: ModuleType, left_s: float = 100.0) -> Any:
    from engines import Placement

    ctx = gv.Context(
        place=Placement("cpu", "bf16-mixed"), small=True, specs=gv.model_specs(True),
        deadline=time.monotonic() + left_s, warmup=2, steps=1, step_range=(1, 9), invariant_estimate_s=5.0,
        invariant_limit_s=5.0,
    )  # fmt: skip
    ctx.calibration.update({s.name: {"step_s": 1.0, "setup_s": 2.0} for s in ctx.specs})
    return ctx


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_run_measures_every_row_and_writes_the_records(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_validation.json").read_text())

    assert report["benchmark"] == "gpu_validation" and report["mode"] == "smoke" and report["complete"]
    prov = report["provenance"]
    for key in ("date", "device", "torch", "cuda", "lightning", "opacus", "transformers", "python", "precision"):
        assert key in prov, key
    assert prov["device"] == "cpu" and prov["precision"] == "bf16-mixed"
    assert len(prov["dplightning"]["source_sha256"]) == 64 and "commit" in prov["dplightning"]
    budget = report["budget"]
    assert 0 < budget["used_s"] <= budget["total_s"] and budget["steps"] >= 1 and budget["warmup"] >= 1

    rows = {r["name"]: r for r in report["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), {n: r.get("reason") for n, r in rows.items()}
    models = {"gpt2", "vit", "roberta"}
    assert {f"calibration/{m}" for m in models} | {"invariants", "planner/gpt2", "planner/roberta"} <= set(rows)
    assert set(report["calibration"]) == models
    engines = [r["result"] for n, r in rows.items() if n.startswith("engines/")]
    runners = {"nonprivate", "dp_auto", "dp_book_keeping", "dp_instantiate", "opacus_hooks", "opacus_ghost"}
    assert {e["runner"] for e in engines} == runners  # every runner measured at least once ...
    assert {e["model"] for e in engines} == models  # ... and every model kind
    for e in engines:
        assert e["steps"] == budget["steps"] and len(e["step_ms"]) == e["steps"]
        assert e["median_ms"] > 0 and e["peak_mib"] > 0 and e["mean_batch_rows"] > 0
    for name in ("planner/gpt2", "planner/roberta"):
        result = rows[name]["result"]
        assert result["estimated_peak_mib"] > 0 and result["measured_peak_mib"] > 0
        assert math.isfinite(result["relative_error"]) and result["config"]["trainer"]["accelerator"] == "cpu"
    muon = rows["muon/gpt2"]["result"]  # DP-Adam, DP-Muon and DP-MuonBC side by side
    assert set(muon["arms"]) == {"dp_adam", "dp_muon", "dp_muonbc"} and set(muon["time_ratios"]) == set(muon["targets"])
    for arm, res in muon["arms"].items():
        assert len(res["step_ms"]) == budget["steps"] and res["median_ms"] > 0 and res["peak_mib"] > 0
        assert (arm == "dp_adam") != (0 < res["dp_metrics"].get("muon/noise_ratio_p50", 0))  # r̂ from the Muon arms
    assert muon["arms"]["dp_muonbc"]["dp_metrics"]["muon/bc_fraction"] == 1.0  # no guard: BC on every matrix-step
    invariants = rows["invariants"]["result"]
    assert invariants["passed"] >= 1 and invariants["failed"] == 0 and invariants["returncode"] == 0
    for r in rows.values():
        assert r["elapsed_s"] >= 0 and "limit_s" in r

    table = (out / "gpu_validation.md").read_text()
    assert "| model | runner | median ms |" in table and "| model | estimate MiB | measured MiB |" in table
    assert all(f"| {e['model']} | {e['runner']} |" in table for e in engines)
    assert "incomplete" not in table


def test_choose_steps_takes_the_most_steps_that_fit(gv: ModuleType) -> None:
    ctx = _context(gv)
    rows = [gv.Row(f"x/{i}", "x", lambda c, limit: {}, lambda c, steps: 10.0 + steps) for i in range(3)]
    assert gv.choose_steps(rows, ctx, time_left=3 * (10 + 5)) == 5
    assert gv.choose_steps(rows, ctx, time_left=1e9) == 9  # capped by step_range
    assert gv.choose_steps(rows, ctx, time_left=1.0) == 1  # nothing fits: the fewest, rows skipped later


def test_rows_that_do_not_fit_fail_or_overrun_are_recorded(gv: ModuleType, monkeypatch, tmp_path: Path) -> None:
    def boom(ctx: Any, limit: float) -> dict[str, Any]:
        raise RuntimeError("no kernel image")

    def rows(ctx: Any) -> list[Any]:
        return [
            gv.Row("fake/fits", "fake", lambda c, limit: {"summary": "measured"}, lambda c, steps: 0.0, priority=9),
            gv.Row("fake/huge", "fake", lambda c, limit: {}, lambda c, steps: 1e6, priority=9),
            gv.Row("fake/breaks", "fake", boom, lambda c, steps: 0.0, priority=9),
        ]

    monkeypatch.setitem(gv.GROUPS, "fake", rows)
    with pytest.raises(SystemExit) as exit_:
        gv.main(["--smoke", "--only", "fake/*", "--out-dir", str(tmp_path), "--budget-s", "60"])
    assert exit_.value.code == 1  # a failed row fails the command
    report = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert report["complete"] and report["calibration"] == {}  # --only: no model row, no calibration
    got = {r["name"]: r for r in report["rows"]}
    assert list(got) == ["fake/fits", "fake/huge", "fake/breaks"]
    assert got["fake/fits"]["status"] == "ok" and got["fake/fits"]["result"]["summary"] == "measured"
    assert got["fake/huge"]["status"] == "skipped" and "estimated 1000000 s" in got["fake/huge"]["reason"]
    assert got["fake/breaks"]["status"] == "failed" and "no kernel image" in got["fake/breaks"]["reason"]
    table = (tmp_path / "gpu_validation.md").read_text()
    assert "| fake/huge | skipped | estimated 1000000 s" in table and "| fake/fits | ok |" in table


def test_a_row_past_its_limit_is_stopped_and_recorded(gv: ModuleType) -> None:
    row = gv.Row("slow", "fake", lambda c, limit: time.sleep(30) or {}, lambda c, steps: 0.0)
    start = time.monotonic()
    record = gv.run_row(row, _context(gv), limit_s=0.3)
    assert record["status"] == "timed_out" and "0 s" in record["reason"]
    assert time.monotonic() - start < 5


def test_pytest_counts_read_a_killed_run(gv: ModuleType) -> None:
    output = (
        "tests/invariants/test_single_device.py::test_a[auto] PASSED [ 10%]\n"
        "tests/invariants/test_single_device.py::test_b[auto-0.8] FAILED [ 20%]\n"
        "tests/invariants/test_single_device.py::test_c[instantiate] PASSED"
    )
    counts = gv.pytest_counts(output)
    assert (counts["passed"], counts["failed"]) == (2, 1)
    assert counts["failures"] == ["tests/invariants/test_single_device.py::test_b[auto-0.8]"]


def test_cpu_allocator_totals_subtract_what_was_allocated_before(gv: ModuleType) -> None:
    def event(ts: int, size: int, total: int) -> dict[str, Any]:
        return {"name": "[memory]", "ts": ts, "args": {"Device Type": 0, "Bytes": size, "Total Allocated": total}}

    events = [event(2, 50, 1150), event(1, 100, 1100), event(3, -100, 1050), {"name": "aten::mm", "ts": 0}]
    assert gv.cpu_allocator_totals(events) == (1000.0, 1150.0)
    assert gv.cpu_allocator_totals([]) == (0.0, 0.0)


def test_gpu_sizes_build_and_plan(gv: ModuleType) -> None:
    """The GPU-size configs, which only the GPU run trains: models on the meta device, their plans, inputs."""
    import torch
    from engines import Placement

    from dplightning.planning.memory import plan

    millions = {}
    for spec in gv.model_specs(small=False):
        with torch.device("meta"):
            millions[spec.name] = sum(p.numel() for p in gv.build_model(spec).parameters()) / 1e6
        x = gv.workload(spec).inputs(2, torch.Generator().manual_seed(0))
        assert x.shape == ((2, 3, 224, 224) if spec.kind == "image" else (2, spec.tokens))
        if spec.planned:
            p = plan(gv.planner_config(spec, Placement("gpu", "bf16-mixed")))
            assert p.physical_batch == spec.batch and p.tokens == spec.tokens and p.peak > 0
    # GPT-2 124M with its own 38.6M-parameter head; ViT-B/16; RoBERTa-large with a 10-class head
    assert millions == pytest.approx({"gpt2": 163.0, "vit_b16": 85.8, "roberta_large": 355.4}, abs=0.1)


def test_scrub_removes_machine_paths(gv: ModuleType) -> None:
    text = f'File "/opt/x/lib/python3.12/site-packages/torch/nn.py", line 3\n{gv.ROOT}/benchmarks/engines.py'
    assert gv.scrub(text) == 'File "<site-packages>/torch/nn.py", line 3\n<repo>/benchmarks/engines.py'
    assert gv.command_line(["--out-dir", "/tmp/out", "--smoke"]).endswith("--out-dir <path> --smoke")
