"""DP-SGD, DP-Adam, DP-Muon and DP-MuonBC on E2E at the same ε: eval NLL over steps, BLEU, ROUGE-L.

Each arm is the CPU config ``configs/finetune/e2e_gpt2_small_cpu.yaml`` plus one overlay of
``configs/muon/`` that changes ``optimizer.class_path`` (and its arguments) only; the same
ε, δ, C, expected batch and steps for every arm, σ calibrated by the strategy. The bundled E2E
file is split by meaning representation (train / val / test); the NLL curve is on the val part,
the final NLL, BLEU and ROUGE-L on the test part (greedy decoding, one output per MR, all its
references), both held out from training. Every run is a fresh process.

    OMP_NUM_THREADS=1 python benchmarks/muon_e2e.py --seeds 0 1 \\
        --out benchmarks/results/muon_e2e_cpu.json --figure docs/figures/dp_muon_e2e_nll.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import provenance

BASE = "configs/finetune/e2e_gpt2_small_cpu.yaml"
ARMS = {"DP-SGD": "dpsgd", "DP-Adam": "dpadam", "DP-Muon": "dpmuon", "DP-MuonBC": "dpmuonbc"}
# Not run by default: spec V4 arm 5 (BC on every matrix), and a 5x larger AdamW lr (DP-Adam's, and that of
# DP-Muon's non-matrix parameters), with Muon's default lr and a quarter of it.
_OPT = "--model.init_args.optimizer.init_args"
EXTRA_ARMS = {
    "DP-MuonBC no guard": "dpmuonbc",
    "DP-Adam lr 0.01": "dpadam",
    "DP-Muon adam_lr 0.01": "dpmuon",
    "DP-Muon lr 0.005 adam_lr 0.01": "dpmuon",
}
# A null cannot be given as a command-line override of a callable's argument (jsonargparse), hence a YAML overlay.
NO_GUARD_YAML = "model:\n  init_args:\n    optimizer:\n      init_args:\n        max_noise_ratio: null\n"
EXTRA_ARGS = {
    "DP-MuonBC no guard": ["--config", "{root}/no_guard.yaml"],
    "DP-Adam lr 0.01": [f"{_OPT}.lr=0.01"],
    "DP-Muon adam_lr 0.01": [f"{_OPT}.adam_lr=0.01"],
    "DP-Muon lr 0.005 adam_lr 0.01": [f"{_OPT}.adam_lr=0.01", f"{_OPT}.lr=0.005"],
}
ALL_ARMS = {**ARMS, **EXTRA_ARMS}


class Curve(pl.Callback):
    """Eval NLL at every validation, and DP-MuonBC's guard statistics at every step (public values)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []
        self.ratios: list[float] = []
        self.corrected: list[bool] = []

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        m = trainer.callback_metrics
        if "val_token_loss" in m and not trainer.sanity_checking:
            self.points.append(
                {
                    "step": trainer.global_step,
                    "token_nll": float(m["val_token_loss"]),
                    "example_nll": float(m["val_loss"]),
                }
            )

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        opt = trainer.optimizers[0]
        for ratio, corrected in getattr(opt, "last_noise_ratios", {}).values():
            self.ratios.append(ratio)
            self.corrected.append(corrected)
        if hasattr(opt, "last_noise_ratios"):
            opt.last_noise_ratios = {}


def generate_and_score(module: Any, datamodule: Any) -> dict[str, float]:
    """Greedy outputs for each test MR; corpus BLEU-4 and ROUGE-L F (best over the MR's references)."""
    from torchmetrics.text import BLEUScore, ROUGEScore

    refs: dict[str, list[str]] = {}
    for e in datamodule.read("test"):
        refs.setdefault(e.prompt, []).append(e.completion.strip())
    prompts = list(refs)
    tok = datamodule.tokenizer
    outputs: list[str] = []
    module.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts[i : i + 64]]
            width = max(map(len, ids))
            pad = tok.pad_token_id
            input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
            new = module.generate(input_ids, mask)
            outputs += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
    targets = [refs[p] for p in prompts]
    bleu = BLEUScore(n_gram=4)(outputs, targets).item()
    rouge = ROUGEScore(rouge_keys="rougeL", accumulate="best")(outputs, targets)["rougeL_fmeasure"].item()
    return {"bleu": 100 * bleu, "rouge_l": 100 * rouge, "mrs": len(prompts), "example": outputs[0]}


def run_one(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from dplightning.cli import build_cli

    torch.set_num_threads(1)
    root = Path(args.root)
    (root / "no_guard.yaml").write_text(NO_GUARD_YAML)
    cli = build_cli(
        run=False,
        args=[
            "--config",
            BASE,
            "--config",
            f"configs/muon/e2e_gpt2_small_cpu_{ALL_ARMS[arm]}.yaml",
            f"--seed_everything={seed}",
            f"--trainer.max_steps={args.steps}",
            f"--trainer.val_check_interval={args.eval_every}",
            "--trainer.check_val_every_n_epoch=null",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[]",  # the base config's ModelCheckpoint contradicts the line above
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.inference_mode=false",  # the step-0 validate would leave inference tensors in the metrics
            f"--trainer.default_root_dir={root / f'{_slug(arm)}_seed{seed}'}",
            f"--data.init_args.batch_size={args.batch_size}",
            f"--data.init_args.tokenizer_dir={root / 'tokenizer'}",
            *[a.format(root=root) for a in EXTRA_ARGS.get(arm, [])],
        ],
    )
    curve = Curve()
    cli.trainer.callbacks.append(curve)
    wall, cpu = time.perf_counter(), time.process_time()
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)  # step 0
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    fit_wall, fit_cpu = time.perf_counter() - wall, time.process_time() - cpu
    strategy = cli.trainer.strategy
    state = strategy.dp_state
    cli.trainer.callbacks.remove(curve)  # the test pass below is not a point of the val curve
    cli.datamodule.setup("test")
    test = cli.trainer.validate(cli.model, dataloaders=cli.datamodule.test_dataloader(), verbose=False)[0]
    scores = generate_and_score(cli.model, cli.datamodule)
    n_ratios = len(curve.ratios)
    return {
        "arm": arm,
        "seed": seed,
        "steps": state.steps,
        "epsilon": strategy.get_epsilon(),
        "delta": state.delta,
        "sigma": state.noise_multiplier,
        "sample_rate": state.sample_rate,
        "curve": curve.points,
        "test_token_nll": test["val_token_loss"],
        "test_example_nll": test["val_loss"],
        **scores,
        "noise_ratio_median": statistics.median(curve.ratios) if n_ratios else None,
        "noise_ratio_quartiles": statistics.quantiles(curve.ratios, n=4) if n_ratios > 1 else None,
        "corrected_fraction": sum(curve.corrected) / n_ratios if n_ratios else None,
        "fit_wall_s": fit_wall,
        "fit_cpu_s": fit_cpu,
    }


def _slug(arm: str) -> str:
    suffix = {
        "DP-MuonBC no guard": "_noguard",
        "DP-Adam lr 0.01": "_lr0.01",
        "DP-Muon adam_lr 0.01": "_adam_lr0.01",
        "DP-Muon lr 0.005 adam_lr 0.01": "_adam_lr0.01_lr0.005",
    }
    return ALL_ARMS[arm] + suffix.get(arm, "")


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for arm in ALL_ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        row: dict[str, Any] = {"seeds": [r["seed"] for r in mine], "epsilon": [r["epsilon"] for r in mine]}
        for key in ("test_token_nll", "bleu", "rouge_l", "fit_cpu_s"):
            values = [r[key] for r in mine]
            row[key] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
        table[arm] = row
    return table


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in ALL_ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        steps = [p["step"] for p in mine[0]["curve"]]
        values = torch.tensor([[p["token_nll"] for p in r["curve"]] for r in mine])
        ax.plot(steps, values.mean(0), label=f"{arm} ({len(mine)} seeds)")
        ax.fill_between(steps, values.min(0).values, values.max(0).values, alpha=0.2)
    eps = statistics.mean(r["epsilon"] for r in runs)
    ax.set(xlabel="optimizer step", ylabel="eval NLL per token (val split)", title=f"small GPT-2 on E2E, ε = {eps:.2g}")
    ax.set_ylim(top=min(ax.get_ylim()[1], 8.0))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ALL_ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--root", default="lightning_logs/muon_e2e")
    parser.add_argument("--reuse", action="store_true", help="load the runs already in --root instead of rerunning")
    parser.add_argument("--out", default=None)
    parser.add_argument("--figure", default=None)
    parser.add_argument("--one", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--one-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run_one(args.one[0], int(args.one[1]), args)
        Path(args.one_out).write_text(json.dumps(result))
        return
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:  # seeds outermost: a partial result still compares every arm
        for arm in args.arms:
            part = Path(args.root) / f"{_slug(arm)}_seed{seed}.json"
            part.parent.mkdir(parents=True, exist_ok=True)
            if not (args.reuse and part.exists()):
                cmd = [sys.executable, __file__, "--one", arm, str(seed), "--one-out", str(part)]
                cmd += ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
                cmd += ["--eval-every", str(args.eval_every), "--root", args.root]
                subprocess.run(cmd, check=True)
            runs.append(json.loads(part.read_text()))
            r = runs[-1]
            print(
                f"{arm:10s} seed {seed}: ε = {r['epsilon']:.3g} (σ = {r['sigma']:.3g}), "
                f"test NLL {r['test_token_nll']:.4f}, "
                f"BLEU {r['bleu']:.2f}, ROUGE-L {r['rouge_l']:.2f}, r̂ median {r['noise_ratio_median']}, "
                f"BC applied {r['corrected_fraction']}, fit {r['fit_cpu_s']:.0f} s CPU / {r['fit_wall_s']:.0f} s wall",
                flush=True,
            )
            summary = summarise(runs)
            if args.out:
                record = {"args": vars(args), "summary": summary, "runs": runs, **provenance(1)}
                Path(args.out).write_text(json.dumps(record, indent=1))
            if args.figure:
                plot(runs, args.figure)
    print("\narm         test NLL/token      BLEU            ROUGE-L         fit CPU s")
    for arm, row in summarise(runs).items():
        cells = [
            f"{row[k][0]:.4f} ± {row[k][1]:.4f}" if k == "test_token_nll" else f"{row[k][0]:.2f} ± {row[k][1]:.2f}"
            for k in ("test_token_nll", "bleu", "rouge_l", "fit_cpu_s")
        ]
        print(f"{arm:10s}  " + "  ".join(f"{c:16s}" for c in cells))


if __name__ == "__main__":
    main()
