"""benchmarks/muon_digits.py: its smoke run through the comparison protocol, and every arm's configuration.

The real run (about an hour) is made once for the record; the smoke run keeps its code path
working: the arms' configs and overlays, the paired seeds, the split of every number and the
DPMuon diagnostics each run returns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


@pytest.fixture
def md(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("muon_digits")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_smoke_run_records_paired_runs_and_muon_diagnostics(md: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "muon_digits_smoke.json"
    threads = torch.get_num_threads()
    try:  # in this process: the module is imported already, a fresh interpreter would import it again
        md.main(["--smoke", "--out", str(out), "--figures", str(tmp_path / "fig")])
    finally:
        torch.set_num_threads(threads)  # main() runs on one thread
    record = json.loads(out.read_text())
    assert record["status"] == "complete" and record["experiment"] == "muon_digits_cpu_smoke"
    assert list(record["arms"]) == list(md.SMOKE_ARMS)
    specs = {a.name: a for a in md.ARMS}
    assert any(specs[n].muon for n in md.SMOKE_ARMS) and not all(specs[n].muon for n in md.SMOKE_ARMS)

    runs = record["runs"]
    for name in md.SMOKE_ARMS:
        mine = [r for r in runs if r["arm"] == name]
        final = [r for r in mine if r["phase"] == "final"]
        select = [r for r in mine if r["phase"] == "select"]
        assert sorted(r["seed"] for r in final) == list(md.FINAL_SEEDS) and {r["split"] for r in final} == {"test"}
        assert [r["seed"] for r in select] == list(md.TUNING_SEEDS) and {r["split"] for r in select} == {"val"}
        assert {json.dumps(r["hparams"]) for r in final} == {json.dumps(record["selection"][name]["hparams"])}
        for r in mine:
            m = r["metrics"]
            assert 0 <= m["accuracy"] <= 1 and m["steps"] >= 3 and m["sigma"] > 0 and 0 < m["delta"] < 1
            assert m["epsilon"] == pytest.approx(md.EPSILON, rel=0.02) and m["epsilon"] <= md.EPSILON + 1e-6
            quartiles = [m.get(f"noise_ratio_p{q}") for q in (25, 50, 75)]
            if not specs[name].muon:
                assert quartiles == [None] * 3 and "guard_open_fraction" not in m
                continue
            assert all(math.isfinite(q) for q in quartiles) and 0 < quartiles[0] <= quartiles[1] <= quartiles[2]
            assert m["matrix_steps"] == 12 * m["steps"]  # the ViT's 12 hidden matrices, every step once
            assert 0 <= m["guard_open_fraction"] <= 1 and 0 <= m["default_guard_open_fraction"] <= 1
            if "max_noise_ratio" in specs[name].fixed and specs[name].fixed["max_noise_ratio"] is None:
                assert m["guard_open_fraction"] == 1.0  # no guard: open wherever there is noise
            assert ("bc_fraction" in m) == bool(specs[name].fixed.get("bias_correction"))
            if "bc_fraction" in m:  # no guard: BC acts on every matrix-step
                assert m["bc_fraction"] == 1.0

    # Paired: at one seed every arm draws the same Poisson batches and the same σ; other seeds draw others.
    final = {(r["arm"], r["seed"]): r["metrics"] for r in runs if r["phase"] == "final"}
    for seed in md.FINAL_SEEDS:
        assert len({final[a, seed]["mean_batch_rows"] for a in md.SMOKE_ARMS}) == 1
        assert len({final[a, seed]["sigma"] for a in md.SMOKE_ARMS}) == 1
    assert len({final[md.SMOKE_ARMS[0], s]["mean_batch_rows"] for s in md.FINAL_SEEDS}) > 1
    assert len(record["pairs"]) == 1 and record["pairs"][0]["n"] == len(md.FINAL_SEEDS)
    assert (tmp_path / "muon_digits_smoke.md").exists() and (tmp_path / "fig" / "muon_digits_cpu_smoke.png").exists()


def test_the_registered_experiment(md: ModuleType) -> None:
    """Arms, grids, seeds and criteria as the docstring pre-registers them."""
    exp = md.experiment()
    grids = {a.name: [hp for hp in a.grid] for a in exp.arms}
    lrs = [{"lr": v} for v in (0.01, 0.02, 0.04)]
    assert grids == {
        "DP-Adam": [{"lr": v} for v in (0.005, 0.01, 0.02)],
        "DP-Adam (Muon plan)": [{"adam_lr": v} for v in (0.005, 0.01, 0.02)],
        "DP-Muon": lrs, "DP-Muon flat": lrs, "DP-MuonBC": lrs,
        "DP-Muon paper form": [{"lr": v} for v in (0.005, 0.01, 0.02, 0.04, 0.08)],
    }  # fmt: skip
    assert [(c.better, c.worse) for c in exp.criteria] == [
        ("DP-Muon", "DP-Adam"), ("DP-Muon", "DP-Adam (Muon plan)"), ("DP-Muon flat", "DP-Adam"),
        ("DP-MuonBC", "DP-Muon"), ("DP-Muon paper form", "DP-Adam"),
    ]  # fmt: skip
    assert list(exp.tuning_seeds) == [100] and list(exp.final_seeds) == [0, 1, 2, 3, 4]
    assert exp.settings["epochs"] == 40 and exp.settings["target_epsilon"] == 8.0
    assert exp.settings["expected_batch"] == 256 and exp.settings["max_grad_norm"] == 1.0
    with pytest.raises(SystemExit, match="unknown arms"):
        md.experiment(arms=["DP-Adam", "DP-Lion"])


def test_only_the_smoke_run_memoises_the_calibration(md: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The smoke's runs share one σ calibration (it was most of a 1-epoch run); the real runs each calibrate."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(md, "run_arm", lambda *args: calls.append(args) or {})
    for smoke in (True, False):
        md.experiment(smoke).arms[0].run({"lr": 0.01}, 0, "val")
    assert [(c[4], c[5], c[6]) for c in calls] == [(1, "rdp", True), (40, "prv", False)]


def test_every_arm_builds_the_optimizer_it_names(md: ModuleType, tmp_path: Path) -> None:
    """The configs plus each arm's overlay give the optimizer of the design (a typo would only show at fit)."""
    from dplightning.cli import build_cli
    from dplightning.optim import DPMuon
    from dplightning.optim.muon import PAPER_FORM
    from dplightning.optim.newton_schulz import ns_coefficients

    adam = {"lr": 0.02, "eps": 1e-6, "weight_decay": 0.0}  # each arm at its largest grid point
    dpmuon_adam = {"adam_lr": 0.01, "adam_betas": (0.9, 0.999), "adam_eps": 1e-6, "adam_weight_decay": 0.0}
    expected = {
        "DP-Adam": adam,
        "DP-Adam (Muon plan)": {**dpmuon_adam, "adam_lr": 0.02, "lr": 0.02, "momentum_form": "nesterov"},
        "DP-Muon": {**dpmuon_adam, "lr": 0.04, "momentum_form": "nesterov", "normalization": "frobenius",
                    "bias_correction": False, "max_noise_ratio": 0.5},
        "DP-Muon flat": {**dpmuon_adam, "lr": 0.04, "bias_correction": False},
        "DP-MuonBC": {**dpmuon_adam, "lr": 0.04, "bias_correction": True, "max_noise_ratio": None},
        "DP-Muon paper form": {**dpmuon_adam, **PAPER_FORM, "ns_coefficients": ns_coefficients("taylor2"),
                               "lr": 0.08, "bias_correction": False},
    }  # fmt: skip
    expected["DP-Muon"]["ns_coefficients"] = ns_coefficients("muon")
    assert expected["DP-Muon paper form"]["momentum_form"] == "heavyball"  # PAPER_FORM as the config says
    for spec in md.ARMS:
        folder = tmp_path / spec.name.replace(" ", "_")
        folder.mkdir()
        cli = build_cli(md.cli_args(spec, spec.grid()[-1], 3, 1, "rdp", folder), run=False)
        strategy = cli.trainer.strategy
        assert (strategy.dp_config.seed, cli.config["seed_everything"]) == (3, 3)
        assert (strategy.dp_config.target_epsilon, strategy.dp_config.max_grad_norm) == (md.EPSILON, 1.0)
        optimizer = cli.model.optimizer(cli.model.parameters())
        assert isinstance(optimizer, DPMuon) == (spec.config != md.DP_ADAM_CONFIG), spec.name
        group = optimizer.param_groups[0]
        got = {k: group[k] for k in expected[spec.name]}
        assert got == expected[spec.name], spec.name
        if isinstance(optimizer, DPMuon):
            flat, adamw = spec.name == "DP-Muon flat", spec.name == "DP-Adam (Muon plan)"
            assert (optimizer.clip_split == "flat") == flat, spec.name
            assert (getattr(optimizer, "matrix_update", "muon") == "adamw") == adamw, spec.name
