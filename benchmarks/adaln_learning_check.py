"""Does the time-series DiT learn on ETTh1 without DP? Test MSE/MAE/CRPS against repeat-last, train mean, linear LS.

Trains ``TimeSeriesDiT`` without DP (``strategy="auto"``) for forecasting (96 -> 96) and
imputation (windows of 96, ``--missing-ratio`` of the test points hidden), once per arm
(``--arms layout/variant``), and scores the sampled medians on ``--test-windows`` evenly
spaced test windows x ``--samples`` samples. Layouts (``LAYOUTS``): the spec's two paths
(``spec``: tokens carry M_c ⊙ X and c gets a mean-pooled ctx), ``c_only`` (the context reaches
the network through c alone), and either with the flattened-window encoder (``*_flat``).
Variants (``VARIANTS``): CSDI's ε-prediction on z-scored windows (``csdi``), or v-prediction
on windows centred on their own context's per-channel mean (``v_centred``). The baselines
see the same windows and masks:

* forecasting: repeat the last context value; the train mean (0 in z-scores); the context
  window's own mean (what a centred model predicts when it learns nothing else); a linear
  least-squares map 96 -> 96 with bias, shared by the channels and fitted on every training
  window;
* imputation: the train mean; last observation carried forward (the first observation
  backward for leading gaps); linear interpolation in time; a linear least-squares imputer
  shared by the channels, [M_c ⊙ x, M_c, 1] (193 values) -> x (96), fitted on every training
  window with a Bernoulli(``--missing-ratio``) mask.

MSE and MAE are in the normalised space (train-split z-scores, TSLib's convention); CRPS and
CRPS-sum on de-normalised values (CSDI's convention; a point forecast's CRPS is its
Σ|error| / Σ|y|). ``--eval-split val`` scores validation windows instead (to choose a setting
without the test split). Nothing here is differentially private: the check is whether the
model and budget learn at all.

    OMP_NUM_THREADS=1 python benchmarks/adaln_learning_check.py
    OMP_NUM_THREADS=1 python benchmarks/adaln_learning_check.py --tasks imputation --arms spec/v_centred --steps 100

Results go to ``--out`` (JSON, rewritten after every run).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from _harness import quiet_trainer, write_report
from _outputs import default_result
from torch import Tensor

from dplightning.data import ETTDataModule
from dplightning.data.ett import WindowDataset
from dplightning.metrics.crps import quantile_crps
from dplightning.models import TimeSeriesDiT
from dplightning.tasks import DPTimeSeriesDiffusion

INPUT, HORIZON = 96, 96
LAYOUTS: dict[str, dict[str, Any]] = {  # name -> TimeSeriesDiT options
    "spec": {"context_path": "tokens_and_c", "context_encoder": "mean"},  # the spec's two-path layout
    "c_only": {"context_path": "c_only", "context_encoder": "mean"},
    "c_only_flat": {"context_path": "c_only", "context_encoder": "flatten"},
    "spec_flat": {"context_path": "tokens_and_c", "context_encoder": "flatten"},
}
VARIANTS: dict[str, dict[str, str]] = {  # name -> DPTimeSeriesDiffusion options
    "csdi": {"parameterization": "eps", "center": "none"},  # CSDI's ε-prediction on the z-scored windows
    "v": {"parameterization": "v", "center": "none"},
    "v_centred": {"parameterization": "v", "center": "context_mean"},
}
DEFAULT_ARMS = ["spec/csdi", "spec/v_centred", "spec_flat/v_centred", "c_only/v_centred", "c_only_flat/v_centred"]
BOUNDS = {"none": {}, "aware": {"gamma_max": 1.0, "beta_max": 1.0, "alpha_max": 1.0}}  # c_max: --c-max


def arm_name(text: str) -> str:
    """A ``layout/variant`` pair, both known."""
    layout, _, variant = text.partition("/")
    if layout not in LAYOUTS or variant not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want layout/variant, layout in {list(LAYOUTS)}, variant in {list(VARIANTS)}"
        )
    return text


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="../shared/data/ett/ETTh1.csv")
    p.add_argument("--tasks", nargs="+", default=["forecasting", "imputation"])
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, type=arm_name, help="layout/variant pairs")
    p.add_argument("--bounds", nargs="+", default=["none"], choices=list(BOUNDS), help="none: vanilla AdaLN-Zero")
    p.add_argument("--c-max", type=float, default=8.0, help="radius of the ball, bounds 'aware' only")
    p.add_argument("--project", default="t_emb+ctx", choices=["t_emb+ctx", "ctx"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps of every run")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"], help="cosine: decay to 0")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=8, help="time steps per token")
    p.add_argument("--clip-denoised", type=float, default=5.0, help="sampler clamp of x0 (negative: none, CSDI)")
    p.add_argument("--missing-ratio", type=float, default=0.25, help="imputation: share of test points hidden")
    p.add_argument("--test-windows", type=int, default=512)
    p.add_argument(
        "--eval-split",
        default="test",
        choices=["test", "val"],
        help="val: score on the validation windows instead (for choosing a budget without the test split)",
    )
    p.add_argument("--samples", type=int, default=16, help="samples per test window")
    p.add_argument("--out", default=str(default_result("adaln_learning_check_cpu.json")))
    return p.parse_args()


def build_data(args: argparse.Namespace, task: str) -> ETTDataModule:
    dm = ETTDataModule(args.data, task=task, input_len=INPUT, horizon=HORIZON, batch_size=args.batch_size,  # type: ignore[arg-type]
                       max_test_windows=args.test_windows, eval_batch_size=64)  # fmt: skip
    dm.setup()
    if args.eval_split == "val":  # the test loop then runs on evenly spaced validation windows
        dm.test_set = WindowDataset(dm.splits["val"], dm.window, max_windows=args.test_windows)
    return dm


def build_module(
    args: argparse.Namespace, task: str, layout: str, bounds: str, variant: str = "csdi"
) -> DPTimeSeriesDiffusion:
    window = INPUT + HORIZON if task == "forecasting" else INPUT
    extra = dict(BOUNDS[bounds], c_max=args.c_max) if bounds == "aware" else {}
    net = TimeSeriesDiT(hidden=args.hidden, depth=args.depth, heads=args.heads, mlp_ratio=2.0,
                        patch_size=args.patch_size, window=window, project=args.project,
                        **LAYOUTS[layout], **extra)  # fmt: skip
    return DPTimeSeriesDiffusion(
        net, task=task, horizon=HORIZON, eval_missing_ratio=args.missing_ratio, n_samples=args.samples,  # type: ignore[arg-type]
        clip_denoised=args.clip_denoised if args.clip_denoised >= 0 else None, **VARIANTS[variant],
        optimizer=lambda params: torch.optim.Adam(params, lr=args.lr),
    )  # fmt: skip


# ------------------------------------------------------------------ baselines on the module's test windows and masks


def test_batches(dm: ETTDataModule, module: DPTimeSeriesDiffusion) -> list[tuple[Tensor, Tensor]]:
    """``(x, M_c)`` of every test batch, the masks drawn exactly as ``module.test_step`` draws them."""
    return [(x, module.evaluation_mask(torch.ones_like(x), i)) for i, x in enumerate(dm.test_dataloader())]


def lstsq_fit(inputs: Tensor, targets: Tensor) -> Tensor:
    """Least-squares weights ``[F + 1, out]`` of ``[inputs, 1] @ W ≈ targets`` (float64)."""
    design = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype)], dim=1)
    return torch.linalg.lstsq(design, targets).solution


def lstsq_apply(weights: Tensor, inputs: Tensor) -> Tensor:
    return torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype)], dim=1) @ weights


def channel_rows(x: Tensor) -> Tensor:
    """``[B, L, K]`` -> ``[B·K, L]``: one row per (window, channel), for maps shared by the channels."""
    return x.transpose(1, 2).reshape(-1, x.shape[1])


def from_channel_rows(rows: Tensor, k: int) -> Tensor:
    return rows.reshape(-1, k, rows.shape[1]).transpose(1, 2)


def forecast_predictors(dm: ETTDataModule) -> dict[str, Any]:
    train = dm.splits["train"].unfold(0, INPUT + HORIZON, 1).permute(0, 2, 1)  # [N, 192, K], every train window
    weights = lstsq_fit(channel_rows(train[:, :INPUT]), channel_rows(train[:, INPUT:]))
    k = train.shape[2]

    def linear(x: Tensor) -> Tensor:
        return from_channel_rows(lstsq_apply(weights, channel_rows(x[:, :INPUT].double())), k)

    return {
        "repeat_last": lambda x: x[:, INPUT - 1 : INPUT].expand(-1, HORIZON, -1),
        "train_mean": lambda x: torch.zeros_like(x[:, INPUT:]),
        "window_mean": lambda x: x[:, :INPUT].mean(1, keepdim=True).expand(-1, HORIZON, -1),
        "linear_lstsq": linear,
    }


def locf(x: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Last observation carried forward along time, per channel; leading gaps take the first observation."""
    out = np.empty_like(x)
    for k in range(x.shape[1]):
        idx = np.flatnonzero(observed[:, k])
        if len(idx) == 0:
            out[:, k] = 0.0
            continue
        pos = np.searchsorted(idx, np.arange(len(x)), side="right") - 1
        out[:, k] = x[idx[np.maximum(pos, 0)], k]
    return out


def interpolate(x: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Linear interpolation in time per channel (constant beyond the first/last observation)."""
    out = np.zeros_like(x)
    for k in range(x.shape[1]):
        idx = np.flatnonzero(observed[:, k])
        if len(idx):
            out[:, k] = np.interp(np.arange(len(x)), idx, x[idx, k])
    return out


def imputation_predictors(dm: ETTDataModule, ratio: float) -> dict[str, Any]:
    train = dm.splits["train"].unfold(0, INPUT, 1).permute(0, 2, 1)  # [N, 96, K]
    keep = (torch.rand(train.shape, generator=torch.Generator().manual_seed(0), dtype=train.dtype) >= ratio).double()
    features = torch.cat([channel_rows(keep * train), channel_rows(keep)], dim=1)
    weights = lstsq_fit(features, channel_rows(train))
    k = train.shape[2]

    def linear(x: Tensor, cond: Tensor) -> Tensor:
        x, cond = x.double(), cond.double()
        return from_channel_rows(lstsq_apply(weights, torch.cat([channel_rows(cond * x), channel_rows(cond)], 1)), k)

    def per_window(fn: Any) -> Any:
        return lambda x, cond: torch.from_numpy(np.stack([fn(w, c) for w, c in zip(x.numpy(), cond.numpy())]))

    return {
        "train_mean": lambda x, cond: torch.zeros_like(x),
        "locf": per_window(locf),
        "linear_interp": per_window(interpolate),
        "linear_lstsq": linear,
    }


def score_points(preds: list[Tensor], batches: list[tuple[Tensor, Tensor]], dm: ETTDataModule) -> dict[str, float]:
    """MSE/MAE (normalised) and point CRPS / CRPS-sum (de-normalised) of point predictions on the hidden points."""
    targets = torch.cat([x for x, _ in batches]).double()
    hidden = torch.cat([1 - c for _, c in batches]).double()
    pred = torch.cat(preds).double()
    pred = hidden * pred + (1 - hidden) * targets  # observed points are given, as in the sampler
    err = (pred - targets)[hidden.bool()]
    crps = {
        name: float(quantile_crps(pred[None], targets, hidden, sum_features=s, mean=dm.mean, std=dm.std))
        for name, s in (("crps", False), ("crps_sum", True))
    }
    return {"mse": float(err.pow(2).mean()), "mae": float(err.abs().mean()), **crps}


def baselines(args: argparse.Namespace, task: str, dm: ETTDataModule) -> dict[str, dict[str, float]]:
    batches = test_batches(dm, build_module(args, task, "spec", "none"))
    if task == "forecasting":
        predictors = forecast_predictors(dm)
        horizon = [(x, c) for x, c in batches]
        return {
            name: score_points([torch.cat([x[:, :INPUT].double(), fn(x).double()], 1) for x, _ in horizon], batches, dm)
            for name, fn in predictors.items()
        }
    predictors = imputation_predictors(dm, args.missing_ratio)
    return {name: score_points([fn(x, c) for x, c in batches], batches, dm) for name, fn in predictors.items()}


# ------------------------------------------------------------------ one run


class CosineLR(pl.Callback):
    """Sets Adam's learning rate to lr·(1 + cos(π·step/steps))/2 before every step (a schedule of this script only)."""

    def __init__(self, lr: float, steps: int) -> None:
        self.lr, self.steps = lr, steps

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        lr = self.lr * (1 + math.cos(math.pi * min(trainer.global_step, self.steps) / self.steps)) / 2
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr


def run_one(args: argparse.Namespace, task: str, arm: tuple[str, str, str], seed: int, dm: ETTDataModule) -> dict:
    layout, variant, bounds = arm
    pl.seed_everything(seed, verbose=False)
    module = build_module(args, task, layout, bounds, variant)
    callbacks = [CosineLR(args.lr, args.steps)] if args.lr_schedule == "cosine" else []
    trainer = quiet_trainer(max_steps=args.steps, limit_val_batches=0, callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(module, dm)
    fit_s = time.perf_counter() - start
    torch.manual_seed(seed)
    start = time.perf_counter()
    (metrics,) = trainer.test(module, dm, verbose=False)
    test_s = time.perf_counter() - start
    return {
        "task": task, "layout": layout, "variant": variant, "bounds": bounds, "seed": seed,
        "options": {**LAYOUTS[layout], **VARIANTS[variant]},
        "params": sum(p.numel() for p in module.model.parameters()), "fit_s": fit_s, "test_s": test_s,
        "split": args.eval_split, **{k.removeprefix("test_"): v for k, v in metrics.items()},
    }  # fmt: skip


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    out = Path(args.out)
    results: dict[str, Any] = {"baselines": {}, "runs": []}
    settings = {"settings": vars(args), "metric_spaces": {"mse/mae": "normalised", "crps/crps_sum": "de-normalised"}}
    for task in args.tasks:
        dm = build_data(args, task)
        results["baselines"][task] = {"split": args.eval_split, **baselines(args, task, dm)}
        for name, m in results["baselines"][task].items():
            if name == "split":
                continue
            print(f"{task} baseline {name}: " + " ".join(f"{k}={v:.4f}" for k, v in m.items()), flush=True)
        for seed in args.seeds:
            for name, bounds in itertools.product(args.arms, args.bounds):
                arm = (*name.split("/"), bounds)
                run = run_one(args, task, arm, seed, dm)  # type: ignore[arg-type]
                results["runs"].append(run)
                write_report(out, "adaln_learning_check", torch.get_num_threads(), settings, **results)
                shown = " ".join(f"{m}={run[m]:.4f}" for m in ("mse", "mae", "crps", "crps_sum"))
                print(f"{task} {' '.join(arm)} seed={seed}: {shown} windows={run['windows']:.0f} "
                      f"fit={run['fit_s']:.0f}s test={run['test_s']:.0f}s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
