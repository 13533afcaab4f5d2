"""GradientTailStats: the statistics against numpy/scipy references, the groups, and a run against torch.func."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from dplightning.callbacks import GradientTailStats
from dplightning.callbacks._grouping import module_groups, parameter_groups
from dplightning.callbacks._statistics import clip_shares, excess_kurtosis, hill_tail_index, norm_quantiles
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import per_example_grads

N, BATCH = 64, 16


# ------------------------------------------------------------------ statistics on synthetic norms


@pytest.mark.parametrize("alpha", [1.5, 3.0])
def test_hill_recovers_a_pareto_tail_index(alpha: float) -> None:
    rng = np.random.default_rng(0)
    x = 0.1 * (1 + rng.pareto(alpha, 20_000))  # P(X > x) ∝ x^-alpha
    k = int(0.05 * len(x))
    # Tolerance: 4 standard errors of the estimator, alpha / sqrt(k) (6% of alpha at k = 1000).
    assert hill_tail_index(x, 0.05) == pytest.approx(alpha, abs=4 * alpha / math.sqrt(k))


def test_hill_reads_the_tail_not_the_body() -> None:
    rng = np.random.default_rng(1)
    body = np.abs(rng.normal(0.0, 0.3, 18_000))  # light body below 1
    tail = 1 + rng.pareto(2.0, 2_000)  # 10% Pareto(2) above 1: the top 5% all come from it
    x = rng.permutation(np.concatenate([body, tail]))
    assert hill_tail_index(x, 0.05) == pytest.approx(2.0, abs=4 * 2.0 / math.sqrt(1000))
    assert math.isnan(hill_tail_index(x[:30], 0.05))  # k = 1: undefined


def test_kurtosis_and_quantiles_match_scipy_and_numpy() -> None:
    stats = pytest.importorskip("scipy.stats")
    x = np.random.default_rng(2).lognormal(0.0, 1.0, 5_000)
    assert excess_kurtosis(x) == pytest.approx(stats.kurtosis(x, fisher=True, bias=True), rel=1e-9)
    q = norm_quantiles(np.append(x, np.inf), (0.5, 0.9, 0.99, 0.999))  # non-finite values are dropped
    assert list(q) == ["p50", "p90", "p99", "p99.9", "max"]
    assert list(q.values()) == pytest.approx([*np.quantile(x, [0.5, 0.9, 0.99, 0.999]), x.max()])
    assert math.isnan(excess_kurtosis(np.ones(10)))


def test_clip_shares_average_the_squared_norm_share_over_clipped_examples() -> None:
    group_sq = np.array([[1.0, 3.0], [4.0, 0.0], [1.0, 1.0]])
    shares = clip_shares(group_sq, group_sq.sum(1), np.array([True, True, False]))
    assert shares.tolist() == [(0.25 + 1.0) / 2, (0.75 + 0.0) / 2]
    assert np.isnan(clip_shares(group_sq, group_sq.sum(1), np.zeros(3, dtype=bool))).all()


# ------------------------------------------------------------------ parameter groups


def test_default_groups_are_the_top_level_modules_below_a_shared_wrapper() -> None:
    names = ["model.features.0.weight", "model.features.0.bias", "model.head.weight", "model.head.bias"]
    assert module_groups(names) == {"model.features": [0, 1], "model.head": [2, 3]}
    assert module_groups(["lin.weight", "lin.bias", "scale"]) == {"lin": [0, 1], "scale": [2]}


def test_conditioning_path_versus_the_rest() -> None:
    names = ["x_embedder.weight", "t_embedder.mlp.0.weight", "blocks.0.attn.weight",
             "blocks.0.adaLN_modulation.1.weight", "final.adaLN_modulation.1.bias", "final.linear.weight"]  # fmt: skip
    groups = parameter_groups(names, {"cond": ["t_embedder.*", "*.adaLN_modulation.*"]})
    assert groups == {"cond": [1, 3, 4], "rest": [0, 2, 5], "all": [0, 1, 2, 3, 4, 5]}
    with pytest.raises(ValueError, match="matches no"):
        parameter_groups(names, {"cond": "ctx.*"})
    with pytest.raises(ValueError, match="reserved"):
        parameter_groups(names, {"all": "*"})


# ------------------------------------------------------------------ in a run


def test_first_step_statistics_match_reference_per_example_norms(tmp_path) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    before = params_of(module)
    callback = GradientTailStats(groups={"first": "net.0.*"}, quantiles=(0.5, 0.9), tail_fraction=0.2)
    trainer = make_trainer(dp(max_grad_norm=0.5, seed=0), callbacks=[callback], logger=CSVLogger(tmp_path))
    trainer.fit(module, loader(make_dataset(N), BATCH))
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = (torch.cat(t) for t in zip(*module.batches, strict=True))
    grads = per_example_grads(net, F.cross_entropy, x, y)
    grads = {n: g.flatten(1).pow(2).sum(1).double().numpy() for n, g in grads.items()}
    sq = {"first": grads["0.weight"] + grads["0.bias"], "rest": grads["2.weight"] + grads["2.bias"]}
    sq["all"] = sq["first"] + sq["rest"]
    clipped = np.sqrt(sq["all"]) > 0.5
    (record,) = callback.history
    assert callback.group_names == ["first", "rest", "all"] and record.examples == len(x)
    for group, values in sq.items():
        norms = np.sqrt(values)
        stats = record.stats[group]
        expected = [*np.quantile(norms, [0.5, 0.9]), norms.max()]
        assert [stats["p50"], stats["p90"], stats["max"]] == pytest.approx(expected, rel=1e-5)
        assert stats["kurtosis"] == pytest.approx(excess_kurtosis(norms), rel=1e-4, abs=1e-6)
        assert stats["hill_alpha"] == pytest.approx(hill_tail_index(norms, 0.2), rel=1e-4)
        if group != "all":
            assert stats["clip_share"] == pytest.approx(np.mean(values[clipped] / sq["all"][clipped]), rel=1e-5)
    assert callback.figure_path is not None and callback.figure_path.exists()
    header = open(f"{trainer.log_dir}/metrics.csv").readline()
    assert "nonprivate/tail/first/p50" in header and "nonprivate/tail/rest/clip_share" in header


def test_windows_pool_every_example_once() -> None:
    module = TinyModule(lr=0.3)
    callback = GradientTailStats(every_n_steps=4, save_figure=False)
    trainer = make_trainer(dp(seed=0), callbacks=[callback], max_steps=10, accumulate_grad_batches=2)
    trainer.fit(module, loader(make_dataset(N), BATCH))
    assert [r.step for r in callback.history] == [4, 8, 10]
    assert sum(r.examples for r in callback.history) == sum(len(x) for x, _ in module.batches)
