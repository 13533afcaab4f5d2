"""DP-GRAPE against a tuned DP-Adam on scikit-learn digits (a Hugging Face ViT, CPU), tuned and paired.

Pre-registered design (fixed before any run; the comparison protocol of ``_protocol.py``; issue 22 item 1):

- **Model and data.** The ViT of ``configs/grape/vit_digits_dp_adam.yaml`` (2 layers, hidden 64,
  patch 2, random init) on the 8x8 digits; 40 epochs (about 200 steps) at expected batch 256
  (Poisson rate q = 256 / 1,258), ε = 8 with σ calibrated by the strategy (PRV accountant; σ
  depends on ε, q and the steps only, not on C), δ as the strategy configures it (recorded per
  run), C = 1 unless the arm tunes it. Every run trains on the 1,258-image train split.
  ``split="val"`` evaluates on the ``DigitsDataModule``'s 180-image validation split (held out
  of training, never the test images), ``split="test"`` on its 359 test images. The metric is
  plain accuracy (fraction of images right; higher is better).
- **Pairing.** Seed ``s`` sets ``seed_everything=s`` (model init) and the strategy's test-only
  ``seed=s``, so every arm sees the same Poisson batches and the same noise seeds. Tuning seed
  100; final seeds 0-7 (8 paired seeds, as the issue asks).
- **Arms and grids.** DP-Adam is ``vit_digits_dp_adam.yaml``: ``torch.optim.AdamW`` (eps 1e-6,
  no weight decay), flat clipping. The DP-GRAPE arms are ``vit_digits_dp_grape.yaml`` (the same
  file but for ``optimizer.class_path``) plus a YAML overlay of the arguments named below; every
  other DPGrape argument keeps the config's value (lr 0.005 until tuned, eps 1e-6, weight_decay
  0) or DPGrape's default: betas (0.9, 0.999), refresh_every 100 (so two subspaces in 200
  steps), projection seed 0 (the same P in every run: the spread over seeds does not include
  P's draw), include None, exclude ``*head*`` / ``*classifier*`` (the 12 hidden matrices of the
  encoder are projected; patch embedding, LayerNorms, biases and head stay full), scale 1.0
  (for "jl" the "rms" lift is 1 too). Projected and full gradients are clipped jointly (flat).

  - DP-Adam: lr .005 .01 .02.
  - DP-GRAPE JL r16: ``projection_std="jl"`` (P ~ N(0, 1/r)), rank 16; lr .005 .01 .02.
  - DP-GRAPE JL r4: ``projection_std="jl"``, rank 4; lr .005 .01 .02.
  - DP-GRAPE authors r16: ``projection_std="authors"`` (P ~ N(0, 1/r²)), ``scale="rms"`` (lift
    √r), rank 16; lr .005 .01 .02 × max_grad_norm C .5 1 2 (9 points; C decides the share of the
    joint clip the projected matrices get; σ is calibrated for ε independently of C).

- **Criteria** (stored in the record before the final runs): each DP-GRAPE arm is non-inferior to
  DP-Adam: the mean paired difference (GRAPE - Adam) is >= -0.03 and its lower 90 % paired
  t-bound is above -0.05 (``Criterion(margin=0.05, mean_margin=0.03)``). Nothing else is claimed.
  A passed criterion is read with the majority-class fractions: two collapsed arms (fractions
  near 1, accuracy near 0.1) are "non-inferior" to each other and say nothing about DP-GRAPE.
- **Also recorded per run** (not criteria): the majority-class fraction of the evaluated split's
  predictions (the share of the most frequent predicted class, to catch collapse; 1/10 would be
  a balanced predictor, 1 a constant one); ε, δ, σ, C, the steps, the mean Poisson batch (equal
  across arms at one seed: a check of the pairing), the fit seconds; for DP-GRAPE the rank, P's
  entry std (1/√r for "jl", 1/r for "authors"), the lift scale, refresh_every, the number of
  subspaces used, the number of projected matrices and the dimension of the noised gradient.

The protocol's "selected at a grid end" note looks at the first and last grid points only; for
the 3 x 3 grid of the authors' arm read the selection table instead.

Cost. One full-length run, timed before the experiment (DP-GRAPE JL r16, lr 0.01, tuning seed,
split val; one CPU thread of an AMD EPYC with 2 cores shared with other jobs, load about 3): 22.6 s
(fit 22.3 s, of which PRV calibration 2 s; 28.6 s CPU for the process with its imports). DP-Adam
runs took 24-65 s (mean 37 s) in the DP-Muon record under such load. 18 selection + 32 final runs,
so about 20-30 minutes of CPU time; about half that in wall time with ``--workers 2`` on 2 free cores:

    OMP_NUM_THREADS=1 python benchmarks/grape_digits.py --workers 2 \\
        --out benchmarks/results/grape_digits_cpu.json --figures docs/figures
    OMP_NUM_THREADS=1 python benchmarks/grape_digits.py --smoke   # under a minute: see experiment()

The record resumes: rerunning the command skips the runs it already holds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
from _configs import config_digest, optimizer_overlay
from _protocol import Arm, Criterion, Experiment, run_experiment
from torch.utils.data import DataLoader, Dataset

import dplightning.strategies.accounting as strategy_accounting
from dplightning.cli import build_cli
from dplightning.optim import DPGrape
from dplightning.optim.grape import entry_std

ROOT = Path(__file__).resolve().parents[1]
DP_ADAM_CONFIG = "configs/grape/vit_digits_dp_adam.yaml"
DP_GRAPE_CONFIG = "configs/grape/vit_digits_dp_grape.yaml"
NAME = "grape_digits_cpu"
EPOCHS, BATCH, EPSILON, MAX_GRAD_NORM = 40, 256, 8.0, 1.0
TUNING_SEEDS, FINAL_SEEDS = (100,), (0, 1, 2, 3, 4, 5, 6, 7)
ACCOUNTANT = "prv"
MARGIN, MEAN_MARGIN = 0.05, 0.03
LRS, CLIPS = (0.005, 0.01, 0.02), (0.5, 1.0, 2.0)
STRATEGY_KEYS = ("max_grad_norm",)  # tuned arguments that belong to the strategy, not the optimizer
# The smoke run's accountant: RDP calibrates σ in milliseconds, PRV in seconds (most of a 1-epoch run).
SMOKE_EPOCHS, SMOKE_ARMS, SMOKE_ACCOUNTANT = 1, ("DP-Adam", "DP-GRAPE authors r16"), "rdp"


@dataclass(frozen=True)
class ArmSpec:
    """One arm: a config file, the optimizer arguments it fixes on top, and its pre-registered grid.

    Args:
        name: The arm's label.
        config: Config file, relative to the repository root.
        grid: Hyperparameter points; ``max_grad_norm`` goes to the strategy, the rest to the optimizer.
        fixed: Optimizer ``init_args`` set on top of the config (a YAML overlay).
    """

    name: str
    config: str
    grid: tuple[Mapping[str, float], ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def grape(self) -> bool:
        """Whether the arm trains with DPGrape."""
        return self.config == DP_GRAPE_CONFIG


def lr_grid() -> tuple[dict[str, float], ...]:
    """The learning-rate grid every arm tunes."""
    return tuple({"lr": lr} for lr in LRS)


ARMS: tuple[ArmSpec, ...] = (
    ArmSpec("DP-Adam", DP_ADAM_CONFIG, lr_grid()),
    ArmSpec("DP-GRAPE JL r16", DP_GRAPE_CONFIG, lr_grid(), {"projection_std": "jl", "rank": 16}),
    ArmSpec("DP-GRAPE JL r4", DP_GRAPE_CONFIG, lr_grid(), {"projection_std": "jl", "rank": 4}),
    ArmSpec(
        "DP-GRAPE authors r16",
        DP_GRAPE_CONFIG,
        tuple({"lr": lr, "max_grad_norm": c} for lr, c in product(LRS, CLIPS)),
        {"projection_std": "authors", "scale": "rms", "rank": 16},
    ),
)
CRITERIA = tuple(
    Criterion(a.name, "DP-Adam", margin=MARGIN, mean_margin=MEAN_MARGIN) for a in ARMS if a.name != "DP-Adam"
)
SPLITS = {"val": "val_set", "test": "test_set"}  # the DigitsDataModule attribute each split reads
PAIRING = (
    "seed s sets seed_everything=s and DPStrategy(seed=s) (test-only: fixes the Poisson sampling and the noise), "
    "so every arm sees the same batches and noise seeds at seed s; DPGrape's projection seed stays 0 in every run"
)


class BatchRows(pl.Callback):
    """The Poisson batch size of every step (public here: a check that the arms are paired)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.rows.append(len(batch[1]))


def evaluate(module: torch.nn.Module, dataset: Dataset) -> dict[str, float]:
    """Accuracy on ``dataset`` and the share of its most frequent predicted class (1.0: collapsed)."""
    module.eval()
    right, predictions = 0, Counter()
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=512):
            predicted = module(x).argmax(-1)
            right += int((predicted == y).sum())
            predictions.update(predicted.tolist())
    total = sum(predictions.values())
    return {"accuracy": right / total, "majority_class_fraction": max(predictions.values()) / total}


def split_hparams(hparams: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(optimizer arguments, strategy arguments) of a grid point."""
    optimizer = {k: v for k, v in hparams.items() if k not in STRATEGY_KEYS}
    return optimizer, {k: v for k, v in hparams.items() if k in STRATEGY_KEYS}


def cli_args(
    spec: ArmSpec, hparams: Mapping[str, Any], seed: int, epochs: int, accountant: str, folder: Path
) -> list[str]:
    """The ``build_cli`` arguments of one run; its optimizer overlay is written to ``folder``."""
    optimizer, strategy = split_hparams(hparams)
    extra = folder / "arm.yaml"
    extra.write_text(optimizer_overlay({**spec.fixed, **optimizer}))
    clip = strategy.get("max_grad_norm", MAX_GRAD_NORM)
    return [
        "--config", str(ROOT / spec.config), "--config", str(extra),
        f"--seed_everything={seed}", f"--trainer.strategy.init_args.seed={seed}",
        f"--trainer.max_epochs={epochs}", f"--trainer.strategy.init_args.target_epsilon={EPSILON}",
        f"--trainer.strategy.init_args.max_grad_norm={clip}",
        f"--trainer.strategy.init_args.accountant={accountant}", f"--data.init_args.batch_size={BATCH}",
        "--trainer.limit_val_batches=0",  # no evaluation during training: only the one split asked for, after
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={folder}",
    ]  # fmt: skip


def grape_extras(optimizer: DPGrape, steps: int, module: torch.nn.Module) -> dict[str, float]:
    """DP-GRAPE's settings as numbers: rank, P's entry std, lift, subspaces, projected matrices, noised dims."""
    projected = {p: t.slot_shape(p.shape).numel() for p, t in optimizer.projections.items()}
    noised = sum(projected.values()) + sum(p.numel() for p in module.parameters() if p not in projected)
    return {
        "rank": optimizer.rank, "projection_entry_std": entry_std(optimizer.rank, optimizer.projection_std),
        "lift_scale": optimizer.lift_scale, "refresh_every": optimizer.refresh_every,
        "subspaces": math.ceil(steps / optimizer.refresh_every), "projected_matrices": len(projected),
        "noised_dims": noised,
    }  # fmt: skip


_calibrate = functools.cache(strategy_accounting.calibrate_noise_multiplier)


@contextlib.contextmanager
def memoised_calibration() -> Iterator[None]:
    """The strategy's σ calibration memoised across runs (a pure function of ε, δ, q, steps, accountant).

    For the smoke run only: there the calibration is most of a 5-step run, and every run asks the same.
    """
    with mock.patch.object(strategy_accounting, "calibrate_noise_multiplier", _calibrate):
        yield


def run_arm(
    spec: ArmSpec,
    hparams: Mapping[str, Any],
    seed: int,
    split: str,
    epochs: int,
    accountant: str = ACCOUNTANT,
    memo: bool = False,
) -> dict[str, float]:
    """Train ``spec`` at ``hparams`` with paired seed ``seed``; accuracy on ``split`` and the run's extras.

    ``memo``: reuse σ calibrated by an earlier run of this process (see :func:`memoised_calibration`).
    """
    with tempfile.TemporaryDirectory() as tmp, memoised_calibration() if memo else contextlib.nullcontext():
        cli = build_cli(cli_args(spec, hparams, seed, epochs, accountant, Path(tmp)), run=False)
        rows = BatchRows()
        cli.trainer.callbacks.append(rows)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")  # paired on purpose
            start = time.perf_counter()
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            fit_seconds = time.perf_counter() - start
    strategy, optimizer = cli.trainer.strategy, cli.trainer.optimizers[0]
    state = strategy.dp_state
    metrics = {
        **evaluate(cli.model, getattr(cli.datamodule, SPLITS[split])),
        "epsilon": strategy.get_epsilon(), "delta": state.delta, "sigma": state.noise_multiplier,
        "max_grad_norm": strategy.dp_config.max_grad_norm, "steps": state.steps,
        "mean_batch_rows": statistics.fmean(rows.rows), "fit_seconds": fit_seconds,
    }  # fmt: skip
    if isinstance(optimizer, DPGrape):
        metrics |= grape_extras(optimizer, state.steps, cli.model)
    return metrics


def runner(spec: ArmSpec, epochs: int, accountant: str, memo: bool = False) -> Any:
    """The protocol's ``run(hparams, seed, split)`` for ``spec``."""

    def run(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return run_arm(spec, hparams, seed, split, epochs, accountant, memo)

    return run


def experiment(smoke: bool = False, arms: Sequence[str] | None = None) -> Experiment:
    """The pre-registered experiment, or a subset of its ``arms``.

    ``smoke``: the code path of the real run in under a minute, no result: 1 epoch (5 steps),
    σ calibrated by RDP once and reused (:func:`memoised_calibration`), arms ``SMOKE_ARMS``
    (unless ``arms``), each at its middle grid point, the same 8 final seeds.
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
        "accountant": f"{accountant} (sigma calibrated by the strategy, independent of C)",
        "metric": "plain accuracy (fraction right)", "pairing": PAIRING, "threads": 1,
        "arms": {a.name: {"config": a.config, "fixed": dict(a.fixed)} for a in specs},
        "configs": {c: config_digest(c) for c in sorted({a.config for a in specs})},
    }  # fmt: skip
    return Experiment(
        name=f"{NAME}_smoke" if smoke else NAME,
        arms=[
            Arm(a.name, runner(a, epochs, accountant, memo=smoke), a.grid[len(a.grid) // 2 :][:1] if smoke else a.grid)
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
