"""benchmarks/gpu_validation.py: its CPU smoke run end to end, and its budget rules.

The GPU run happens once, on a lent machine, with no second try: the smoke run keeps every
code path of it (all but the CUDA calls) working in CI, and the unit tests pin down what a
row that does not fit, fails or overruns leaves in the records.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def gv(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("gpu_validation")


def _context(gv: ModuleType, left_s: float = 100.0, small: bool = True) -> Any:
    from engines import Placement

    ctx = gv.Context(
        place=Placement("cpu", "bf16-mixed"), small=small, specs=gv.model_specs(small),
        deadline=time.monotonic() + left_s, warmup=2, steps=1, step_range=(1, 9), invariant_estimate_s=5.0,
        invariant_limit_s=5.0,
    )  # fmt: skip
    ctx.calibration.update({s.name: {"step_s": 1.0, "setup_s": 2.0} for s in ctx.specs})
    return ctx


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_smoke_run_measures_every_row_and_writes_the_records(gv: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "results"
    gv.main(["--smoke", "--out-dir", str(out)])  # in this process (the module is imported); a failed row exits 1
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
    runners = {
        "nonprivate",
        "dp_auto",
        "dp_book_keeping",
        "dp_instantiate",
        "dp_auto_replay",
        "opacus_hooks",
        "opacus_ghost",
    }
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
    grape = rows["grape/roberta"]["result"]  # DP-Adam and DP-GRAPE, engines auto and instantiate, and the planner
    assert set(grape["arms"]) == {"dp_adam_auto", "dp_adam_instantiate", "dp_grape_auto", "dp_grape_instantiate"}
    for arm, res in grape["arms"].items():
        assert res["outcome"] == "fit" and res["steps"] == 3 and res["measured_peak_mib"] > 0
        assert res["planner_error"] is None and res["estimated_peak_mib"] > 0 and math.isfinite(res["relative_error"])
        assert res["engine"] == arm.rsplit("_", 1)[1] and res["optimizer"].endswith("DPGrape") == ("grape" in arm)
    assert len(grape["checks"]) == 5 and all(isinstance(ok, bool) for ok in grape["checks"].values())
    assert grape["passed"] == all(grape["checks"].values())
    peaks = {arm: res["measured_peak_mib"] for arm, res in grape["arms"].items()}
    assert grape["peak_ratio"] == pytest.approx(peaks["dp_grape_auto"] / peaks["dp_adam_instantiate"])
    assert grape["peak_ratio"] < 1  # projected slots instead of formed per-example gradients, even at tiny sizes
    opt = rows["grape/opt_tiny"]["result"]  # OPT: DP-GRAPE at batch 24, DP-Adam at batch 1 (no cap on CPU)
    assert opt["memory_cap_bytes"] is None and {a: r["batch"] for a, r in opt["arms"].items()} == {
        "dp_grape": 24, "dp_adam": 1}  # fmt: skip
    for res in opt["arms"].values():
        assert res["outcome"] == "fit" and res["steps"] == 2 and res["measured_peak_mib"] > 0
        assert res["estimated_peak_mib"] > 0 and res["oom_message"] is None
    assert opt["checks"] == {"dp_grape_fit": True, "dp_adam_out_of_memory": False} and not opt["passed"]
    dpdm = rows["dpdm/mnist5k"]["result"]  # K = 2 vs K = 1 at ε = 10 on digits under --smoke
    assert set(dpdm["arms"]) == {"K=2", "K=1"} and dpdm["steps"] == dpdm["planned_steps"] == 3
    for res in [*dpdm["arms"].values(), dpdm["dpsgd_cnn"]]:
        assert 9 < res["epsilon"] <= 10 + 1e-9 and 0 <= res.get("cnn_accuracy", res.get("accuracy")) <= 1
    assert dpdm["arms"]["K=2"]["sigma"] == dpdm["arms"]["K=1"]["sigma"]  # ε and σ do not depend on K
    assert dpdm["real_ceiling_cnn"] > 0.3 and dpdm["probe_s_per_step"] > 0
    invariants = rows["invariants"]["result"]
    assert invariants["passed"] >= 1 and invariants["failed"] == 0 and invariants["returncode"] == 0
    for r in rows.values():
        assert r["elapsed_s"] >= 0 and "limit_s" in r

    table = (out / "gpu_validation.md").read_text()
    assert "| model | runner | median ms |" in table and "| model | estimate MiB | measured MiB |" in table
    assert all(f"| {e['model']} | {e['runner']} |" in table for e in engines)
    assert (
        "| grape/roberta | dp_grape_auto | 16 x 16 | fit |" in table
        and "| grape/opt_tiny | dp_adam | 1 x 16 |" in table
    )
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


def test_grape_arm_records_an_expected_out_of_memory(gv: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OPT row's DP-Adam arm on the GPU: the CUDA OOM is its outcome, any other error fails the row."""
    import torch

    def oom(*args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def broken(*args: Any) -> None:
        raise RuntimeError("no kernel image")

    ctx = _context(gv)
    spec = gv.opt_spec(small=True)
    config = gv.grape_config(spec, ctx.place, grape=False, engine="auto")
    monkeypatch.setattr(gv, "fit_config", oom)
    res = gv.grape_arm(ctx, spec, config, 2, oom_expected=True)
    assert res["outcome"] == "out_of_memory" and "Tried to allocate" in res["oom_message"]
    assert res["relative_error"] is None and res["estimated_peak_mib"] > 0  # an OOM's peak is no point to compare
    with pytest.raises(torch.OutOfMemoryError):
        gv.grape_arm(ctx, spec, config, 2)  # the RoBERTa arms: an OOM is a failure
    monkeypatch.setattr(gv, "fit_config", broken)
    with pytest.raises(RuntimeError, match="no kernel image"):
        gv.grape_arm(ctx, spec, config, 2, oom_expected=True)


def test_grape_rows_at_gpu_sizes(gv: ModuleType) -> None:
    """What the GPU run of the grape group relies on: its shapes, the planner's verdicts, OPT-6.7B's config, order."""
    import dataclasses

    from engines import Placement

    from dplightning.models.hf import build_config
    from dplightning.planning.memory import plan

    ctx = _context(gv, small=False)
    rows = gv.grape_rows(ctx)
    assert [r.name for r in rows] == ["grape/roberta_large", "grape/opt_6.7b"]
    assert rows[1].priority > rows[0].priority and rows[1].estimate(ctx, 3) > rows[0].estimate(ctx, 3)
    opt = gv.opt_spec(small=False)
    c = build_config(opt.config)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.ffn_dim, c.vocab_size) == (
        4096, 32, 32, 16384, 50272)  # fmt: skip
    assert (c.max_position_embeddings, c.word_embed_proj_dim, opt.tokens) == (2048, 4096, 128)
    gpu = Placement("gpu", "bf16-mixed")
    peaks = {arm: plan(gv.grape_config(dataclasses.replace(opt, batch=b), gpu, g, "auto")).peak
             for arm, (g, b) in gv.OPT_ARMS.items()}  # fmt: skip
    assert peaks["dp_grape"] < gv.OPT_CAP_BYTES < peaks["dp_adam"]  # the planner agrees with the expected outcomes
    roberta = next(s for s in gv.model_specs(small=False) if s.kind == "text")
    roberta = dataclasses.replace(roberta, **gv.GRAPE_SHAPE)
    planned = {arm: plan(gv.grape_config(roberta, gpu, g, e)) for arm, (g, e) in gv.GRAPE_ARMS.items()}
    assert all(p.physical_batch == 40 and p.tokens == 128 for p in planned.values())
    assert planned["dp_grape_auto"].peak / planned["dp_adam_instantiate"].peak <= gv.GRAPE_MAX_RATIO


def test_scrub_removes_machine_paths(gv: ModuleType) -> None:
    text = f'File "/opt/x/lib/python3.12/site-packages/torch/nn.py", line 3\n{gv.ROOT}/benchmarks/engines.py'
    assert gv.scrub(text) == 'File "<site-packages>/torch/nn.py", line 3\n<repo>/benchmarks/engines.py'
    assert gv.command_line(["--out-dir", "/tmp/out", "--smoke"]).endswith("--out-dir <path> --smoke")


def test_only_the_smoke_dpdm_row_calibrates_sigma_once(gv: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its three fits ask the same σ: under --smoke a memo answers the second and third; the GPU run calibrates each."""
    import dplightning.strategies.accounting as accounting

    original, memoised = accounting.calibrate_noise_multiplier, []

    def row(*args: Any) -> None:
        memoised.append(accounting.calibrate_noise_multiplier is not original)

    monkeypatch.setattr(gv, "_dpdm_row", row)
    for small in (True, False):
        gv.run_dpdm_row(_context(gv, small=small), gv.DPDM_SMOKE, 10.0)
    assert memoised == [True, False] and accounting.calibrate_noise_multiplier is original
