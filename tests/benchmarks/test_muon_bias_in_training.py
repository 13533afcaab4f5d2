"""benchmarks/muon_bias_in_training.py (the spec's V5): its smoke run, the clean-mean replay, the MC statistics.

The replay check is what makes the diagnostic trustworthy: the noise-free NS input Ū is built
from the released means minus the recorded noise / expected batch, through the optimizer's
momentum; U − Ū must then be the momentum-filtered DP noise, per-coordinate std τ. Dropping
the division by the batch, the noise subtraction or the momentum replay breaks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture
def bench(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("muon_bias_in_training")


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_smoke_run_records_every_matrix_and_the_replay_matches_the_optimizer(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "v5.json"
    threads = torch.get_num_threads()
    try:
        record = bench.main(["--smoke", "--out", str(out), "--figure", str(tmp_path / "v5.png")])
    finally:
        torch.set_num_threads(threads)
    assert out.exists() and (tmp_path / "v5.png").exists()
    assert "PUBLIC DATA ONLY" in record["public_data_only"]
    (run,) = record["runs"]
    assert run["form"] == "muon" and run["steps"] == 6 and run["expected_batch"] == 256
    assert run["ns_kwargs"]["normalization"] == "frobenius"
    assert len(run["per_step"]) == 6
    for row in run["per_step"]:
        # The replay: U − Ū is the DP noise through the momentum, per-coordinate std τ (~45k coordinates).
        assert abs(row["diff_std_over_tau"] - 1) < 0.1, row
        assert abs(row["diff_mean_over_tau"]) < 0.05, row
        assert row["tau_optimizer_rel_err"] < 1e-6, row  # τ from momentum_noise_variance, as the optimizer's
        assert row["expected_batch"] == pytest.approx(256, rel=1e-4)
        assert 0 < row["r_hat_p25"] <= row["r_hat_p50"] <= row["r_hat_p75"]
    # Layer 0's six matrices (q, k, v, attention out, MLP in, MLP out) at both checkpoints.
    snaps = record["snapshots"]
    assert sorted({(s["step"], s["kind"]) for s in snaps}) == sorted(
        (step, kind) for step in (2, 6) for kind in ("q", "k", "v", "attn_out", "mlp_in", "mlp_out")
    )
    assert {tuple(s["shape"]) for s in snaps} == {(64, 64), (128, 64), (64, 128)}
    for s in snaps:
        assert s["r_hat"] == pytest.approx(s["r_hat_optimizer"], rel=1e-4)  # r̂ of the recorded U is the guard's
        assert 0 < s["r_hat"] < 1.5 and s["clean_ratio"] > 0
        assert set(s["estimators"]) == {"plain", "bc", "bc_lam1/4"}
        for est in s["estimators"].values():
            for key in ("bias", "bias_raw", "mc_floor", "gain", "direction_error", "rmse"):
                assert math.isfinite(est[key]) and math.isfinite(est[f"{key}_se"]), (key, est)
            assert est["bias"] <= est["bias_raw"] + 1e-12 and est["rmse"] > 0
        assert set(s["bc_reduction"]) == {"bc", "bc_lam1/4"}
    assert len(record["summary"]) == 2 and "| run | step |" in record["markdown"]["summary"]


def test_floor_subtracted_bias_is_unbiased_where_the_raw_norm_is_not(bench: ModuleType) -> None:
    """Pairs a_i = μ + noise with ‖noise‖ ≫ ‖μ‖: the raw ‖ā‖ sits on the MC floor, θ recovers ‖μ‖²."""
    g = torch.Generator().manual_seed(0)
    d, n, groups = 400, 256, 16
    target = torch.ones(d, dtype=torch.float64)  # ‖f(Ū)‖ = 20
    mu = torch.zeros(d, dtype=torch.float64)
    mu[:4] = 1.0  # ‖μ‖ = 2: relative bias 0.1
    thetas, raws = [], []
    for _ in range(40):
        a = mu + 4.0 * torch.randn(n, d, generator=g, dtype=torch.float64)
        group = torch.arange(n) * groups // n
        S = torch.zeros(groups, d, dtype=torch.float64).index_add_(0, group, a)
        P = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, a.square().sum(1))
        D = 2 * P
        counts = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, torch.ones(n, dtype=torch.float64))
        st = bench._statistics(S.sum(0, keepdim=True), P.sum().view(1), D.sum().view(1), counts.sum().view(1), target)
        thetas.append(st["theta_rel"].item())
        raws.append(st["bias_raw"].item())
        assert st["gain"].item() == pytest.approx(1 + (a.mean(0) @ target).item() / 400)
    # The floor √(16·400/256)/20 = 0.25 dominates the raw norm; θ averages to the true 0.1² = 0.01.
    assert sum(raws) / len(raws) > 0.2
    mean_theta = sum(thetas) / len(thetas)
    se = torch.tensor(thetas).std().item() / math.sqrt(len(thetas))
    assert abs(mean_theta - 0.01) < 3 * se + 1e-4, (mean_theta, se)


def test_jackknife_se_matches_the_spread_of_a_mean(bench: ModuleType) -> None:
    """For a group mean the jackknife SE equals the usual SE of the mean over groups."""
    x = torch.randn(16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loo = (x.sum() - x) / 15
    value, se = bench._jackknife(x.mean(), loo)
    assert value == pytest.approx(x.mean().item())
    assert se == pytest.approx(x.std().item() / 4, rel=1e-9)
