"""Bounds from the validation months only (issue 24 item 3): no train read, numpy percentiles, the overlay, vacuity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import Dataset

from dplightning.cli import build_cli
from dplightning.data import ETTDataModule
from dplightning.methods.adaln_bounds import (
    RUN_PREFIX,
    CalibratedBounds,
    ConditioningValues,
    calibrate_bounds,
    calibration_windows,
    conditioning_values,
    fit_on_windows,
    main,
    percentile_bounds,
    recording,
    run_fractions_from_csv,
    unbounded_twin,
    vacuity,
)
from dplightning.models import TimeSeriesDiT
from dplightning.models.adaln import ModulationBounds, modulation_chunks
from dplightning.tasks import DPTimeSeriesDiffusion
from dplightning.tasks.timeseries_diffusion import forecast_mask
from tests.data.test_ett import MONTH, write_csv, write_values

BOUNDED = dict(c_max=4.0, gamma_max=1.0, beta_max=1.0, alpha_max=1.0, bound_mode="hard")


def template(**bounds: Any) -> DPTimeSeriesDiffusion:
    net = TimeSeriesDiT(num_features=7, hidden=16, depth=2, heads=2, mlp_ratio=2.0, position_dim=8, **bounds)
    return DPTimeSeriesDiffusion(net, horizon=4, n_samples=2, center="context_mean", parameterization="v")


class Untouchable(Dataset):
    """Stands in for the training windows: reading one fails the test."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        raise AssertionError("the calibration read a training window")


class NoTrainETT(ETTDataModule):
    """ETT whose training split cannot be read: its windows and its loader raise."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.train_set = Untouchable()  # type: ignore[assignment]

    def train_dataloader(self) -> Any:
        raise AssertionError("the calibration asked for the training loader")


def test_the_bounds_come_from_the_calibration_windows_without_reading_the_training_split(tmp_path: Path) -> None:
    write_csv(tmp_path / "ETTh1.csv")
    dm = NoTrainETT(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH)
    windows = calibration_windows(dm)
    assert len(windows) == 40 - 12 + 1  # the validation months' windows, none reaching back into training rows
    arm = template(**BOUNDED)
    before = {n: p.detach().clone() for n, p in arm.named_parameters()}
    result = calibrate_bounds(arm, windows, steps=10, batch_size=8, seed=0)
    assert result.windows == len(windows) and result.steps == 10 and result.quantile == 0.95
    assert result.c_max > 0 and result.bounds.mode == "hard"  # the arm's mode
    assert all(torch.equal(p, before[n]) for n, p in arm.named_parameters())  # the arm is copied, never trained
    assert arm.model.c_max == 4.0
    again = calibrate_bounds(template(**BOUNDED), windows, steps=10, batch_size=8, seed=0)
    assert again == result  # seeded end to end


@pytest.mark.parametrize("task", ["forecasting", "imputation"])
def test_the_calibration_windows_do_not_move_with_the_training_rows(tmp_path: Path, task: str) -> None:
    """Finding 40.6: the validation split starts input_len rows early; its first windows held training rows."""
    values = write_csv(tmp_path / "ETTh1.csv")
    public = dict(mean=[0.0] * values.shape[1], std=[1.0] * values.shape[1])  # fixed statistics: rows alone count
    kwargs: dict[str, Any] = dict(task=task, input_len=8, horizon=4, rows_per_month=MONTH, **public)
    before = calibration_windows(ETTDataModule(str(tmp_path / "ETTh1.csv"), **kwargs))
    values[: 12 * MONTH] += 7.0  # every training row changed, nothing else
    other = tmp_path / "other"
    other.mkdir()
    write_values(other / "ETTh1.csv", values)
    after = calibration_windows(ETTDataModule(str(other / "ETTh1.csv"), **kwargs))
    assert len(before) == len(after) > 0
    assert all(torch.equal(before[i], after[i]) for i in range(len(before)))


def test_a_data_module_without_a_calibration_set_is_refused() -> None:
    import lightning.pytorch as pl

    with pytest.raises(TypeError, match="no calibration_set"):
        calibration_windows(pl.LightningDataModule())


def test_a_dp_regime_calibration_trains_the_twin_with_dp_sgd_on_the_calibration_windows_only(tmp_path: Path) -> None:
    from dplightning import DPStrategy

    write_csv(tmp_path / "ETTh1.csv")
    windows = calibration_windows(NoTrainETT(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH))
    twin = unbounded_twin(template(**BOUNDED))
    model = fit_on_windows(twin, windows, steps=4, batch_size=8, seed=0, noise_multiplier=1.0, max_grad_norm=0.5)
    strategy = model.trainer.strategy
    assert isinstance(strategy, DPStrategy) and model.trainer.global_step == 4
    assert strategy.dp_state.noise_multiplier == 1.0 and strategy.dp_state.max_grad_norm == 0.5
    plain = calibrate_bounds(template(**BOUNDED), windows, steps=4, batch_size=8, seed=0)
    private = calibrate_bounds(template(**BOUNDED), windows, steps=4, batch_size=8, seed=0, noise_multiplier=1.0)
    assert plain.regime == "non-private" and private.regime == "DP-SGD (sigma=1, C=1, expected batch 8)"
    assert private.c_max != plain.c_max  # the noisy model is another model
    again = calibrate_bounds(template(**BOUNDED), windows, steps=4, batch_size=8, seed=0, noise_multiplier=1.0)
    assert again == private  # the noise is seeded: frozen bounds can be reproduced
    assert "# DP-SGD (sigma=1, C=1, expected batch 8) model" in private.to_yaml()
    with pytest.raises(ValueError, match="noise_multiplier >= 0"):
        fit_on_windows(twin, windows, steps=1, noise_multiplier=-1.0)


def test_the_twin_has_no_bound_and_fresh_seeded_weights() -> None:
    arm = template(**BOUNDED)
    for p in arm.parameters():  # as if trained (on private data): none of it may reach the calibration
        p.data.fill_(0.123)
    twin, same = unbounded_twin(arm, seed=3), unbounded_twin(arm, seed=3)
    assert twin.model.c_max is None and all(b.bounds == ModulationBounds(mode="hard") for b in twin.model.blocks)
    assert twin.model.final_layer.bounds.gamma_max is None and arm.model.blocks[0].bounds.gamma_max == 1.0
    assert not any(bool((p == 0.123).all()) for n, p in twin.named_parameters() if p.dim() > 1)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), same.parameters(), strict=True))
    with pytest.raises(TypeError, match="no AdaLN-Zero layer"):
        unbounded_twin(DPTimeSeriesDiffusion(torch.nn.Linear(2, 2)))


def test_recording_reads_c_tilde_and_every_raw_modulation() -> None:
    net = TimeSeriesDiT(num_features=3, hidden=8, depth=2, heads=2, mlp_ratio=2.0, position_dim=8, project="ctx")
    for name, p in net.named_parameters():
        if "adaLN_modulation" in name:
            p.data.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 12, 3)
    cond, t = forecast_mask(torch.ones_like(x), 4), torch.randint(0, 50, (5,))
    with recording(net) as (norms, raw):
        net((1 - cond) * x, cond * x, cond, t)
    ctx = net.ctx_encoder(cond * x, cond)  # project="ctx": the ball bounds ctx, so c̃ is ctx
    torch.testing.assert_close(norms[0], ctx.norm(dim=1).double())
    c = net.condition(t, cond * x, cond)
    expected: dict[str, list[torch.Tensor]] = {"gamma": [], "beta": [], "alpha": []}
    for layer in [*net.blocks, net.final_layer]:
        for kind, chunk in modulation_chunks(layer.adaLN_modulation(c), layer.MODULATION_KINDS):
            expected[kind].append(chunk.abs().double().flatten())
    assert all(torch.equal(torch.cat(raw[k]), torch.cat(v)) for k, v in expected.items())
    assert not any(m._forward_hooks for m in net.modules())  # removed on exit


def test_conditioning_values_cover_every_window_once(tmp_path: Path) -> None:
    windows = [torch.randn(12, 7, generator=torch.Generator().manual_seed(i)) for i in range(11)]
    module = template()
    values = conditioning_values(module, windows, batch_size=4)  # type: ignore[arg-type]
    assert values.c_norms.shape == (11,) and values.raw["gamma"].size == 11 * (2 * 2 + 1) * 16
    assert values.raw["alpha"].size == 11 * 2 * 2 * 16  # no gate in the final layer
    again = conditioning_values(module, windows, batch_size=4)  # type: ignore[arg-type]
    assert np.array_equal(again.c_norms, values.c_norms)  # seeded draws
    assert module.training  # left in the mode it was in


def test_the_percentiles_are_numpys() -> None:
    rng = np.random.default_rng(0)
    values = ConditioningValues(
        rng.lognormal(size=1001), {k: np.abs(rng.normal(size=5000)) for k in ("gamma", "beta", "alpha")}
    )
    c_max, bounds = percentile_bounds(values, 0.95, "soft")
    assert c_max == pytest.approx(np.quantile(values.c_norms, 0.95), rel=1e-12)
    assert bounds.gamma_max == pytest.approx(np.quantile(values.raw["gamma"], 0.95), rel=1e-12)
    assert bounds.alpha_max == pytest.approx(np.percentile(values.raw["alpha"], 95), rel=1e-12)
    assert np.mean(values.raw["beta"] > bounds.beta_max) == pytest.approx(0.05, abs=1e-3)  # binds on 5 % there
    zero = ConditioningValues(values.c_norms, {**values.raw, "alpha": np.zeros(10)})
    with pytest.raises(ValueError, match="did not move it from its zero init"):
        percentile_bounds(zero, 0.95, "soft")


def test_the_yaml_overlay_sets_the_arms_bounds_through_the_cli(tmp_path: Path) -> None:
    result = CalibratedBounds(12.3456789, ModulationBounds(0.5, 0.25, 0.125, "soft"), 0.95, 2785, 600, 0)
    (tmp_path / "bounds.yaml").write_text(result.to_yaml("a command"), encoding="utf-8")
    text = (tmp_path / "bounds.yaml").read_text(encoding="utf-8")
    assert "# Calibrated with: a command" in text
    args = yaml.safe_load(text)["model"]["init_args"]["model"]["init_args"]
    assert args == {"c_max": 12.3457, "gamma_max": 0.5, "beta_max": 0.25, "alpha_max": 0.125}
    arm = Path(__file__).parents[2] / "configs" / "timeseries" / "etth1_forecast_dp_aware_sigma1.0.yaml"
    cli = build_cli(["--config", str(arm), "--config", str(tmp_path / "bounds.yaml")], run=False)
    net = cli.model.model
    assert net.c_max == 12.3457 and net.blocks[0].bounds == ModulationBounds(0.5, 0.25, 0.125, "soft")
    assert net.x_embedder.out_features == 64 and net.patch_size == 8  # the rest is the arm's


# ------------------------------------------------------------------ the vacuous-arm rule


@pytest.mark.parametrize(
    ("fractions", "vacuous"),
    [
        ({"projection": 0.05, "gamma": 0.05, "beta": 0.02, "alpha": 0.08}, False),
        ({"projection": 0.01, "gamma": 0.10}, False),  # the edges are inside
        ({"projection": 0.20, "beta": 0.01}, False),
        ({"projection": 0.0099, "gamma": 0.05}, True),  # the projection hardly acts
        ({"projection": 0.2001, "gamma": 0.05}, True),  # it rescales too many examples
        ({"projection": 0.05, "alpha": 0.1001}, True),  # a modulation bound rewrites the model
        ({"projection": 0.05, "gamma": 0.005}, True),  # or hardly acts
        ({"gamma": 0.5}, True),
        ({"projection": 0.15}, False),  # 15 % of examples is fine for the projection, not for a modulation
        ({"beta": 0.15}, True),
    ],
)
def test_the_vacuous_arm_rule(fractions: dict[str, float], vacuous: bool) -> None:
    verdict = vacuity(fractions)
    assert verdict.vacuous is vacuous and len(verdict.reasons) == sum(
        not (0.01 <= v <= (0.20 if k == "projection" else 0.10)) for k, v in fractions.items()
    )


def test_the_rule_refuses_what_it_cannot_judge() -> None:
    with pytest.raises(ValueError, match="AdaLNBindFractions"):
        vacuity({})
    with pytest.raises(ValueError, match="Unknown bound"):
        vacuity({"c_max": 0.05})
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        vacuity({"gamma": float("nan")})


def test_the_rule_reads_a_runs_metrics_csv_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [
        {"step": "9", f"{RUN_PREFIX}projection": "", f"{RUN_PREFIX}gamma": "", "nonprivate/adaln_bind/gamma": "0.3"},
        {
            "step": "19",
            f"{RUN_PREFIX}projection": "0.04",
            f"{RUN_PREFIX}gamma": "0.25",
            "nonprivate/adaln_bind/gamma": "",
        },
    ]
    path = tmp_path / "metrics.csv"
    path.write_text(",".join(rows[0]) + "\n" + "\n".join(",".join(r.values()) for r in rows) + "\n", encoding="utf-8")
    assert run_fractions_from_csv(path) == {"projection": 0.04, "gamma": 0.25}
    assert main(["vacuity", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["vacuous"] is True and printed["reasons"] == [
        "gamma binds on 25.00% of coordinates > 10%: it rewrites the model"
    ]


def test_calibrate_from_a_config_writes_the_overlay(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_csv(tmp_path / "ETTh1.csv")
    config = {
        "model": {
            "class_path": "dplightning.tasks.DPTimeSeriesDiffusion",
            "init_args": {
                "horizon": 4,
                "model": {
                    "class_path": "dplightning.models.TimeSeriesDiT",
                    "init_args": {
                        "num_features": 7,
                        "hidden": 16,
                        "depth": 1,
                        "heads": 2,
                        "position_dim": 8,
                        **BOUNDED,
                    },
                },
            },
        },
        "data": {
            "class_path": "dplightning.data.ETTDataModule",
            "init_args": {
                "path": str(tmp_path / "ETTh1.csv"),
                "input_len": 8,
                "horizon": 4,
                "rows_per_month": MONTH,
                "max_val_windows": 5,
                "fault_rate": 0.5,
            },  # fmt: skip
        },
    }
    (tmp_path / "arm.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    out = tmp_path / "bounds.yaml"
    assert main(["calibrate", "--config", str(tmp_path / "arm.yaml"), "--steps", "5", "--batch-size", "8",
                 "--out", str(out), "--", "--model.init_args.center", "context_mean"]) == 0  # fmt: skip
    args = yaml.safe_load(out.read_text(encoding="utf-8"))["model"]["init_args"]["model"]["init_args"]
    assert set(args) == {"c_max", "gamma_max", "beta_max", "alpha_max"} and all(v > 0 for v in args.values())
    assert "on 29 windows of validation rows alone" in out.read_text(encoding="utf-8")  # all, not max_val_windows
    assert capsys.readouterr().out.endswith(out.read_text(encoding="utf-8"))
    assert "--seed 0 -- --model.init_args.center context_mean" in out.read_text(encoding="utf-8")  # provenance
