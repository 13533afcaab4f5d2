"""benchmarks/correlated_digits.py: its smoke run through the comparison protocol, and the registered design.

The real run (about 20 CPU minutes) is made once for the record; the smoke run keeps its code
path working: the three noise mechanisms through the strategy, the split of every number, the
registered superiority criteria, equal ε (not equal σ) across arms, and the expected error of
each arm's strategy matrix, checked here against closed forms written independently of
``dplightning.privacy.matrix_mechanism``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

N_TRAIN = 1258  # DigitsDataModule's train split


@pytest.fixture
def cd(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("correlated_digits")


def _rmse_per_sigma(n: int, momentum: float) -> float:
    """RMSE of identity-C noise (σ = 1) on the heavy-ball workload, from its definition.

    The parameters move by Σ_{u≤t} m_u with m_u = β m_{u-1} + g_u, so the noise of step s
    enters row t with weight Σ_{u=s}^{t} β^(u-s); β = 0 gives the prefix sums.
    """
    total = 0.0
    for t in range(n):
        for s in range(t + 1):
            total += sum(momentum ** (u - s) for u in range(s, t + 1)) ** 2
    return math.sqrt(total / n)


@pytest.mark.e2e  # a benchmark smoke run, now in this process (it was `slow` for its fresh interpreter)
@pytest.mark.timeout(300)
def test_smoke_run_is_equal_epsilon_paired_and_records_the_expected_error(cd: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "correlated_digits_smoke.json"
    threads = torch.get_num_threads()
    try:  # in this process: the module is imported already, a fresh interpreter would import it again
        cd.main(["--smoke", "--out", str(out), "--figures", str(tmp_path / "fig")])
    finally:
        torch.set_num_threads(threads)  # main() runs on one thread
    record = json.loads(out.read_text())
    names = [a.name for a in cd.ARMS]
    assert record["status"] == "complete" and record["experiment"] == "correlated_digits_cpu_smoke"
    assert list(record["arms"]) == names == ["DP-SGD", "band_mf b16", "BLT 2 buffers p19"]

    # Superiority of each correlated arm over DP-SGD, stored before the first final run and judged after the last.
    expected = [{"better": n, "worse": "DP-SGD"} for n in names[1:]]
    for stored in (record["criteria_registered"], record["final_started"]["criteria"], record["criteria"]):
        assert [{k: c[k] for k in ("better", "worse")} for c in stored] == expected
        assert all("margin" not in c for c in stored)
    for judged in record["criteria"]:
        assert judged["passed"] == (judged["lower_bound"] > 0)

    runs = record["runs"]
    specs = {a.name: a for a in cd.ARMS}
    for name in names:
        mine = [r for r in runs if r["arm"] == name]
        final = [r for r in mine if r["phase"] == "final"]
        select = [r for r in mine if r["phase"] == "select"]
        # Selection on the validation split only; 5 paired final runs on test at the selected point.
        assert {r["split"] for r in select} == {"val"} and [r["seed"] for r in select] == list(cd.TUNING_SEEDS)
        assert {s["split"] for s in record["selection"][name]["grid"]} == {"val"}
        assert record["selection"][name]["val_mean"] == statistics.fmean(r["metrics"]["accuracy"] for r in select)
        assert {r["split"] for r in final} == {"test"} and sorted(r["seed"] for r in final) == [0, 1, 2, 3, 4]
        assert not set(cd.TUNING_SEEDS) & {r["seed"] for r in final}
        assert {json.dumps(r["hparams"]) for r in final} == {json.dumps(record["selection"][name]["hparams"])}
        partitions = specs[name].partitions
        for r in mine:
            m = r["metrics"]
            assert 0 <= m["accuracy"] <= 1 and 0.1 - 1e-9 <= m["majority_class_fraction"] <= 1
            assert m["steps"] == m["planned_steps"] == cd.SMOKE_STEPS and m["partitions"] == partitions
            assert m["momentum_workload"] == 0.9  # C optimised for heavy-ball SGD, as the design states
            # Each arm's own accounting: q = B/N per step; q' = pB/N once per cycle; BLT one Gaussian at q = 1.
            rate, compositions = {
                "DP-SGD": (cd.BATCH / N_TRAIN, cd.SMOKE_STEPS),
                "band_mf b16": (16 * cd.BATCH / N_TRAIN, math.ceil(cd.SMOKE_STEPS / 16)),
                "BLT 2 buffers p19": (1.0, 1),
            }[name]  # fmt: skip
            assert m["accounted_sample_rate"] == pytest.approx(rate) and m["compositions"] == compositions
            assert abs(m["mean_batch_rows"] - cd.BATCH) < 16  # each sampler's expected batch is B
            # RMSEs are the per-σ error at the run's σ.
            for key in ("rmse_prefix", "rmse_momentum"):
                assert m[key] == pytest.approx(m[f"{key}_per_sigma"] * m["sigma"], rel=1e-12) and m[key] > 0
                assert m[f"max_{key}"] >= m[key]
            assert (m["sensitivity"] == 1.0) == (name != "BLT 2 buffers p19"), (name, m["sensitivity"])

    # Equal ε, one δ, not equal σ: each arm's σ is calibrated by its own accounting (one σ per arm).
    deltas = {r["metrics"]["delta"] for r in runs}
    assert len(deltas) == 1 and deltas.pop() == pytest.approx(1 / (10 * N_TRAIN))
    for r in runs:
        assert cd.EPSILON * 0.98 <= r["metrics"]["epsilon"] <= cd.EPSILON + 1e-9, r
    assert record["equal_epsilon"]["passed"] is True
    sigma = {n: {r["metrics"]["sigma"] for r in runs if r["arm"] == n} for n in names}
    assert all(len(s) == 1 for s in sigma.values()), sigma
    assert sigma["band_mf b16"].pop() > sigma["DP-SGD"].pop()  # fewer, less amplified compositions

    # DP-SGD's identity C against the closed form; band_mf's C below it at equal σ (both workloads).
    final = {(r["arm"], r["seed"]): r["metrics"] for r in runs if r["phase"] == "final"}
    sgd, band = final["DP-SGD", 0], final["band_mf b16", 0]
    assert sgd["rmse_prefix_per_sigma"] == pytest.approx(math.sqrt((cd.SMOKE_STEPS + 1) / 2), rel=1e-9)
    assert sgd["rmse_momentum_per_sigma"] == pytest.approx(_rmse_per_sigma(cd.SMOKE_STEPS, 0.9), rel=1e-9)
    assert band["rmse_momentum_per_sigma"] < 0.9 * sgd["rmse_momentum_per_sigma"]
    assert band["rmse_prefix_per_sigma"] < sgd["rmse_prefix_per_sigma"]

    # The summary: per-arm means of the final runs and the ratio to DP-SGD.
    summary = record["expected_error"]
    for name in names:
        values = [final[name, s]["rmse_momentum"] for s in range(5)]
        assert summary[name]["rmse_momentum"]["mean"] == pytest.approx(statistics.fmean(values))
        ratio = summary[name]["rmse_momentum_ratio_to_dp_sgd"]
        assert ratio == pytest.approx(statistics.fmean(values) / summary["DP-SGD"]["rmse_momentum"]["mean"])
    assert summary["DP-SGD"]["rmse_prefix_ratio_to_dp_sgd"] == 1.0
    assert record["pairing"] == cd.PAIRING and "not the batches" in cd.PAIRING
    markdown = (tmp_path / "correlated_digits_smoke.md").read_text()
    assert "## Expected error" in markdown and "**passed**" in markdown
    assert cd.PAIRING in markdown and "the same Poisson sampling and noise seeds" not in markdown
    for figure in ("correlated_digits_cpu_smoke.png", "correlated_digits_cpu_smoke_rmse.png"):
        assert (tmp_path / "fig" / figure).stat().st_size > 0


def test_the_registered_experiment(cd: ModuleType) -> None:
    """Arms, grids, seeds, criteria and settings as the docstring pre-registers them."""
    exp = cd.experiment()
    lrs = [{"lr": v} for v in (0.05, 0.1, 0.2, 0.4)]
    assert {a.name: [dict(hp) for hp in a.grid] for a in exp.arms} == {
        "DP-SGD": lrs, "band_mf b16": lrs, "BLT 2 buffers p19": lrs
    }  # fmt: skip
    assert [(c.better, c.worse, c.margin) for c in exp.criteria] == [
        ("band_mf b16", "DP-SGD", 0.0), ("BLT 2 buffers p19", "DP-SGD", 0.0)
    ]  # fmt: skip
    assert list(exp.tuning_seeds) == [100] and list(exp.final_seeds) == [0, 1, 2, 3, 4]
    settings = exp.settings
    assert (settings["steps"], settings["target_epsilon"], settings["expected_batch"]) == (1600, 8.0, 64)
    assert settings["max_grad_norm"] == 1.0 and settings["accountant"].startswith("prv")
    assert settings["arms"] == {
        "DP-SGD": {"noise_mechanism": "gaussian"},
        "band_mf b16": {"noise_mechanism": "band_mf", "bands": 16, "cyclic_partitions": 16},
        "BLT 2 buffers p19": {"noise_mechanism": "blt", "blt_buffers": 2, "cyclic_partitions": 19},
    }
    # 19 partitions is the most the cyclic sampler allows (q' = p B / N <= 1); bands <= partitions.
    assert 19 * 64 <= N_TRAIN < 20 * 64
    smoke = cd.experiment(smoke=True)
    assert smoke.settings["steps"] == cd.SMOKE_STEPS and cd.SMOKE_STEPS % 19 == 0
    assert all([dict(hp) for hp in a.grid] == [{"lr": 0.2}] for a in smoke.arms)
    assert list(smoke.final_seeds) == [0, 1, 2, 3, 4] and smoke.name != exp.name


def test_strategy_error_is_the_identity_closed_form_and_checks_the_sensitivity(cd: ModuleType) -> None:
    dp_sgd = cd.ARMS[0]
    fake = SimpleNamespace(noise_strategy=None, noise_multiplier=2.0, noise_sensitivity=1.0)
    errors = cd.strategy_error(fake, dp_sgd, 12)
    assert errors["rmse_prefix"] == pytest.approx(2.0 * math.sqrt(13 / 2), rel=1e-12)
    assert errors["rmse_momentum"] == pytest.approx(2.0 * _rmse_per_sigma(12, 0.9), rel=1e-12)
    assert errors["max_rmse_prefix"] == pytest.approx(2.0 * math.sqrt(12), rel=1e-12)
    assert errors["sensitivity"] == 1.0
    with pytest.raises(RuntimeError, match="not the strategy's"):
        cd.strategy_error(SimpleNamespace(noise_strategy=None, noise_multiplier=2.0, noise_sensitivity=2.0), dp_sgd, 12)


def _record(epsilons: dict[str, list[float]], delta: float = 1e-4) -> dict:
    runs = [
        {"phase": "final", "arm": arm, "seed": s, "metrics": {
            "epsilon": e, "delta": delta, "sigma": 1.0, "sensitivity": 1.0, "rmse_prefix": 2.0 + i,
            "rmse_momentum": 10.0 * (i + 1), "rmse_prefix_per_sigma": 2.0, "rmse_momentum_per_sigma": 10.0,
            "accuracy": 0.5}}
        for i, (arm, values) in enumerate(epsilons.items()) for s, e in enumerate(values)
    ]  # fmt: skip
    return {"arms": {arm: {} for arm in epsilons}, "runs": runs}


def test_summary_flags_a_run_off_equal_epsilon(cd: ModuleType) -> None:
    ok = cd.summarise(_record({"DP-SGD": [7.99, 8.0], "band_mf b16": [7.95, 7.9]}))
    assert ok["equal_epsilon"]["passed"] and ok["expected_error"]["band_mf b16"]["rmse_momentum_ratio_to_dp_sgd"] == 2
    assert not cd.summarise(_record({"DP-SGD": [8.0, 8.0], "band_mf b16": [7.5, 8.0]}))["equal_epsilon"]["passed"]
    assert not cd.summarise(_record({"DP-SGD": [8.0, 8.0], "band_mf b16": [8.0, 8.01]}))["equal_epsilon"]["passed"]
    record = _record({"DP-SGD": [8.0], "band_mf b16": [8.0]})
    record["runs"][1]["metrics"]["delta"] = 2e-4  # another δ is not the same privacy
    assert not cd.summarise(record)["equal_epsilon"]["passed"]


def test_every_arm_is_a_valid_strategy_configuration(cd: ModuleType) -> None:
    """A DPStrategy accepts each arm's arguments (its config rules run before any training)."""
    from dplightning import DPStrategy

    for spec in cd.ARMS:
        strategy = DPStrategy(target_epsilon=cd.EPSILON, max_grad_norm=cd.MAX_GRAD_NORM, **spec.mechanism)
        assert strategy.noise_mechanism == spec.mechanism["noise_mechanism"]
        if strategy.dp_config.correlated:
            assert strategy.dp_config.partitions == spec.partitions
    assert [(a.partitions, a.participations) for a in cd.ARMS] == [(1, "one"), (16, "one"), (19, "all")]
