"""Tables and figures from ``benchmarks/dp_aware_adaln.py``'s JSON (no training).

python benchmarks/dp_aware_adaln_report.py [RESULTS_JSON] [FIGURES]

RESULTS_JSON defaults to the committed benchmarks/results/dp_aware_adaln_cpu.json, FIGURES to
outputs/figures (pass docs/figures to replace the committed figures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib
from _outputs import default_figures

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ARM_NAMES = {"nonprivate_vanilla": "non-private, vanilla", "nonprivate_aware": "non-private, DP-aware bounds",
             "dp_vanilla": "DP-vanilla", "dp_aware": "DP-aware"}  # fmt: skip
METRICS = ("mse", "rmse", "mae", "crps", "crps_sum")


def spread(values: list[float]) -> str:
    """``mean ± std (min–max)`` over seeds."""
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.3f} ({v.min():.3f}–{v.max():.3f})"


def runs_of(report: dict[str, Any], task: str, arm: str) -> list[dict[str, Any]]:
    return [r for r in report["runs"] if r["task"] == task and r["arm"] == arm]


def quality_table(report: dict[str, Any], task: str, clamped: bool) -> str:
    lines = ["| arm | ε (δ) | seeds | MSE | RMSE | MAE | CRPS | CRPS-sum |", "|---|---|---|---|---|---|---|---|"]
    for arm, name in ARM_NAMES.items():
        runs = runs_of(report, task, arm)
        if not runs:
            continue
        eps = f"{runs[0]['epsilon']:.2f} ({runs[0]['delta']:.2g})" if "epsilon" in runs[0] else "∞"
        cells = [spread([(r["clamped"] if clamped else r)[m] for r in runs]) for m in METRICS]
        lines.append(f"| {name} | {eps} | {len(runs)} | " + " | ".join(cells) + " |")
    for method, values in report["baselines"].get(task, {}).items():
        lines.append(f"| baseline: {method} | — | — | {values['mse']:.3f} | {values['mse'] ** 0.5:.3f} | "
                     f"{values['mae']:.3f} | — | — |")  # fmt: skip
    return "\n".join(lines)


def gradient_table(report: dict[str, Any], task: str) -> str:
    head = ("| arm | probe | cond p50 | cond p99 | cond max | rest p99 | cond share | clipped | clip bias | "
            "cos(mean g, mean clip g) | hidden share top 5% / all | context RMS top 5% / all |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for arm in ("dp_vanilla", "dp_aware", "nonprivate_vanilla", "nonprivate_aware"):
        for when in ("probe_init", "probe_final"):
            runs = runs_of(report, task, arm)
            if not runs:
                continue
            p = [r[when] for r in runs]

            def mean(f: Any, p: list[dict[str, Any]] = p) -> str:
                return f"{np.mean([f(x) for x in p]):.3g}"

            lines.append(
                f"| {ARM_NAMES[arm]} | {when.removeprefix('probe_')} | {mean(lambda x: x['cond']['p50'])} | "
                f"{mean(lambda x: x['cond']['p99'])} | {mean(lambda x: x['cond']['max'])} | "
                f"{mean(lambda x: x['rest']['p99'])} | {mean(lambda x: x['cond_share'])} | "
                f"{mean(lambda x: x['clip_fraction'])} | {mean(lambda x: x['clip_bias'])} | "
                f"{mean(lambda x: x['clip_cosine'])} | "
                f"{mean(lambda x: x['hidden_share_top5'])} / {mean(lambda x: x['hidden_share_all'])} | "
                f"{mean(lambda x: x['context_rms_top5'])} / {mean(lambda x: x['context_rms_all'])} |"
            )
    return "\n".join(lines)


def tail_figure(report: dict[str, Any], path: Path) -> None:
    """GradientTailStats (training batches, NOT private): p50 and p99 of ‖g_cond‖ and ‖g_rest‖ over training."""
    tasks = sorted({r["task"] for r in report["runs"]})
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.4 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        for col, group in enumerate(("cond", "rest")):
            ax = axes[row][col]
            for arm, color in (("dp_vanilla", "tab:red"), ("dp_aware", "tab:blue")):
                runs = runs_of(report, task, arm)
                if not runs:
                    continue
                steps = [w["step"] for w in runs[0]["tails"]]
                for stat, style in (("p50", ":"), ("p99", "-"), ("max", "--")):
                    v = np.array([[w["stats"][group][stat] for w in r["tails"]] for r in runs])
                    ax.plot(steps, v.mean(0), style, color=color, label=f"{ARM_NAMES[arm]} {stat}")
            ax.set_yscale("log")
            ax.set_title(f"{task}: ‖g_{group}‖ per example")
            ax.set_xlabel("optimizer step")
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.suptitle("Per-example gradient norms, conditioning path vs rest (training data: NOT private)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def forecast_figure(report: dict[str, Any], path: Path) -> None:
    """The first test window's OT channel: truth, median and 50% / 90% bands per arm (seed of the first run)."""
    arms = [a for a in ("nonprivate_vanilla", "dp_vanilla", "dp_aware") if runs_of(report, "forecasting", a)]
    fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms), 3.2), squeeze=False, sharey=True)
    for ax, arm in zip(axes[0], arms):
        ex = runs_of(report, "forecasting", arm)[0]["example"]
        truth, (q05, q25, q50, q75, q95) = np.array(ex["truth"]), np.array(ex["quantiles"])
        t = np.arange(len(truth))
        ax.plot(t, truth, color="black", lw=1, label="truth (OT)")
        ax.fill_between(t[96:], q05[96:], q95[96:], color="tab:blue", alpha=0.2, label="5–95%")
        ax.fill_between(t[96:], q25[96:], q75[96:], color="tab:blue", alpha=0.4, label="25–75%")
        ax.plot(t[96:], q50[96:], color="tab:blue", lw=1, label="median")
        ax.axvline(96, color="gray", lw=0.5)
        ax.set_title(ARM_NAMES[arm], fontsize=9)
        ax.set_xlabel("hour in window")
    axes[0][0].set_ylabel("OT (train z-score)")
    fig.suptitle("First test window, 64 samples, sampler with x̂0 clamped to ±5", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/dp_aware_adaln_cpu.json")
    figures = Path(sys.argv[2]) if len(sys.argv) > 2 else default_figures()
    report = json.loads(source.read_text())
    figures.mkdir(parents=True, exist_ok=True)
    for task in sorted({r["task"] for r in report["runs"]}):
        for clamped in (False, True):
            sampler = "x̂0 clamped to ±5" if clamped else "CSDI sampler (no clamp)"
            print(f"\n### {task}, {sampler}\n\n{quality_table(report, task, clamped)}")
        print(f"\n### {task}, per-example gradients on the probe windows\n\n{gradient_table(report, task)}")
    fit = [r["fit_s"] for r in report["runs"]]
    print(f"\nfit time per run: {np.mean(fit):.0f} s (min {min(fit):.0f}, max {max(fit):.0f}); runs: {len(fit)}")
    tail_figure(report, figures / "dp_aware_adaln_tails.png")
    if runs_of(report, "forecasting", "dp_aware") or runs_of(report, "forecasting", "nonprivate_vanilla"):
        forecast_figure(report, figures / "dp_aware_adaln_forecast.png")


if __name__ == "__main__":
    main()
