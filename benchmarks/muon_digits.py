"""DP-Muon against DP-Adam and its controls on scikit-learn digits (a Hugging Face ViT, CPU), tuned and paired.

Pre-registered design (fixed before any run; the comparison protocol of ``_protocol.py``):

- **Model and data.** The ViT of ``configs/grape/vit_digits_dp_adam.yaml`` (2 layers, hidden 64,
  patch 2, random init) on the 8x8 digits; 40 epochs (about 200 steps) at expected batch 256
  (Poisson rate q = 256 / 1,258), C = 1, ε = 8 with σ calibrated by the strategy (PRV
  accountant), δ as the strategy configures it (recorded per run). Every run trains on the
  1,258-image train split. ``split="val"`` evaluates on the ``DigitsDataModule``'s 180-image
  validation split (held out of training, never the test images), ``split="test"`` on its
  359 test images. The metric is plain accuracy (fraction of images right; higher is better).
- **Pairing.** Seed ``s`` sets ``seed_everything=s`` (model init) and the strategy's test-only
  ``seed=s``, so every arm sees the same Poisson batches and the same noise seeds; DP-MuonBC's
  probes come from DPMuon's own fixed probe seed. Tuning seed 100; final seeds 0-4.
- **Arms and grids** (the tuned argument and its values; each control changes one thing). Every
  DPMuon arm updates the non-matrix parameters (embeddings, LayerNorms, biases, head) by AdamW
  with adam_lr 0.01 (unless tuned), betas (0.9, 0.999), eps 1e-6 and no weight decay: DP-Adam's
  settings.

  - DP-Adam: ``torch.optim.AdamW`` (eps 1e-6, no weight decay), flat clipping; lr .005 .01 .02.
  - DP-Adam (Muon plan): DPMuon with ``matrix_update="adamw"``: DP-Muon's per-matrix clip plan,
    every parameter updated by AdamW; adam_lr .005 .01 .02.
  - DP-Muon: DPMuon's defaults (Nesterov momentum 0.95, Frobenius normalization, Keller Jordan's
    quintic NS, 5 steps; clip groups: each hidden matrix, the rest one group, equal split of C);
    lr .01 .02 .04.
  - DP-Muon flat: DP-Muon with ``clip_split="flat"`` (one clip group, bound C); lr .01 .02 .04.
  - DP-MuonBC: DP-Muon with ``bias_correction=True`` and ``max_noise_ratio=None`` (no guard: BC on
    every matrix-step); lr .01 .02 .04.
  - DP-Muon paper form: DP-Muon with ``PAPER_FORM`` (heavy ball, max1, taylor2, 5 NS steps;
    ``configs/muon/vit_digits_dpmuon_paper.yaml``; the paper's κ and q are not confirmed). Its
    update is not normalised as Muon's, hence a wider grid: lr .005 .01 .02 .04 .08.

- **Criteria** (stored in the record before the final runs; "A beats B" only when the lower
  90 % paired t-bound of A - B is above 0): DP-Muon beats DP-Adam; DP-Muon beats DP-Adam (Muon
  plan) (the optimizer at the same clip plan); DP-Muon flat beats DP-Adam (the optimizer under
  flat clipping); DP-MuonBC beats DP-Muon; DP-Muon paper form beats DP-Adam.
- **Also recorded per run** (not criteria): for the arms whose matrices get Muon updates, the r̂
  quartiles over every matrix-step of the run and their count (r̂ = τ√(mn)/‖U‖_F, the
  noise-to-signal ratio the BC guard reads), the guard-open fraction (matrix-steps with r̂ <=
  the arm's max_noise_ratio, i.e. where a guarded BC would act; as ``dp_metrics()`` reports it,
  so 1 for the unguarded DP-MuonBC), the same fraction at DPMuon's default guard r̂ <= 0.5 (for
  every such arm) and for DP-MuonBC the fraction of matrix-steps corrected; for every arm ε, δ,
  σ, the steps, the mean Poisson batch (equal across arms at one seed: a check of the pairing)
  and the fit seconds.

The arms differ from their config files only by a YAML overlay of the optimizer's arguments
(jsonargparse takes no ``null`` on the command line, and DP-MuonBC's ``max_noise_ratio=None`` is
one). About an hour on one CPU thread (20 selection + 30 final runs of about a minute):

    OMP_NUM_THREADS=1 python benchmarks/muon_digits.py --workers 2 \\
        --out benchmarks/results/muon_digits_cpu.json --figures docs/figures
    OMP_NUM_THREADS=1 python benchmarks/muon_digits.py --smoke   # a minute: see experiment()

The record resumes: rerunning the command skips the runs it already holds.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _configs import config_digest, optimizer_overlay
from _protocol import Arm, Criterion, Experiment, run_experiment
from grape_digits import memoised_calibration
from torch.utils.data import DataLoader, Dataset

from dplightning.cli import build_cli
from dplightning.optim import DPMuon

ROOT = Path(__file__).resolve().parents[1]
DP_ADAM_CONFIG = "configs/grape/vit_digits_dp_adam.yaml"
DP_MUON_CONFIG = "configs/muon/vit_digits_dpmuon.yaml"
PAPER_CONFIG = "configs/muon/vit_digits_dpmuon_paper.yaml"
NAME = "muon_digits_cpu"
EPOCHS, BATCH, EPSILON, MAX_GRAD_NORM = 40, 256, 8.0, 1.0
TUNING_SEEDS, FINAL_SEEDS = (100,), (0, 1, 2, 3, 4)
ACCOUNTANT = "prv"
# The smoke run's accountant: RDP calibrates σ faster than PRV, but still in most of a 1-epoch run's time,
# so the smoke run also calibrates once per process (memoised_calibration).
SMOKE_EPOCHS, SMOKE_ARMS, SMOKE_ACCOUNTANT = 1, ("DP-Adam", "DP-MuonBC"), "rdp"


@dataclass(frozen=True)
class ArmSpec:
    """One arm: a config file, the optimizer arguments it fixes on top, and its tuned argument's grid.

    Args:
        name: The arm's label.
        config: Config file, relative to the repository root.
        fixed: Optimizer ``init_args`` set on top of the config (``None`` allowed: YAML overlay).
        key: The tuned optimizer argument.
        values: Its pre-registered grid.
    """

    name: str
    config: str
    key: str
    values: tuple[float, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def muon(self) -> bool:
        """Whether the matrices get Muon updates (so r̂ is computed for them)."""
        return self.config != DP_ADAM_CONFIG and self.fixed.get("matrix_update", "muon") == "muon"

    def grid(self) -> list[dict[str, float]]:
        """The grid as the protocol's hyperparameter points."""
        return [{self.key: v} for v in self.values]


ARMS: tuple[ArmSpec, ...] = (
    ArmSpec("DP-Adam", DP_ADAM_CONFIG, "lr", (0.005, 0.01, 0.02)),
    ArmSpec("DP-Adam (Muon plan)", DP_MUON_CONFIG, "adam_lr", (0.005, 0.01, 0.02), {"matrix_update": "adamw"}),
    ArmSpec("DP-Muon", DP_MUON_CONFIG, "lr", (0.01, 0.02, 0.04)),
    ArmSpec("DP-Muon flat", DP_MUON_CONFIG, "lr", (0.01, 0.02, 0.04), {"clip_split": "flat"}),
    ArmSpec("DP-MuonBC", DP_MUON_CONFIG, "lr", (0.01, 0.02, 0.04), {"bias_correction": True, "max_noise_ratio": None}),
    ArmSpec("DP-Muon paper form", PAPER_CONFIG, "lr", (0.005, 0.01, 0.02, 0.04, 0.08)),
)
CRITERIA = (
    Criterion("DP-Muon", "DP-Adam"),
    Criterion("DP-Muon", "DP-Adam (Muon plan)"),
    Criterion("DP-Muon flat", "DP-Adam"),
    Criterion("DP-MuonBC", "DP-Muon"),
    Criterion("DP-Muon paper form", "DP-Adam"),
)
DEFAULT_GUARD: float = inspect.signature(DPMuon).parameters["max_noise_ratio"].default
SPLITS = {"val": "val_set", "test": "test_set"}  # the DigitsDataModule attribute each split reads
PAIRING = (
    "seed s sets seed_everything=s and DPStrategy(seed=s) (test-only: fixes the Poisson sampling and the noise), "
    "so every arm sees the same batches and noise seeds at seed s"
)


class RunStats(pl.Callback):
    """Public per-step values of a run: Poisson batch sizes and every matrix's r̂ (DPMuon only)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.ratios: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.rows.append(len(batch[1]))
        # Every step rewrites every Muon matrix's entry, so the dict holds exactly this step's values.
        ratios = getattr(trainer.optimizers[0], "last_noise_ratios", {})
        self.ratios += [float(ratio) for ratio, _ in ratios.values()]


def accuracy(module: torch.nn.Module, dataset: Dataset) -> float:
    """Fraction of ``dataset``'s images the model classifies right."""
    module.eval()
    right = total = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=512):
            right += int((module(x).argmax(-1) == y).sum())
            total += len(y)
    return right / total


def cli_args(
    spec: ArmSpec, hparams: Mapping[str, Any], seed: int, epochs: int, accountant: str, folder: Path
) -> list[str]:
    """The ``build_cli`` arguments of one run; its optimizer overlay is written to ``folder``."""
    extra = folder / "arm.yaml"
    extra.write_text(optimizer_overlay({**spec.fixed, **hparams}))
    return [
        "--config", str(ROOT / spec.config), "--config", str(extra),
        f"--seed_everything={seed}", f"--trainer.strategy.init_args.seed={seed}",
        f"--trainer.max_epochs={epochs}", f"--trainer.strategy.init_args.target_epsilon={EPSILON}",
        f"--trainer.strategy.init_args.max_grad_norm={MAX_GRAD_NORM}",
        f"--trainer.strategy.init_args.accountant={accountant}", f"--data.init_args.batch_size={BATCH}",
        "--trainer.limit_val_batches=0",  # no evaluation during training: only the one split asked for, after
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={folder}",
    ]  # fmt: skip


def run_arm(
    spec: ArmSpec,
    hparams: Mapping[str, Any],
    seed: int,
    split: str,
    epochs: int,
    accountant: str = ACCOUNTANT,
    memo: bool = False,
) -> dict[str, float]:
    """Train ``spec`` at ``hparams`` with paired seed ``seed``; accuracy on ``split`` and the run's diagnostics.

    ``memo``: reuse σ calibrated by an earlier run of this process (see ``grape_digits.memoised_calibration``).
    """
    with tempfile.TemporaryDirectory() as tmp, memoised_calibration() if memo else contextlib.nullcontext():
        cli = build_cli(cli_args(spec, hparams, seed, epochs, accountant, Path(tmp)), run=False)
        stats = RunStats()
        cli.trainer.callbacks.append(stats)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")  # paired on purpose
            start = time.perf_counter()
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            fit_seconds = time.perf_counter() - start
    strategy, optimizer = cli.trainer.strategy, cli.trainer.optimizers[0]
    state = strategy.dp_state
    metrics = {
        "accuracy": accuracy(cli.model, getattr(cli.datamodule, SPLITS[split])),
        "epsilon": strategy.get_epsilon(), "delta": state.delta, "sigma": state.noise_multiplier,
        "steps": state.steps, "mean_batch_rows": statistics.fmean(stats.rows), "fit_seconds": fit_seconds,
    }  # fmt: skip
    if spec.muon:
        if len(stats.ratios) < 2:
            raise RuntimeError(f"{spec.name}: DPMuon reported {len(stats.ratios)} noise ratios over the run")
        p25, p50, p75 = statistics.quantiles(stats.ratios, n=4)
        metrics |= {"noise_ratio_p25": p25, "noise_ratio_p50": p50, "noise_ratio_p75": p75}
        metrics["matrix_steps"] = len(stats.ratios)
        # Comparable across arms, also for the unguarded DP-MuonBC, whose own guard-open fraction is 1 by definition.
        metrics["default_guard_open_fraction"] = sum(r <= DEFAULT_GUARD for r in stats.ratios) / len(stats.ratios)
        dp = optimizer.dp_metrics()
        metrics["guard_open_fraction"] = dp["muon/guard_open_fraction"]
        if spec.fixed.get("bias_correction"):
            metrics["bc_fraction"] = dp["muon/bc_fraction"]
    return metrics


def runner(spec: ArmSpec, epochs: int, accountant: str, memo: bool = False) -> Any:
    """The protocol's ``run(hparams, seed, split)`` for ``spec``."""

    def run(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return run_arm(spec, hparams, seed, split, epochs, accountant, memo)

    return run


def experiment(smoke: bool = False, arms: Sequence[str] | None = None) -> Experiment:
    """The pre-registered experiment, or a subset of its ``arms``.

    ``smoke``: the code path of the real run in about a minute, no result: 1 epoch (5 steps),
    σ calibrated by RDP once and reused (``grape_digits.memoised_calibration``), arms
    ``SMOKE_ARMS`` (unless ``arms``), each at its middle grid point.
    """
    names = list(arms or (SMOKE_ARMS if smoke else [a.name for a in ARMS]))
    specs = [a for a in ARMS if a.name in names]
    if len(specs) != len(names):
        raise SystemExit(
            f"unknown arms {sorted(set(names) - {a.name for a in specs})}; choose from {[a.name for a in ARMS]}"
        )
    epochs, accountant = (SMOKE_EPOCHS, SMOKE_ACCOUNTANT) if smoke else (EPOCHS, ACCOUNTANT)
    settings = {
        "model": "HF ViT, 2 layers, hidden 64, 4 heads, MLP 128, patch 2 (random init)",
        "data": "sklearn digits: train 1,258 images (always), val = DigitsDataModule val split (180), test 359",
        "epochs": epochs, "expected_batch": BATCH, "max_grad_norm": MAX_GRAD_NORM, "target_epsilon": EPSILON,
        "accountant": f"{accountant} (sigma calibrated by the strategy)", "metric": "plain accuracy (fraction right)",
        "pairing": PAIRING, "threads": 1,
        "arms": {a.name: {"config": a.config, "fixed": dict(a.fixed)} for a in specs},
        "configs": {c: config_digest(c) for c in sorted({a.config for a in specs})},
    }  # fmt: skip
    return Experiment(
        name=f"{NAME}_smoke" if smoke else NAME,
        arms=[
            Arm(
                a.name,
                runner(a, epochs, accountant, memo=smoke),
                a.grid()[len(a.values) // 2 :][:1] if smoke else a.grid(),
            )
            for a in specs
        ],
        criteria=[c for c in CRITERIA if c.better in names and c.worse in names],
        metric="accuracy",
        tuning_seeds=TUNING_SEEDS,
        final_seeds=FINAL_SEEDS,
        settings=settings,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_EPOCHS} epoch, arms {SMOKE_ARMS}, 1 grid point")
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the arms (default: all; smoke: two)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: outputs/benchmarks/)")
    parser.add_argument("--figures", type=Path, default=None, help="the figure folder (default: outputs/figures/)")
    parser.add_argument("--workers", type=int, default=1, help="runs at once, one thread each (forked processes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    exp = experiment(args.smoke, args.arms)
    return run_experiment(exp, out=args.out, figures=args.figures, threads=1, workers=args.workers)


if __name__ == "__main__":
    main()
