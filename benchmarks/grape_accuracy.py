"""Digits test accuracy of a Hugging Face ViT: DP-Adam vs DP-GRAPE at the same ε, several seeds.

Every arm runs ``configs/grape/vit_digits_dp_adam.yaml`` or ``vit_digits_dp_grape.yaml`` (identical
but for ``optimizer.class_path``) through the CLI with the same epochs, σ calibrated for the
same ε, and evaluates the fitted weights on the 359 held-out test images. The model seed
(``seed_everything``) is varied; DP noise and Poisson sampling draw from OS entropy.

    OMP_NUM_THREADS=1 python benchmarks/grape_accuracy.py --seeds 0 1 2 --epochs 40
    OMP_NUM_THREADS=1 python benchmarks/grape_accuracy.py --arms dp_grape --lr 0.008   # another lr

Results are appended to ``benchmarks/results/grape_accuracy_cpu.json`` after each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _harness import command, provenance
from _outputs import default_result

from dplightning.cli import build_cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "dp_adam": ROOT / "configs" / "grape" / "vit_digits_dp_adam.yaml",
    "dp_grape": ROOT / "configs" / "grape" / "vit_digits_dp_grape.yaml",
}


def run_arm(
    name: str, seed: int, epochs: int, epsilon: float, lr: float | None, rank: int | None, grape: dict[str, str]
) -> dict:
    args = ["fit", "--config", str(CONFIGS[name]), f"--seed_everything={seed}", f"--trainer.max_epochs={epochs}",
            "--trainer.enable_progress_bar=false", "--test_after_fit=false",
            f"--trainer.strategy.init_args.target_epsilon={epsilon}"]  # fmt: skip
    if lr is not None:
        args.append(f"--model.init_args.optimizer.init_args.lr={lr}")
    if rank is not None and name == "dp_grape":
        args.append(f"--model.init_args.optimizer.init_args.rank={rank}")
    if name == "dp_grape":
        args += [f"--model.init_args.optimizer.init_args.{k}={v}" for k, v in grape.items()]
    start = time.perf_counter()
    cli = build_cli(args)
    fit_s = time.perf_counter() - start
    metrics = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    strategy = cli.trainer.strategy
    state = strategy.dp_state
    opt = cli.trainer.optimizers[0]
    return {
        "arm": name, "seed": seed, "test_acc": float(metrics["test_acc"]), "epsilon": strategy.get_epsilon(),
        "delta": state.delta, "noise_multiplier": state.noise_multiplier, "steps": state.steps,
        "lr": opt.param_groups[0]["lr"], "rank": getattr(opt, "rank", None), "fit_seconds": round(fit_s, 1),
        "vit_layers": cli.model.model.model.config.num_hidden_layers,
        "refresh_every": getattr(opt, "refresh_every", None), "projection_std": getattr(opt, "projection_std", None),
        "scale": getattr(opt, "scale", None),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--lr", type=float, default=None, help="override the configs' learning rate")
    parser.add_argument("--rank", type=int, default=None, help="override DP-GRAPE's rank")
    parser.add_argument("--refresh-every", type=int, default=None, help="override DP-GRAPE's T")
    parser.add_argument("--projection-std", default=None, choices=["authors", "jl"], help="override DP-GRAPE's P scale")
    parser.add_argument("--scale", default=None, help="override DP-GRAPE's lift scale (a number or 'rms')")
    parser.add_argument("--out", default=str(default_result("grape_accuracy_cpu.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    fresh = {**provenance(1), "runs": []}
    results = json.loads(out.read_text()) if out.exists() else fresh
    for seed in args.seeds:
        for name in args.arms:
            grape = {"refresh_every": args.refresh_every, "projection_std": args.projection_std, "scale": args.scale}
            grape = {k: str(v) for k, v in grape.items() if v is not None}
            row = run_arm(name, seed, args.epochs, args.epsilon, args.lr, args.rank, grape)
            row["command"] = command()
            results["runs"].append(row)
            out.write_text(json.dumps(results, indent=2) + "\n")  # after every run: nothing lost if stopped
            print(json.dumps(row), flush=True)
    groups: dict[tuple, list[float]] = {}
    for r in results["runs"]:
        settings = (r.get("refresh_every"), r.get("projection_std"), r.get("scale"))
        key = (r["arm"], r["lr"], r["rank"], *settings, r["steps"])
        groups.setdefault(key, []).append(r["test_acc"])
    header = f"{'arm':<10}{'lr':>8}{'rank':>6}{'T':>5}{'P std':>9}{'scale':>6}{'steps':>7}"
    print(f"{header}{'runs':>6}{'mean acc':>10}{'sd':>8}")
    for (arm, lr, rank, t, std, scale, steps), accs in groups.items():
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        mean = statistics.fmean(accs)
        cells = f"{arm:<10}{lr:>8.4g}{rank or '-':>6}{t or '-':>5}{std or '-':>9}{scale or '-':>6}{steps:>7}"
        print(f"{cells}{len(accs):>6}{mean:>10.4f}{sd:>8.4f}")


if __name__ == "__main__":
    main()
