"""benchmarks/dpdm_protocol.py and dpdm_regime.py: the pre-registered judgements, the held-out loss, the regime.

The real experiments (about an hour of CPU) run once for the record; these tests keep the
claims' arithmetic, the fixed evaluation draws and the regime's σ honest, and the smoke run
keeps E1's code path working through the protocol.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dplightning.privacy.accounting import compute_epsilon

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dp(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("dpdm_protocol")


def _record(arms: dict[str, list[dict[str, float]]]) -> dict:
    seeds = list(range(len(next(iter(arms.values())))))
    runs = [{"phase": "final", "arm": a, "seed": s, "metrics": m} for a, ms in arms.items() for s, m in zip(seeds, ms)]
    return {"identity": {"final_seeds": seeds}, "runs": runs}


def test_e1_needs_four_loss_wins_and_a_gain_above_two_standard_errors(dp: ModuleType) -> None:
    k1 = [{"heldout_loss": 1.0, "accuracy": 0.50} for _ in range(5)]
    gains = [0.10, 0.12, 0.08, 0.11, 0.09]  # mean 0.10, sd 0.0158: 2 SE = 0.0141
    k4 = [{"heldout_loss": 0.9, "accuracy": 0.50 + g} for g in gains]
    judged = dp.judge_e1(_record({"K=1": k1, "K=4": k4}))
    se = statistics.stdev(gains) / math.sqrt(5)
    assert judged["passed"] and judged["heldout_loss_wins_of_K4"] == 5 and judged["cnn_gain_se"] == pytest.approx(se)
    k4[0]["heldout_loss"] = k4[1]["heldout_loss"] = 1.1  # only 3 wins: fails whatever the accuracy
    assert not dp.judge_e1(_record({"K=1": k1, "K=4": k4}))["passed"]
    noisy = [{"heldout_loss": 0.9, "accuracy": 0.5 + g} for g in (0.30, -0.20, 0.25, -0.15, 0.0)]  # mean 0.04 < 2 SE
    assert not dp.judge_e1(_record({"K=1": k1, "K=4": noisy}))["passed"]


def _e2_records(dp: ModuleType, gaps: dict[float, list[float]], dpdm_inf: float) -> dict:
    records = {}
    for eps, per_seed in gaps.items():
        dpsgd = [{"accuracy": 0.9} for _ in per_seed]
        dpdm = [{"accuracy": 0.9 - g} for g in per_seed]
        records[eps] = _record({dp.DPDM: dpdm, dp.DP_SGD: dpsgd})
    records[math.inf]["arms"] = {dp.DPDM: {"metrics": {"accuracy": {"mean": dpdm_inf}}}}
    return records


def test_e2_shrinking_gap_ceiling_and_budget_verdicts(dp: ModuleType) -> None:
    jitter = [0.01, -0.01, 0.0, 0.02, -0.02]
    gaps = {1.0: [0.5 + j for j in jitter], 10.0: [0.3 - j for j in jitter], 100.0: [0.1 + j for j in jitter],
            math.inf: [0.05 - j for j in jitter]}  # fmt: skip
    judged = dp.judge_e2(_e2_records(dp, gaps, 0.85), {"cnn": 0.88, "logreg": 0.8})
    assert judged["E2a"]["passed"] and judged["E2a"]["means_non_increasing"]
    assert judged["E2b"]["passed"]  # 0.85 >= 0.88 - 0.05
    assert judged["E2c"]["verdict"] == "not reproducible at this budget"  # gap 0.30 at ε = 10 > 0.10
    assert judged["gap_per_epsilon"]["10"]["mean"] == pytest.approx(0.3)
    gaps[100.0] = [0.6 + j for j in jitter]  # a bump: not monotone, so not shown even though gap(1) > gap(∞)
    bumped = dp.judge_e2(_e2_records(dp, gaps, 0.80), {"cnn": 0.88, "logreg": 0.8})
    assert not bumped["E2a"]["passed"] and bumped["E2a"]["gap1_minus_gapinf"]["low"] > 0
    assert not bumped["E2b"]["passed"]  # 0.80 < 0.83


def test_heldout_loss_uses_the_same_draws_whatever_the_arms_k(dp: ModuleType) -> None:
    from dplightning.models import NCSNppUNet
    from dplightning.tasks import DPDiffusion

    def perturb(net: torch.nn.Module) -> torch.nn.Module:  # the last layers start at zero: move every weight
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * torch.randn_like(p))
        return net

    torch.manual_seed(0)
    net = perturb(NCSNppUNet(image_size=8, **dp.NET))
    images, labels = torch.rand(6, 1, 8, 8), torch.arange(6)
    losses = [dp.heldout_loss(DPDiffusion(net, noise_multiplicity=k), images, labels, 3) for k in (1, 4)]
    assert losses[0] == losses[1]  # the same fixed draws whatever the training K
    assert dp.heldout_loss(DPDiffusion(net), images, labels, 4) != losses[0]  # more draws: other draws
    assert dp.heldout_loss(DPDiffusion(perturb(net)), images, labels, 3) != losses[0]  # other weights


def test_regime_sigma_is_the_smallest_that_meets_epsilon_and_the_ratio_follows(
    benchmark_module: Callable[[str], ModuleType],
) -> None:
    regime = benchmark_module("dpdm_regime")
    setting = regime.Setting("tiny", 1000, 100, 50, 4.0, {"image_size": 8, **regime.SMALL})
    row = regime.measure(setting)
    d = sum(p.numel() for p in regime.NCSNppUNet(image_size=8, **regime.SMALL).parameters())
    assert row["parameters"] == d and row["noise_to_signal"] == pytest.approx(row["sigma"] * math.sqrt(d) / 100)
    eps = compute_epsilon([(row["sigma"], 0.1, 50)], 1e-4)
    assert eps <= 4.0 and compute_epsilon([(0.97 * row["sigma"], 0.1, 50)], 1e-4) > 4.0


@pytest.mark.e2e
@pytest.mark.timeout(900)  # 14 short trainings, LocalFeatures and the classifiers: minutes on a shared CPU
def test_e1_smoke_run_goes_through_the_protocol(dp: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "s"
    threads = torch.get_num_threads()
    try:  # in this process: the module is imported already, a fresh interpreter would import it again
        dp.main(["--smoke", "--only", "E1", "--out", str(out), "--figures", str(tmp_path / "fig")])
    finally:
        torch.set_num_threads(threads)  # main() runs on one thread
    record = json.loads((tmp_path / "s_k.json").read_text())
    assert record["status"] == "complete" and set(record["arms"]) == {"K=1", "K=4"}
    finals = [r for r in record["runs"] if r["phase"] == "final"]
    assert len(finals) == 10 and all(r["split"] == "test" for r in finals)
    selects = [r for r in record["runs"] if r["phase"] == "select"]
    assert selects and all(r["split"] == "val" and "accuracy" not in r["metrics"] for r in selects)
    for r in finals:
        m = r["metrics"]
        assert m["epsilon"] <= 10 + 1e-9 and 0 <= m["accuracy"] <= 1 and m["fid_local"] > 0 and m["K"] in (1, 4)
    sigmas = {r["seed"]: set() for r in finals}
    for r in finals:
        sigmas[r["seed"]].add(r["metrics"]["sigma"])
    assert all(len(s) == 1 for s in sigmas.values())  # equal ε, equal σ: K does not change the accounting
    claims = json.loads((tmp_path / "s_claims.json").read_text())
    assert claims["E1"]["claim"] == record["identity"]["settings"]["claims"]  # judged as registered


def test_the_smoke_shrinks_the_batch_and_the_real_records_keep_their_identity(dp: ModuleType) -> None:
    smoke = dp.settings("digits", dp.Budget(**dp.SMOKE), 10.0, dp.E1_CLAIM)
    assert smoke["expected_batch"] == dp.SMOKE["batch"] < dp.BATCH and "batch" not in smoke["budget"]
    record = json.loads((ROOT / "benchmarks" / "results" / "dpdm_digits_cpu_k.json").read_text())
    real = dp.e1("digits", dp.Budget(), smoke=False).identity()
    assert {**real, "name": record["identity"]["name"]} == record["identity"]  # still resumes the committed record
    assert real["settings"]["expected_batch"] == 256
