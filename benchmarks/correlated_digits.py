"""DP-SGD against banded MF and BLT correlated noise at equal ε on scikit-learn digits (CPU), tuned and paired.

Pre-registered design (fixed before any run; the comparison protocol of ``_protocol.py``; issue 27 item 6):

- **Model and data.** The quickstart's ``SmallCNN`` (channels 16, GroupNorm, Tanh) in an
  ``ImageClassifier`` on the 8x8 digits of ``DigitsDataModule`` (split seed 0): every run trains on
  the 1,258-image train split. ``split="val"`` evaluates on its 180-image validation split (held
  out of training, never the test images), ``split="test"`` on its 359 test images. The metric
  is plain accuracy (fraction of images right; higher is better).
- **Run length and privacy.** 1,600 optimizer steps (``max_steps``, the same for every arm:
  1,600 x 64 / 1,258 = 81 passes over the data, the many-epoch regime where matrix factorization
  should pay) at expected batch B = 64, C = 1 (flat clipping), ε = 8 at δ = 1/(10 N) = 7.95e-5
  (the strategy's default, recorded per run). σ is calibrated by the strategy for ``target_epsilon``
  with each arm's own accounting (PRV accountant): **equal ε, not equal σ**. ε, δ and σ are
  recorded per run; the script checks that every run's ε is within 2 % of 8 and not above it,
  and that δ is the same in every run (``equal_epsilon`` in the record).
- **Optimizer.** ``torch.optim.SGD`` with momentum 0.9 (no dampening, no Nesterov, no weight
  decay), constant learning rate. The strategy then optimises C for the heavy-ball momentum
  workload (``dplightning.strategies.correlated.workload_of``).
- **Arms and grids** (each tunes lr on the same grid: 0.05, 0.1, 0.2, 0.4):

  - DP-SGD: ``noise_mechanism="gaussian"``, Poisson sampling at q = B / N over the whole train
    split; one composition per step.
  - band_mf b16: ``noise_mechanism="band_mf"``, ``bands=16``, ``cyclic_partitions=16``: cyclic
    Poisson over 16 partitions at q' = 16 B / N = 0.81, ⌈1600 / 16⌉ = 100 amplified compositions.
  - BLT 2 buffers p19: ``noise_mechanism="blt"``, ``blt_buffers=2``, ``cyclic_partitions=19``
    (the most partitions q' <= 1 allows: q' = 19 B / N = 0.97), not amplified: one Gaussian
    mechanism whose sensitivity covers ⌈1600 / 19⌉ = 85 participations.

- **Pairing.** Seed ``s`` sets ``seed_everything=s`` (the same model init in every arm) and the
  strategy's test-only ``DPStrategy(seed=s)``. The samplers differ between arms (plain Poisson
  for DP-SGD, cyclic Poisson over 16 or 19 partitions for the others) and so do the noise streams,
  so pairing shares the model init and the seed but *not* the batches or the noise. Tuning seed
  100; final seeds 0-4.
- **Criteria** (stored in the record before the final runs; superiority, "A beats B" only when
  the lower 90 % paired t-bound of A - B is above 0): band_mf b16 beats DP-SGD; BLT 2 buffers p19
  beats DP-SGD. Nothing else is claimed.
- **Replication** (issue 44; written before its runs): the band_mf result rests on 4 of 5 paired
  wins, so ``--replicate 10 11 12 13 14`` reruns every arm at the lr this record selected
  (:func:`_protocol.replication`: no tuning, the same criteria) on five seeds never used before,
  into ``correlated_digits_cpu_replication``. Its verdicts stand on their own; the ten seeds
  together are reported as a description, not as a test.
- **Also recorded per run** (not criteria): ε, δ, σ, the sensitivity of C x the white noise is
  calibrated to (units of C), the planned and released steps, the sample rate the ledger
  accounts (q, q' or 1 for BLT), the mean sampled batch and the fit seconds; the majority-class
  fraction of the predictions (1 = collapsed); and the **expected error of the arm's strategy
  matrix** at the run's σ and steps (``dplightning.privacy.matrix_mechanism.expected_error``;
  identity C for DP-SGD; the participation each arm is calibrated for: one participation for
  DP-SGD and band_mf, every cyclic participation for BLT): the RMSE of the noisy prefix sums
  (``rmse_prefix``) and of the momentum workload (``rmse_momentum``, what SGD with momentum 0.9
  follows), in clip norms of the noisy sum (all arms divide by the same B), and both per unit σ
  (``*_per_sigma``: the strategies compared at equal σ, not equal ε).

Why ε = 8, 16 bands and 19 partitions: the expected error of the design alone, before any training
(σ calibrated with PRV for 1,600 steps, RMSE relative to DP-SGD's at equal ε, momentum workload
and in brackets prefix sums). At ε = 8 DP-SGD has σ = 1.324; band_mf b16 σ = 4.509, 0.862x
(1.083x); band_mf b8 0.875x (0.988x); BLT 2 buffers p19 σ = 0.550 with sensitivity 57.5, 0.919x
(1.223x), and 4 buffers are no better. At ε = 2 band_mf gives 0.986x (b16) and 0.983x (b8), BLT
1.057x: at this N and batch matrix factorization is not expected to pay there, so ε = 2 is not
run. The expected gain at ε = 8 is modest (14 % less RMSE of the momentum workload for band_mf,
8 % for BLT), so "not shown at this scale" is a plausible outcome.

Cost, measured before the experiment: one full-length run per arm at lr 0.2 (the tuning seed,
split val; one CPU thread of a 2-core AMD EPYC VM shared with another long job, load average 5-6):
DP-SGD 51.6 s (of which σ calibration by PRV about 4 s), band_mf b16 45.8 s, BLT 2 buffers p19
38.8 s, evaluation included. These three timing runs were made after the grid, the arms and the
criteria above were fixed, and changed nothing in them. 12 selection + 15 final runs = 27 runs,
about 20 minutes of CPU time: about 10-15 minutes of wall time with ``--workers 2`` on two free
cores (longer when the cores are shared). The smoke run took 49 s on the same loaded machine.

    OMP_NUM_THREADS=1 python benchmarks/correlated_digits.py --workers 2 \\
        --out benchmarks/results/correlated_digits_cpu.json --figures docs/figures
    OMP_NUM_THREADS=1 python benchmarks/correlated_digits.py --smoke   # under a minute: see experiment()

The record resumes: rerunning the command skips the runs it already holds. Besides the protocol's
outputs, the script adds the per-arm means of ε, σ and the RMSEs to the record (``expected_error``,
``equal_epsilon``), a table to ``NAME.md`` and a figure ``NAME_rmse.png`` (test accuracy and RMSE
per arm).
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import quiet_trainer
from _outputs import default_figures, default_result
from _protocol import Arm, Criterion, Experiment, replication, run_experiment
from _protocol import _write_json as write_json
from grape_digits import evaluate, memoised_calibration

from dplightning import DPStrategy
from dplightning.data import DigitsDataModule
from dplightning.models import SmallCNN
from dplightning.privacy.matrix_mechanism import Workload, expected_error, identity_strategy
from dplightning.strategies import DPState
from dplightning.strategies.correlated import describe_workload, workload_of
from dplightning.tasks import ImageClassifier

NAME = "correlated_digits_cpu"
STEPS, BATCH, EPSILON, MAX_GRAD_NORM, MOMENTUM, CHANNELS = 1600, 64, 8.0, 1.0, 0.9, 16
TUNING_SEEDS, FINAL_SEEDS = (100,), (0, 1, 2, 3, 4)
ACCOUNTANT = "prv"
LRS = (0.05, 0.1, 0.2, 0.4)
EPSILON_REL_TOL = 0.02  # the equal-ε check: every run's ε in [EPSILON (1 - tol), EPSILON]
# The smoke run: a few steps (but whole BLT cycles), σ calibrated by RDP once per process and reused.
SMOKE_STEPS, SMOKE_ACCOUNTANT = 38, "rdp"
DP_SGD = "DP-SGD"
SPLITS = {"val": "val_set", "test": "test_set"}  # the DigitsDataModule attribute each split reads
PAIRING = (
    "seed s sets seed_everything=s (the same model init in every arm) and DPStrategy(seed=s) (test-only: fixes the "
    "sampling and the noise seeds). The samplers differ between arms (DP-SGD: plain Poisson at q = B/N; band_mf and "
    "BLT: cyclic Poisson over their partitions at q' = p B/N), so pairing shares the model init and the seed but "
    "not the batches or the noise"
)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: the strategy's noise-mechanism arguments and its pre-registered grid.

    Args:
        name: The arm's label.
        mechanism: ``DPStrategy`` arguments besides the shared ones (``noise_mechanism`` and its own).
        grid: Learning-rate points.
    """

    name: str
    mechanism: Mapping[str, Any] = field(default_factory=dict)
    grid: tuple[Mapping[str, float], ...] = tuple({"lr": lr} for lr in LRS)

    @property
    def partitions(self) -> int:
        """Partitions of the arm's sampler (1: plain Poisson)."""
        return int(self.mechanism.get("cyclic_partitions", self.mechanism.get("bands", 1)))

    @property
    def participations(self) -> str:
        """How the arm's sensitivity counts participations: ``"one"`` (amplified) or ``"all"`` (BLT)."""
        return "all" if self.mechanism.get("noise_mechanism") == "blt" else "one"


ARMS: tuple[ArmSpec, ...] = (
    ArmSpec(DP_SGD, {"noise_mechanism": "gaussian"}),
    ArmSpec("band_mf b16", {"noise_mechanism": "band_mf", "bands": 16, "cyclic_partitions": 16}),
    ArmSpec("BLT 2 buffers p19", {"noise_mechanism": "blt", "blt_buffers": 2, "cyclic_partitions": 19}),
)
CRITERIA = tuple(Criterion(a.name, DP_SGD) for a in ARMS if a.name != DP_SGD)


class BatchRows(pl.Callback):
    """The sampled batch size of every step (public here: a check of the sampler's rate)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.rows.append(len(batch[1]))


def strategy_error(state: DPState, spec: ArmSpec, steps: int) -> dict[str, float]:
    """Expected error of the run's strategy matrix at its σ: RMSE of the prefix sums and of the momentum workload.

    DP-SGD's C is the identity. The participation is the one the arm's noise is calibrated for
    (one for DP-SGD and band_mf, every cyclic participation for BLT); the sensitivity this
    gives must equal the strategy's own (``state``: the run's ``strategy.dp_state``), which is checked here.
    """
    matrix = state.noise_strategy if state.noise_strategy is not None else identity_strategy(steps)
    max_count = None if spec.participations == "all" else 1
    sigma = float(state.noise_multiplier)
    errors: dict[str, float] = {}
    for label, workload in (("prefix", Workload()), ("momentum", Workload(momentum=MOMENTUM))):
        report = expected_error(matrix, workload, sigma, spec.partitions, max_count)
        if not math.isclose(report.sensitivity, state.noise_sensitivity, rel_tol=1e-9):
            raise RuntimeError(
                f"{spec.name}: expected_error's sensitivity {report.sensitivity} is not the strategy's "
                f"{state.noise_sensitivity}: the RMSE would not be the run's"
            )
        errors |= {f"rmse_{label}": report.rmse, f"max_rmse_{label}": report.max_rmse,
                   f"rmse_{label}_per_sigma": report.rmse / sigma}  # fmt: skip
    return {**errors, "sensitivity": report.sensitivity}


def run_arm(
    spec: ArmSpec,
    hparams: Mapping[str, Any],
    seed: int,
    split: str,
    steps: int,
    accountant: str = ACCOUNTANT,
    memo: bool = False,
) -> dict[str, float]:
    """Train ``spec`` at ``hparams`` with paired seed ``seed``; accuracy on ``split`` and the run's extras."""
    pl.seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=BATCH)
    model = ImageClassifier(
        SmallCNN(channels=CHANNELS),
        optimizer=functools.partial(torch.optim.SGD, lr=float(hparams["lr"]), momentum=MOMENTUM),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")  # paired on purpose
        strategy = DPStrategy(
            target_epsilon=EPSILON, max_grad_norm=MAX_GRAD_NORM, accountant=accountant, seed=seed, **spec.mechanism
        )
    rows = BatchRows()
    with tempfile.TemporaryDirectory() as tmp, memoised_calibration() if memo else contextlib.nullcontext():
        trainer = quiet_trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1,
            limit_val_batches=0, num_sanity_val_steps=0, callbacks=[rows], default_root_dir=tmp,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")
            start = time.perf_counter()
            trainer.fit(model, datamodule=data)
            fit_seconds = time.perf_counter() - start
    optimizer, state = trainer.optimizers[0], strategy.dp_state
    return {
        **evaluate(model, getattr(data, SPLITS[split])),
        "epsilon": strategy.get_epsilon(), "delta": state.delta, "sigma": state.noise_multiplier,
        "target_epsilon": EPSILON, "accounted_sample_rate": state.ledger.history[0][1],
        "compositions": state.ledger.steps, "steps": state.steps,
        "planned_steps": strategy.accounting.planned_steps, "partitions": spec.partitions,
        "momentum_workload": float(workload_of(optimizer).momentum or 0.0),
        "mean_batch_rows": statistics.fmean(rows.rows), "fit_seconds": fit_seconds,
        **strategy_error(state, spec, strategy.accounting.planned_steps),
    }  # fmt: skip


def runner(spec: ArmSpec, steps: int, accountant: str, memo: bool = False) -> Any:
    """The protocol's ``run(hparams, seed, split)`` for ``spec``."""

    def run(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return run_arm(spec, hparams, seed, split, steps, accountant, memo)

    return run


def experiment(smoke: bool = False) -> Experiment:
    """The pre-registered experiment.

    ``smoke``: the code path of the real run in under a minute, no result: 38 steps (two
    BLT cycles), σ calibrated by RDP once per process and reused (:func:`memoised_calibration`),
    every arm at one grid point (lr 0.2), the same 5 final seeds.
    """
    steps, accountant = (SMOKE_STEPS, SMOKE_ACCOUNTANT) if smoke else (STEPS, ACCOUNTANT)
    settings = {
        "model": f"SmallCNN(channels={CHANNELS}) in ImageClassifier (random init)",
        "data": "sklearn digits (DigitsDataModule, split seed 0): train 1,258 images (always), val 180, test 359",
        "steps": steps, "expected_batch": BATCH, "max_grad_norm": MAX_GRAD_NORM, "target_epsilon": EPSILON,
        "optimizer": f"torch.optim.SGD(momentum={MOMENTUM}), constant lr; C optimised for "
                     f"{describe_workload(Workload(momentum=MOMENTUM))}",
        "accountant": f"{accountant} (sigma calibrated by the strategy per arm for target_epsilon: equal epsilon)",
        "metric": "plain accuracy (fraction right)", "pairing": PAIRING, "threads": 1,
        "arms": {a.name: dict(a.mechanism) for a in ARMS},
    }  # fmt: skip
    return Experiment(
        name=f"{NAME}_smoke" if smoke else NAME,
        arms=[Arm(a.name, runner(a, steps, accountant, memo=smoke), a.grid[2:3] if smoke else a.grid) for a in ARMS],
        criteria=list(CRITERIA),
        metric="accuracy",
        tuning_seeds=TUNING_SEEDS,
        final_seeds=FINAL_SEEDS,
        settings=settings,
        pairing=PAIRING,
    )


def summarise(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm, over its final runs: mean ± sd of ε, σ and the RMSEs, and the equal-ε check."""
    final = [r for r in record["runs"] if r["phase"] == "final"]
    keys = ("epsilon", "delta", "sigma", "sensitivity", "rmse_prefix", "rmse_momentum", "rmse_prefix_per_sigma",
            "rmse_momentum_per_sigma", "accuracy")  # fmt: skip
    per_arm = {}
    for name in record["arms"]:
        mine = [r["metrics"] for r in final if r["arm"] == name]
        per_arm[name] = {k: {"mean": statistics.fmean(m[k] for m in mine), "min": min(m[k] for m in mine),
                             "max": max(m[k] for m in mine)} for k in keys}  # fmt: skip
    base = per_arm[DP_SGD]
    for stats in per_arm.values():
        for k in ("rmse_prefix", "rmse_momentum"):
            stats[f"{k}_ratio_to_dp_sgd"] = stats[k]["mean"] / base[k]["mean"]
    runs = [r["metrics"] for r in record["runs"]]
    low, high = EPSILON * (1 - EPSILON_REL_TOL), EPSILON * (1 + 1e-9)
    equal = {
        "target": EPSILON, "rel_tol": EPSILON_REL_TOL, "min": min(m["epsilon"] for m in runs),
        "max": max(m["epsilon"] for m in runs), "deltas": sorted({m["delta"] for m in runs}),
        "passed": all(low <= m["epsilon"] <= high for m in runs) and len({m["delta"] for m in runs}) == 1,
    }  # fmt: skip
    return {"expected_error": per_arm, "equal_epsilon": equal}


def error_markdown(summary: Mapping[str, Any]) -> str:
    """The expected-error table appended to ``NAME.md``."""
    equal = summary["equal_epsilon"]
    lines = [
        "## Expected error of each arm's strategy matrix (final runs, mean over seeds)", "",
        f"Equal ε: every run's ε in [{equal['min']:.4f}, {equal['max']:.4f}] (target {equal['target']}, "
        f"tolerance {equal['rel_tol']:.0%} below, none above), δ = {', '.join(f'{d:.3g}' for d in equal['deltas'])}: "
        f"**{'passed' if equal['passed'] else 'FAILED'}**. RMSE in clip norms of the noisy sum at each arm's σ; "
        "per σ: at σ = 1 (equal σ, not equal ε).", "",
        "| arm | σ | sensitivity | RMSE prefix | RMSE momentum | / DP-SGD (momentum) | RMSE momentum per σ | "
        "test accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, s in summary["expected_error"].items():
        lines.append(
            f"| {name} | {s['sigma']['mean']:.4g} | {s['sensitivity']['mean']:.4g} | {s['rmse_prefix']['mean']:.4g} | "
            f"{s['rmse_momentum']['mean']:.4g} | {s['rmse_momentum_ratio_to_dp_sgd']:.3f} | "
            f"{s['rmse_momentum_per_sigma']['mean']:.4g} | {s['accuracy']['mean']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def write_error_figure(path: Path, record: Mapping[str, Any], summary: Mapping[str, Any]) -> None:
    """Test accuracy per arm (paired seeds) beside the RMSE of its strategy matrix at equal ε."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, seeds = list(record["arms"]), record["identity"]["final_seeds"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for s in seeds:
        left.plot(range(len(names)), [record["arms"][n]["per_seed"][str(s)] for n in names], "o-", alpha=0.5,
                  label=f"seed {s}")  # fmt: skip
    left.plot(range(len(names)), [record["arms"][n]["metrics"]["accuracy"]["mean"] for n in names], "k_",
              markersize=24, label="mean")  # fmt: skip
    left.set_xticks(range(len(names)), names, rotation=20, ha="right")
    left.set_ylabel("test accuracy")
    left.set_title(f"test accuracy at ε = {EPSILON:g}")
    left.legend(fontsize=7)
    width, x = 0.38, list(range(len(names)))
    for offset, key, label in (
        (-width / 2, "rmse_prefix", "prefix sums"),
        (width / 2, "rmse_momentum", "momentum 0.9"),
    ):
        values = [summary["expected_error"][n][key]["mean"] for n in names]
        bars = right.bar([i + offset for i in x], values, width, label=label)
        right.bar_label(bars, [f"{v / summary['expected_error'][DP_SGD][key]['mean']:.2f}x" for v in values],
                        fontsize=7)  # fmt: skip
    right.set_xticks(x, names, rotation=20, ha="right")
    right.set_ylabel("RMSE of the noisy workload (clip norms)")
    right.set_title("expected error at each arm's σ (labels: / DP-SGD)")
    right.legend(fontsize=7)
    fig.suptitle(f"{record['experiment']}: accuracy and expected error at equal ε")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def add_expected_error(record: dict[str, Any], out: Path, figures: Path) -> dict[str, Any]:
    """Store the per-arm error summary and equal-ε check in the record, the markdown and a second figure."""
    summary = summarise(record)
    record.update(summary)
    write_json(out, record)
    markdown = out.with_suffix(".md")  # rewritten by every run_experiment, so this appends once
    markdown.write_text(markdown.read_text() + error_markdown(summary))
    write_error_figure(figures / f"{record['experiment']}_rmse.png", record, summary)
    return record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_STEPS} steps, 1 grid point per arm")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: outputs/benchmarks/)")
    parser.add_argument("--figures", type=Path, default=None, help="the figure folder (default: outputs/figures/)")
    parser.add_argument("--workers", type=int, default=1, help="runs at once, one thread each (forked processes)")
    parser.add_argument("--replicate", type=int, nargs="+", metavar="SEED",
                        help="rerun the committed record's selected points on these new seeds (no tuning)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    exp = experiment(args.smoke)
    if args.replicate:
        exp = replication(exp, Path(__file__).resolve().parent / "results" / f"{exp.name}.json", args.replicate)
    out = args.out or default_result(f"{exp.name}.json")
    figures = args.figures or default_figures()
    record = run_experiment(exp, out=out, figures=figures, threads=1, workers=args.workers)
    return add_expected_error(record, out, figures)


if __name__ == "__main__":
    main()
