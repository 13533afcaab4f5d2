"""DP-aware AdaLN-Zero on ETTh1: non-private, DP-vanilla and DP-aware quality, gradient tails, simple baselines.

Every arm trains the same TimeSeriesDiT (same size, optimizer, batch, steps and seeds); the
DP arms share σ, C, q and the number of steps, hence ε. The "aware" arms bound the
condition (c_max) and the modulation (γ_max, β_max, α_max); the "vanilla" arms do not.

    OMP_NUM_THREADS=1 python benchmarks/dp_aware_adaln.py                  # the tables in docs/dp_aware_adaln.md
    OMP_NUM_THREADS=1 python benchmarks/dp_aware_adaln.py --seeds 0 --tasks forecasting --arms dp_vanilla dp_aware

Results go to ``--out`` (JSON, rewritten after every run, so a stopped sweep keeps what it
measured), figures to ``--figures``. Metrics are in the normalised space (train-split
z-scores, TSLib's convention), on the hidden points only, on an evenly spaced subset of
the test windows (``--test-windows``). The gradient statistics are computed from training
or validation data and are NOT differentially private (diagnostics only).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from _harness import provenance, quiet_trainer
from _outputs import default_figures, default_result
from torch import Tensor
from torch.func import functional_call, grad, vmap

import dplightning
from dplightning.callbacks import ClippingHistogram, GradientTailStats
from dplightning.data import ETTDataModule
from dplightning.models import TimeSeriesDiT
from dplightning.models.dit_ts import CONDITIONING_PATTERNS
from dplightning.tasks import DPTimeSeriesDiffusion
from dplightning.tasks.timeseries_diffusion import masked_mse_per_example

ARMS = {  # name -> (DP-SGD, bounded conditioning)
    "nonprivate_vanilla": (False, False),
    "nonprivate_aware": (False, True),
    "dp_vanilla": (True, False),
    "dp_aware": (True, True),
}
METRICS = ("mse", "rmse", "mae", "crps", "crps_sum")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="../shared/data/ett/ETTh1.csv")
    p.add_argument("--tasks", nargs="+", default=["forecasting", "imputation"])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of every run")
    p.add_argument("--batch-size", type=int, default=256, help="expected batch (Poisson rate q = B / N under DP)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (all arms)")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier of the DP arms")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping bound C of the DP arms")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=8, help="time steps per token")
    p.add_argument(
        "--clip-denoised",
        type=float,
        default=5.0,
        help="second evaluation with the sampler's x0 estimate clamped to [-c, c] (the first never clamps)",
    )
    p.add_argument("--c-max", type=float, default=None, help="default: sqrt(hidden)")
    p.add_argument("--mod-max", type=float, default=1.0, help="gamma_max = beta_max = alpha_max")
    p.add_argument("--bound-mode", default="soft", choices=["soft", "hard"])
    p.add_argument("--missing-ratio", type=float, default=0.25, help="imputation: share of test points hidden")
    p.add_argument("--test-windows", type=int, default=32)
    p.add_argument("--samples", type=int, default=16, help="samples per test window")
    p.add_argument("--probe-windows", type=int, default=64, help="validation windows for the probe diagnostics")
    p.add_argument("--out", default=str(default_result("dp_aware_adaln_cpu.json")))
    p.add_argument("--figures", default=str(default_figures()))
    return p.parse_args()


def build_data(args: argparse.Namespace, task: str) -> ETTDataModule:
    dm = ETTDataModule(args.data, task=task, input_len=96, horizon=96, batch_size=args.batch_size,  # type: ignore[arg-type]
                       max_val_windows=256, max_test_windows=args.test_windows, eval_batch_size=32)  # fmt: skip
    dm.setup()
    return dm


def build_module(args: argparse.Namespace, task: str, aware: bool) -> DPTimeSeriesDiffusion:
    c_max = args.c_max or math.sqrt(args.hidden)
    bounds = dict(c_max=c_max, gamma_max=args.mod_max, beta_max=args.mod_max, alpha_max=args.mod_max) if aware else {}
    net = TimeSeriesDiT(hidden=args.hidden, depth=args.depth, heads=args.heads, mlp_ratio=2.0,
                        patch_size=args.patch_size, bound_mode=args.bound_mode, **bounds)  # fmt: skip
    return DPTimeSeriesDiffusion(
        net, task=task, horizon=96, eval_missing_ratio=args.missing_ratio, n_samples=args.samples,
  # type: ignore[arg-type]
        optimizer=lambda params: torch.optim.Adam(params, lr=args.lr),
    )  # fmt: skip


# ------------------------------------------------------------------ probe diagnostics (torch.func, not private)


def probe_norms(module: DPTimeSeriesDiffusion, dm: ETTDataModule, n: int) -> dict[str, np.ndarray]:
    """Per-example gradient norms (cond, rest, all) and clipping inputs on ``n`` validation windows, fixed t and ε."""
    g = torch.Generator().manual_seed(123)
    x = torch.stack([dm.val_set[i] for i in torch.linspace(0, len(dm.val_set) - 1, n).long().tolist()])
    observed = torch.ones_like(x)
    cond = module.conditioning_mask(observed, g)
    t, eps = torch.randint(0, module.schedule.steps, (n,), generator=g), torch.randn(x.shape, generator=g)
    net = module.model
    params = {k: p.detach() for k, p in net.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor, ci: Tensor, ti: Tensor, ei: Tensor) -> Tensor:
        xi, ci, ti, ei = xi[None], ci[None], ti[None], ei[None]
        x_t = module.schedule.noise(xi, ti, ei)
        out = functional_call(net, p, ((1 - ci) * x_t, ci * xi, ci, ti))
        return masked_mse_per_example(ei, out, 1 - ci).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's loop fallback for CPU attention
        grads = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))(params, x, cond, t, eps)
    is_cond = {k: any(fnmatch.fnmatch(k, pat) for pat in CONDITIONING_PATTERNS) for k in grads}
    sq = {k: v.flatten(1).pow(2).sum(1).double() for k, v in grads.items()}
    cond_sq = sum(v for k, v in sq.items() if is_cond[k])
    rest_sq = sum(v for k, v in sq.items() if not is_cond[k])
    flat = torch.cat([v.flatten(1).double() for v in grads.values()], dim=1)
    return {"cond": cond_sq.sqrt().numpy(), "rest": rest_sq.sqrt().numpy(), "all": (cond_sq + rest_sq).sqrt().numpy(),
            "flat": flat.numpy(), "hidden_share": (1 - cond).flatten(1).mean(1).numpy(),
            "context_rms": (cond * x).flatten(1).pow(2).mean(1).sqrt().numpy()}  # fmt: skip


def summarize_probe(norms: dict[str, np.ndarray], clip: float) -> dict[str, Any]:
    """Quantiles per group, clip fraction, clipping bias and what the top 5% of examples look like."""
    out: dict[str, Any] = {}
    for group in ("cond", "rest", "all"):
        v = norms[group]
        out[group] = {"p50": float(np.median(v)), "p99": float(np.quantile(v, 0.99)), "max": float(v.max()),
                      "p99_over_p50": float(np.quantile(v, 0.99) / np.median(v))}  # fmt: skip
    g, total = norms["flat"], norms["all"]
    factors = np.minimum(1.0, clip / (total + 1e-6))
    mean_g, mean_clipped = g.mean(0), (g * factors[:, None]).mean(0)
    out["clip_fraction"] = float((total > clip).mean())
    out["clip_bias"] = float(np.linalg.norm(mean_g - mean_clipped) / np.linalg.norm(mean_g))
    out["clip_cosine"] = float(mean_g @ mean_clipped / (np.linalg.norm(mean_g) * np.linalg.norm(mean_clipped)))
    out["cond_share"] = float(np.mean(norms["cond"] ** 2 / total**2))
    top = total >= np.quantile(total, 0.95)
    for key in ("hidden_share", "context_rms"):
        out[f"{key}_top5"], out[f"{key}_all"] = float(norms[key][top].mean()), float(norms[key].mean())
    return out


# ------------------------------------------------------------------ one run


def run_one(args: argparse.Namespace, task: str, arm: str, seed: int, dm: ETTDataModule) -> dict[str, Any]:
    private, aware = ARMS[arm]
    pl.seed_everything(seed, verbose=False)
    module = build_module(args, task, aware)
    callbacks: list[pl.Callback] = []
    strategy: Any = "auto"
    if private:
        strategy = dplightning.DPStrategy(noise_multiplier=args.sigma, max_grad_norm=args.max_grad_norm)
        every = max(args.steps // 5, 1)
        tails = GradientTailStats(groups={"cond": CONDITIONING_PATTERNS}, every_n_steps=every, save_figure=False)
        clipping = ClippingHistogram(every_n_steps=every, save_figure=False)
        callbacks = [tails, clipping]
    probe_before = summarize_probe(probe_norms(module, dm, args.probe_windows), args.max_grad_norm)
    trainer = quiet_trainer(strategy=strategy, max_steps=args.steps, limit_val_batches=0, callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(module, dm)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    torch.manual_seed(seed)
    (metrics,) = trainer.test(module, dm, verbose=False)  # CSDI's sampler
    test_s = time.perf_counter() - start
    module.clip_denoised = args.clip_denoised
    torch.manual_seed(seed)
    (clamped,) = trainer.test(module, dm, verbose=False)
    result: dict[str, Any] = {"task": task, "arm": arm, "seed": seed, "fit_s": fit_s, "test_s": test_s,
                              **{m: metrics[f"test_{m}"] for m in METRICS},
                              "clamped": {m: clamped[f"test_{m}"] for m in METRICS}}  # fmt: skip
    result["probe_init"] = probe_before
    result["probe_final"] = summarize_probe(probe_norms(module, dm, args.probe_windows), args.max_grad_norm)
    if private:
        result["epsilon"], result["delta"] = trainer.strategy.get_epsilon(), trainer.strategy.dp_state.delta
        result["sample_rate"] = trainer.strategy.dp_state.sample_rate
        result["tails"] = [{"step": r.step, "examples": r.examples, "stats": r.stats} for r in tails.history]
        result["clip_fraction"] = [{"step": r.step, "value": r.clip_fraction} for r in clipping.history]
    if seed == args.seeds[0]:
        result["example"] = example_forecast(module, dm)
    return result


def example_forecast(module: DPTimeSeriesDiffusion, dm: ETTDataModule, window: int = 0, samples: int = 64) -> dict:
    """Samples of one test window's OT channel (the last column) for the forecast plot."""
    torch.manual_seed(0)
    x = dm.test_set[window].unsqueeze(0)
    cond = module.evaluation_mask(torch.ones_like(x), 0)[:1]
    s = module.sample(x, cond, n_samples=samples)[:, 0, :, -1]
    q = torch.quantile(s, torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95]), dim=0)
    return {"truth": x[0, :, -1].tolist(), "quantiles": q.tolist(), "cond": cond[0, :, -1].tolist()}


# ------------------------------------------------------------------ baselines


def forecast_baselines(dm: ETTDataModule) -> dict[str, dict[str, float]]:
    """Least squares (one 96 -> 96 linear map with bias, shared by the channels) and repeat-last."""

    def windows(split: Tensor) -> tuple[Tensor, Tensor]:
        w = split.unfold(0, 192, 1).permute(0, 2, 1)  # [N, 192, K]
        return w[:, :96].transpose(1, 2).reshape(-1, 96), w[:, 96:].transpose(1, 2).reshape(-1, 96)

    x, y = windows(dm.splits["train"])
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    weights = torch.linalg.lstsq(design, y).solution
    out = {}
    for name, split in (("full", dm.splits["test"]), ("subset", None)):
        if split is None:
            w = torch.stack([dm.test_set[i] for i in range(len(dm.test_set))]).double()
            tx, ty = w[:, :96].transpose(1, 2).reshape(-1, 96), w[:, 96:].transpose(1, 2).reshape(-1, 96)
        else:
            tx, ty = windows(split)
        for method, pred in (("linear_lstsq", torch.cat([tx, torch.ones(len(tx), 1, dtype=tx.dtype)], 1) @ weights),
                             ("repeat_last", tx[:, -1:].expand_as(ty))):  # fmt: skip
            err = pred - ty
            out[f"{method}/{name}"] = {"mse": float(err.pow(2).mean()), "mae": float(err.abs().mean())}
    return out


def imputation_baselines(dm: ETTDataModule, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Linear interpolation in time per channel and train-mean (0) imputation, on the module's test masks."""
    module = build_module(args, "imputation", aware=False)
    sq = {"linear_interp": [], "mean": []}
    ab = {"linear_interp": [], "mean": []}
    for batch_idx, x in enumerate(dm.test_dataloader()):
        cond = module.evaluation_mask(torch.ones_like(x), batch_idx)
        hidden = cond == 0
        interp = torch.from_numpy(
            np.stack(
                [
                    [np.interp(np.arange(96), np.flatnonzero(c[:, k]), w[c[:, k] > 0, k]) for k in range(x.shape[2])]
                    for w, c in zip(x.numpy(), cond.numpy())
                ]
            )
        )
        interp = interp.transpose(1, 2).float()  # fmt: skip
        for method, pred in (("linear_interp", interp), ("mean", torch.zeros_like(x))):
            err = (pred - x)[hidden]
            sq[method].append(err.pow(2))
            ab[method].append(err.abs())
    return {f"{m}/subset": {"mse": float(torch.cat(sq[m]).mean()), "mae": float(torch.cat(ab[m]).mean())} for m in sq}


# ------------------------------------------------------------------ main


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    out = Path(args.out)
    report: dict[str, Any] = {"args": vars(args), "runs": [], "baselines": {}, **provenance(torch.get_num_threads())}
    for task in args.tasks:
        dm = build_data(args, task)
        report["baselines"][task] = forecast_baselines(dm) if task == "forecasting" else imputation_baselines(dm, args)
        for seed in args.seeds:
            for arm in args.arms:
                result = run_one(args, task, arm, seed, dm)
                report["runs"].append(result)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1))
                shown = " ".join(f"{m}={result[m]:.4f}/{result['clamped'][m]:.4f}" for m in METRICS)
                print(f"{task} {arm} seed={seed}: {shown} eps={result.get('epsilon', math.inf):.3g} "
                      f"fit={result['fit_s']:.0f}s test={result['test_s']:.0f}s", flush=True)  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
