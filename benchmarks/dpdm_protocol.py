"""DPDM's claims under the comparison protocol (CPU): K helps at fixed ε (E1); the gap to DP-SGD shrinks with ε (E2).

Pre-registered design (fixed before any run; the protocol of ``_protocol.py``; issue 23 item 4):

- **Data.** ``--data digits`` (default): scikit-learn's 8x8 digits, ``DigitsDataModule`` split
  seed 0: every run trains on the 1,258-image train split; ``split="val"`` evaluates on its
  180-image validation split (never the test images), ``split="test"`` on its 359 test images.
  ``--data mnist5k:8`` runs the same design on MNIST-5k at 8x8 (3,600 train / 400 val / 1,000
  test; needs the ``mnist5k`` extra).
- **Regime** (issue 23 item 3, docs/dpdm.md "Choosing the regime"). ``NCSNppUNet`` with 8 base
  channels, ``ch_mult=(1, 2)``, one residual block per level, no attention (45,833 parameters),
  EDM preconditioning, EMA (DPDM's warm-up, cap 0.999), label dropout 0.1; expected batch B = 256
  (Poisson, q = B / N), 200 optimizer steps, C = 1 (flat clipping), Adam. σ is calibrated by the
  strategy for ``target_epsilon`` with the PRV accountant at δ = 1 / (10 N). The privacy unit is
  one training image (its K noise draws are one multi-row unit).
- **Metrics of a DPDM run.** ``heldout_loss``: the EDM loss of the EMA weights on the split's
  images, 16 (σ, n) draws per image from a generator seeded 12,345 (the same draws for every arm
  and seed), labels kept. On ``split="test"`` also: 1,000 class-balanced samples (DDIM, 50 steps,
  sampling seed = run seed) scored by the converged downstream protocol
  (``dplightning.evaluation.synthetic``: 2,000 Adam steps, checkpoint chosen on a hold-out of the
  *synthetic* set, the real test split only scores): ``accuracy`` (the CNN) and ``acc_logreg``;
  ``fid_local`` against the real test images with ``LocalFeatures`` trained on the real train
  split (local features, NOT comparable to Inception FID).
- **E1: K at fixed ε.** Arms K = 1 and K = 4 at ε = 10. Each tunes Adam's lr on the grid
  {1e-3, 3e-3, 1e-2} by ``heldout_loss`` on the validation split (tuning seed 100). Final seeds
  0-4, paired: seed s fixes the model init, the Poisson batches and the DP noise in both arms.
  Claims, stored in the record before the final runs:

  (E1a, the issue's criterion) "K helps" only if K = 4 has the lower test ``heldout_loss`` in
  >= 4 of the 5 paired seeds AND the mean paired CNN-accuracy gain (K4 - K1) exceeds 2 paired
  standard errors;
  (E1b, the protocol's) K = 4 beats K = 1 on ``heldout_loss``: the upper 90 % paired t-bound of
  (K4 - K1) is below 0.

- **E2: ε against a DP-SGD classifier.** For each ε in {1, 10, 100, ∞} an experiment with two
  arms, metric = test accuracy:

  * ``DPDM K=4``: the E1 design at that ε (non-private training for ∞) with **E1's selected lr
    for K = 4, not retuned per ε** (one grid point, so no selection run; E2 refuses to start
    before E1 is complete). Accuracy = the CNN trained on its samples.
  * ``DP-SGD``: the quickstart's classifier (``SmallCNN(channels=16)``, plain SGD) trained on
    the same train split with the same expected batch, steps, C, accountant and ε (so the same
    σ); at ε = ∞ without clipping or noise. Its lr is tuned per ε on validation accuracy: grid
    {1, 2, 4, 8} (private), {0.03, 0.1, 0.3, 1} (non-private). Seed s gives both arms the same
    Poisson batches (same q and N), not the same noise (the models differ).

  The real-data ceiling: the same downstream protocol trained on 1,000 class-balanced *real*
  training images (draw seed 0), scored on the test split. Claims, stored before the final runs:

  (E2a) "the gap shrinks as ε grows": the mean gap (DP-SGD - DPDM) is non-increasing over
  ε = 1, 10, 100, ∞ and the lower 90 % paired t-bound of gap(ε=1) - gap(ε=∞) is above 0;
  (E2b) non-private DPDM's mean CNN accuracy is within 5 points of the real-data ceiling;
  (E2c) where the mean gap at ε = 10 exceeds 10 points the result is reported as "not
  reproducible at this budget".

Nothing else is claimed; every other number is descriptive.

    OMP_NUM_THREADS=1 python benchmarks/dpdm_protocol.py --workers 2 \\
        --out benchmarks/results/dpdm_digits_cpu --figures docs/figures
    OMP_NUM_THREADS=1 python benchmarks/dpdm_protocol.py --smoke   # the code path in a minute or two, no result

``--out`` is a *prefix*: E1 writes ``PREFIX_k.json`` and E2 ``PREFIX_eps{1,10,100,inf}.json`` (each
with its ``.md`` and figure), and the claims go to ``PREFIX_claims.json``/``.md`` with a figure of
accuracy against ε. Records resume: rerunning skips what they hold.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import quiet_trainer
from _outputs import default_figures, default_result
from _protocol import Arm, Criterion, Experiment, paired_interval, run_experiment
from _protocol import _write_json as write_json
from grape_digits import evaluate, memoised_calibration
from torch.utils.data import TensorDataset

from dplightning import DPStrategy
from dplightning.data import DigitsDataModule
from dplightning.data.synthetic import balanced_labels
from dplightning.evaluation.synthetic import (
    DEFAULT_STEPS,
    FID_LOCAL,
    LocalFeatures,
    dataset_tensors,
    downstream_accuracy,
    frechet_distance,
    real_data_ceiling,
)
from dplightning.models import NCSNppUNet, SmallCNN
from dplightning.tasks import DPDiffusion, ImageClassifier

NET = {"nf": 8, "ch_mult": (1, 2), "num_res_blocks": 1, "attn_resolutions": ()}
STEPS, BATCH, MAX_GRAD_NORM, ACCOUNTANT = 200, 256, 1.0, "prv"
SAMPLES, SAMPLING_STEPS, EVAL_DRAWS, EVAL_SEED = 1000, 50, 16, 12_345
CLASSIFIERS = ("cnn", "logreg")
LRS = (1e-3, 3e-3, 1e-2)
E1_EPSILON, E1_KS, E2_K = 10.0, (1, 4), 4
E2_EPSILONS = (1.0, 10.0, 100.0, math.inf)
DPSGD_LRS = {"private": (1.0, 2.0, 4.0, 8.0), "nonprivate": (0.03, 0.1, 0.3, 1.0)}
CEILING_MARGIN, GAP_LIMIT = 0.05, 0.10
TUNING_SEEDS, FINAL_SEEDS = (100,), (0, 1, 2, 3, 4)
# The smoke run also shrinks the expected batch: at 256 its 14 fits were most of a 90-second test.
SMOKE = {"steps": 4, "samples": 100, "clf_steps": 20, "sampling_steps": 4, "eval_draws": 2, "batch": 32}
DPDM, DP_SGD = "DPDM K=4", "DP-SGD"
E1_CLAIM = (
    "K helps only if K=4 has the lower test heldout_loss in >= 4 of 5 paired seeds AND the mean paired CNN "
    "accuracy gain (K4 - K1) exceeds 2 paired standard errors"
)
E2_CLAIMS = {
    "E2a": "the mean gap (DP-SGD - DPDM test accuracy) is non-increasing over eps = 1, 10, 100, inf and the lower "
    "90 % paired t-bound of gap(eps=1) - gap(eps=inf) is above 0",
    "E2b": f"non-private DPDM's mean CNN accuracy is within {CEILING_MARGIN * 100:g} accuracy points of the "
    "real-data ceiling",
    "E2c": f"where the mean gap at eps = 10 exceeds {GAP_LIMIT * 100:g} accuracy points the result is "
    "'not reproducible at this budget'",
}


@dataclass(frozen=True)
class Budget:
    """The run lengths and the expected batch (the real design, or the smoke run's tiny ones).

    ``batch`` is recorded as the settings' ``expected_batch``, outside ``budget`` (the records
    made before it was a field keep their identity).
    """

    steps: int = STEPS
    samples: int = SAMPLES
    clf_steps: int = DEFAULT_STEPS
    sampling_steps: int = SAMPLING_STEPS
    eval_draws: int = EVAL_DRAWS
    batch: int = BATCH


def data_module(data: str, batch_size: int = BATCH) -> pl.LightningDataModule:
    """The data set of ``--data`` (its ``val_set`` and ``test_set`` are the two splits)."""
    if data == "digits":
        return DigitsDataModule(batch_size=batch_size)
    if data == "mnist5k:8":
        from dplightning.data import MNIST5kDataModule

        return MNIST5kDataModule(batch_size=batch_size, image_size=8, val_size=400)
    raise ValueError(f"--data must be 'digits' or 'mnist5k:8', got {data!r}")


@functools.cache
def real_splits(data: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The train, val and test splits as tensors (once per process)."""
    dm = data_module(data)
    dm.setup("fit")
    return {split: dataset_tensors(getattr(dm, f"{split}_set")) for split in ("train", "val", "test")}


@functools.cache
def local_features(data: str) -> LocalFeatures:
    """The FID feature network, trained on the real train split (seeded, once per process)."""
    return LocalFeatures.fit(*real_splits(data)["train"])


def strategy_for(epsilon: float, seed: int) -> DPStrategy | str:
    """The DP strategy at ``epsilon`` with paired seed ``seed`` (``"auto"``, non-private, for ε = ∞)."""
    if math.isinf(epsilon):
        return "auto"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")  # paired on purpose
        return DPStrategy(target_epsilon=epsilon, max_grad_norm=MAX_GRAD_NORM, accountant=ACCOUNTANT, seed=seed)


def fit(module: pl.LightningModule, data: str, epsilon: float, seed: int, steps: int,
        batch: int = BATCH) -> dict[str, float]:  # fmt: skip
    """Train ``module`` for ``steps`` at ``epsilon``, expected batch ``batch``; its privacy figures and fit seconds."""
    strategy = strategy_for(epsilon, seed)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")
        trainer = quiet_trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1,
            limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module, datamodule=data_module(data, batch))
        seconds = time.perf_counter() - start
    if isinstance(strategy, str):  # ε = ∞ is in the record's settings (a metric of inf has no sd)
        return {"sigma": 0.0, "fit_seconds": seconds}
    state = strategy.dp_state
    return {"epsilon": strategy.get_epsilon(), "delta": state.delta, "sigma": state.noise_multiplier,
            "fit_seconds": seconds}  # fmt: skip


@torch.no_grad()
def heldout_loss(module: DPDiffusion, images: torch.Tensor, labels: torch.Tensor, draws: int) -> float:
    """The EDM loss of the EMA weights on ``images`` ([0, 1]): ``draws`` fixed (σ, n) draws per image, labels kept.

    The draws come from a generator seeded ``EVAL_SEED``, so every arm and seed is scored on the
    same ones whatever its own K.
    """
    x = (images * 2 - 1).repeat_interleave(draws, 0)
    y = labels.repeat_interleave(draws, 0)
    sigma, noise = module.draw_noise(x, torch.Generator().manual_seed(EVAL_SEED))
    return float(module.denoiser.loss_per_row(x, y, sigma, noise, module.ema_denoise).mean())


def run_dpdm(data: str, epsilon: float, k: int, budget: Budget, hparams: Mapping[str, Any], seed: int,
             split: str) -> dict[str, float]:  # fmt: skip
    """Train DPDM with ``k`` noise draws per image; ``heldout_loss`` on ``split``, and samples scored on test."""
    pl.seed_everything(seed, verbose=False)
    net = NCSNppUNet(image_size=8, **NET)
    module = DPDiffusion(
        net, noise_multiplicity=k, sampler="ddim", sampling_steps=budget.sampling_steps, sample_batch_size=500,
        optimizer=functools.partial(torch.optim.Adam, lr=float(hparams["lr"])),
    )  # fmt: skip
    metrics = fit(module, data, epsilon, seed, budget.steps, budget.batch)
    params = sum(p.numel() for p in net.parameters())
    metrics |= {
        "K": k, "parameters": params,
        # The DP noise's norm per step relative to one clipped gradient's: σ C √d / (B C).
        "noise_norm_per_step_in_C": metrics["sigma"] * math.sqrt(params) / budget.batch,
        "heldout_loss": heldout_loss(module.eval(), *real_splits(data)[split], budget.eval_draws),
    }  # fmt: skip
    if split != "test":
        return metrics
    labels = balanced_labels(budget.samples, 10)
    start = time.perf_counter()
    images = module.generate(labels, generator=torch.Generator().manual_seed(seed))
    metrics["sample_seconds"] = time.perf_counter() - start
    test = real_splits(data)["test"]
    accuracy = downstream_accuracy((images, labels), test, CLASSIFIERS, steps=budget.clf_steps, seed=seed)
    metrics |= {"accuracy": accuracy["cnn"], "acc_logreg": accuracy["logreg"],
                "fid_local": frechet_distance(test[0], images, local_features(data))}  # fmt: skip
    return metrics


def run_dpsgd(data: str, epsilon: float, budget: Budget, hparams: Mapping[str, Any], seed: int,
              split: str) -> dict[str, float]:  # fmt: skip
    """The quickstart classifier trained on the real train split at ``epsilon``; accuracy on ``split``."""
    pl.seed_everything(seed, verbose=False)
    module = ImageClassifier(SmallCNN(channels=16), optimizer=functools.partial(torch.optim.SGD, lr=hparams["lr"]))
    metrics = fit(module, data, epsilon, seed, budget.steps, budget.batch)
    return {**metrics, **evaluate(module, TensorDataset(*real_splits(data)[split]))}


def e1(data: str, budget: Budget, smoke: bool) -> Experiment:
    """E1: K = 1 against K = 4 at ε = 10, each with its lr tuned on validation ``heldout_loss``."""
    grid = [{"lr": lr} for lr in (LRS[1:] if smoke else LRS)]  # the smoke run keeps a selection step
    arms = [Arm(f"K={k}", functools.partial(run_dpdm, data, E1_EPSILON, k, budget), grid) for k in E1_KS]
    return Experiment(
        name="k", arms=arms, criteria=[Criterion("K=4", "K=1")], metric="heldout_loss", higher_is_better=False,
        tuning_seeds=TUNING_SEEDS, final_seeds=FINAL_SEEDS, settings=settings(data, budget, E1_EPSILON, E1_CLAIM),
        pairing="seed s fixes the model init, the Poisson batches and the DP noise in both arms (same network)",
    )  # fmt: skip


def e2(data: str, budget: Budget, epsilon: float, dpdm_lr: float) -> Experiment:
    """E2 at one ε: DPDM (E1's selected lr for K = 4) against a DP-SGD classifier tuned on validation accuracy."""
    lrs = DPSGD_LRS["nonprivate" if math.isinf(epsilon) else "private"]
    arms = [
        Arm(
            DPDM,
            functools.partial(run_dpdm, data, epsilon, E2_K, budget),
            [{"lr": dpdm_lr}],
            fixed="E1's selected lr for K=4 (validation held-out loss at eps 10), not retuned per eps",
        ),
        Arm(DP_SGD, functools.partial(run_dpsgd, data, epsilon, budget), [{"lr": lr} for lr in lrs]),
    ]
    return Experiment(
        name=f"eps{epsilon:g}", arms=arms, criteria=[], metric="accuracy", tuning_seeds=TUNING_SEEDS,
        final_seeds=FINAL_SEEDS, settings=settings(data, budget, epsilon, E2_CLAIMS),
        pairing="seed s fixes the model inits and gives both arms the same Poisson batches (same q and N), "
        "not the same noise (the models differ)",
    )  # fmt: skip


def settings(data: str, budget: Budget, epsilon: float, claims: Any) -> dict[str, Any]:
    """What the records' results depend on (part of their identity, so a changed one cannot resume)."""
    return {
        "data": data, "epsilon": "inf" if math.isinf(epsilon) else epsilon, "expected_batch": budget.batch,
        "max_grad_norm": MAX_GRAD_NORM, "accountant": ACCOUNTANT, "net": {k: list(v) if isinstance(v, tuple) else v
        for k, v in NET.items()}, "budget": {k: v for k, v in dataclasses.asdict(budget).items() if k != "batch"},
        "eval_seed": EVAL_SEED, "classifiers": list(CLASSIFIERS), "fid_features": FID_LOCAL, "claims": claims,
        "threads": 1,
    }  # fmt: skip


def judge_e1(record: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's criterion (E1a) from E1's final runs, with the paired accuracy interval."""
    final = {(r["arm"], r["seed"]): r["metrics"] for r in record["runs"] if r["phase"] == "final"}
    seeds = record["identity"]["final_seeds"]
    loss_wins = sum(final["K=4", s]["heldout_loss"] < final["K=1", s]["heldout_loss"] for s in seeds)
    gains = [final["K=4", s]["accuracy"] - final["K=1", s]["accuracy"] for s in seeds]
    se = statistics.stdev(gains) / math.sqrt(len(gains))
    passed = bool(loss_wins >= 4 and statistics.fmean(gains) > 2 * se)
    return {
        "claim": E1_CLAIM, "heldout_loss_wins_of_K4": loss_wins, "seeds": len(seeds),
        "cnn_gain": paired_interval(gains), "cnn_gain_se": se, "passed": passed,
        "verdict": ("K helps (E1a passed)" if passed else "K helps: not shown at this scale")
        + f": K=4 lower held-out loss in {loss_wins}/{len(seeds)} seeds, CNN gain "
        f"{statistics.fmean(gains):+.4f} (2 SE = {2 * se:.4f})",
    }  # fmt: skip


def judge_e2(records: Mapping[float, Mapping[str, Any]], ceiling: Mapping[str, float]) -> dict[str, Any]:
    """E2a-c from the four E2 records and the real-data ceiling."""
    gaps = {}
    for eps, record in records.items():
        final = {(r["arm"], r["seed"]): r["metrics"]["accuracy"] for r in record["runs"] if r["phase"] == "final"}
        seeds = record["identity"]["final_seeds"]
        gaps[eps] = [final[DP_SGD, s] - final[DPDM, s] for s in seeds]
    means = [statistics.fmean(gaps[e]) for e in E2_EPSILONS]
    shrink = paired_interval([a - b for a, b in zip(gaps[E2_EPSILONS[0]], gaps[math.inf])])
    monotone = bool(all(a >= b for a, b in zip(means, means[1:])))
    nonprivate = records[math.inf]["arms"][DPDM]["metrics"]["accuracy"]["mean"]
    gap10 = statistics.fmean(gaps[10.0])
    return {
        "gap_per_epsilon": {f"{e:g}": paired_interval(gaps[e]) for e in E2_EPSILONS},
        "E2a": {"claim": E2_CLAIMS["E2a"], "means_non_increasing": monotone, "gap1_minus_gapinf": shrink,
                "passed": bool(monotone and shrink["low"] > 0)},  # fmt: skip
        "E2b": {"claim": E2_CLAIMS["E2b"], "nonprivate_dpdm_cnn": nonprivate, "ceiling_cnn": ceiling["cnn"],
                "passed": bool(nonprivate >= ceiling["cnn"] - CEILING_MARGIN)},  # fmt: skip
        "E2c": {"claim": E2_CLAIMS["E2c"], "gap_at_10": gap10,
                "verdict": "not reproducible at this budget" if gap10 > GAP_LIMIT else "within the limit"},
        "ceiling": dict(ceiling),
    }  # fmt: skip


DESCRIBED = {"heldout_loss": "held-out loss", "accuracy": "CNN accuracy", "acc_logreg": "LogReg accuracy",
             "fid_local": "local FID", "fit_seconds": "fit s"}  # fmt: skip


def describe(record: Mapping[str, Any], a: str, b: str) -> dict[str, dict[str, Any]]:
    """Per metric of the final runs: mean ± sd of arms ``a`` and ``b``, the paired interval of a - b (descriptive)."""
    final = {(r["arm"], r["seed"]): r["metrics"] for r in record["runs"] if r["phase"] == "final"}
    seeds = record["identity"]["final_seeds"]
    out = {}
    for key in DESCRIBED:
        if all(key in final[arm, s] for arm in (a, b) for s in seeds):
            va, vb = ([final[arm, s][key] for s in seeds] for arm in (a, b))
            out[key] = {arm: (statistics.fmean(v), statistics.stdev(v)) for arm, v in ((a, va), (b, vb))}
            out[key]["diff"] = paired_interval([x - y for x, y in zip(va, vb)])
    return out


def describe_markdown(described: Mapping[str, Mapping[str, Any]], a: str, b: str) -> list[str]:
    """The descriptive table of :func:`describe`."""
    lines = [f"| metric | {a} | {b} | {a} - {b} (90 % paired interval) |", "|---|---|---|---|"]
    for key, d in described.items():
        diff = d["diff"]
        lines.append(f"| {DESCRIBED[key]} | {d[a][0]:.4f} ± {d[a][1]:.4f} | {d[b][0]:.4f} ± {d[b][1]:.4f} | "
                     f"{diff['mean']:+.4f} [{diff['low']:+.4f}, {diff['high']:+.4f}] |")  # fmt: skip
    return lines


def claims_markdown(claims: Mapping[str, Any]) -> str:
    """The claims' table (``PREFIX_claims.md``)."""
    e1r, e2r = claims["E1"], claims.get("E2")
    lines = ["# DPDM's claims under the comparison protocol", "", f"Data: {claims['data']}; CPU, one thread per run.",
             "", "## E1: K at ε = 10", "", f"Claim (pre-registered): {e1r['claim']}.", "", f"**{e1r['verdict']}**.",
             f"Paired CNN gain K4 - K1: {e1r['cnn_gain']['mean']:+.4f}, 90 % interval "
             f"[{e1r['cnn_gain']['low']:+.4f}, {e1r['cnn_gain']['high']:+.4f}].", "",
             "Every metric of the final runs (descriptive; only E1a and E1b were claimed):", "",
             *describe_markdown(claims["E1_described"], "K=4", "K=1")]  # fmt: skip
    if e2r:
        c = e2r["ceiling"]
        lines += [
            "",
            "## E2: the gap to a DP-SGD classifier against ε",
            "",
            f"Real-data ceiling (same protocol, {claims['samples']} real training images): CNN {c['cnn']:.4f}, "
            f"LogReg {c['logreg']:.4f}.",
            "",
            "| ε | DPDM K=4 CNN | DP-SGD | gap (DP-SGD - DPDM) | 90 % interval |",
            "|---|---|---|---|---|",
        ]
        for eps, row in claims["E2_rows"].items():
            gap = e2r["gap_per_epsilon"][eps]
            lines.append(
                f"| {eps} | {row['dpdm']['mean']:.4f} ± {row['dpdm']['sd']:.4f} | {row['dpsgd']['mean']:.4f} "
                f"± {row['dpsgd']['sd']:.4f} | {gap['mean']:+.4f} | [{gap['low']:+.4f}, {gap['high']:+.4f}] |"
            )
        for key in ("E2a", "E2b"):
            lines += ["", f"{key} ({e2r[key]['claim']}): **{'passed' if e2r[key]['passed'] else 'not shown'}**."]
        lines += ["", f"E2c: gap at ε = 10 {e2r['E2c']['gap_at_10']:+.4f}: **{e2r['E2c']['verdict']}**."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_claims_figure(path: Path, rows: Mapping[str, Mapping[str, Any]], ceiling: Mapping[str, float]) -> None:
    """Test accuracy against ε: DPDM's CNN, the DP-SGD classifier and the real-data ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("dpdm", "DPDM K=4 → CNN on 1,000 samples"), ("dpsgd", "DP-SGD classifier")):
        ax.errorbar(x, [r[key]["mean"] for r in rows.values()], [r[key]["sd"] for r in rows.values()], fmt="o-",
                    capsize=3, label=label)  # fmt: skip
    ax.axhline(ceiling["cnn"], color="k", ls="--", lw=1, label="CNN on 1,000 real images")
    ax.set_xticks(x, [f"ε = {e}" for e in rows])
    ax.set_ylabel("test accuracy (mean ± sd, 5 paired seeds)")
    ax.set_title("DPDM against DP-SGD on the same data (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="digits", choices=("digits", "mnist5k:8"))
    parser.add_argument("--smoke", action="store_true", help="tiny runs: the code path, no result")
    parser.add_argument("--only", choices=("E1", "E2"), help="run one experiment (E2 needs E1's complete record)")
    parser.add_argument("--out", type=str, default=None, help="the records' prefix (default: outputs/benchmarks/)")
    parser.add_argument("--figures", type=Path, default=None, help="the figure folder (default: outputs/figures/)")
    parser.add_argument("--workers", type=int, default=1, help="runs at once, one thread each (forked processes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # Lightning 2.6 builds torch's deprecated LeafSpec on every fit (see dplightning.cli): that one warning only.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", module="lightning.pytorch.utilities._pytree")
    budget = Budget(**SMOKE) if args.smoke else Budget()
    prefix = args.out or str(default_result(f"dpdm_{args.data.replace(':', '')}{'_smoke' if args.smoke else ''}"))
    prefix = prefix.removesuffix(".json")
    figures = args.figures or default_figures()
    # The smoke run calibrates σ once per process: at 4 steps, every run's calibration is the same and most of it.
    memo = memoised_calibration() if args.smoke else contextlib.nullcontext()
    with memo:
        return _main(args, budget, prefix, figures)


def _main(args: argparse.Namespace, budget: Budget, prefix: str, figures: Path) -> dict[str, Any]:
    stem = Path(prefix).name

    def run(exp: Experiment) -> dict[str, Any]:
        out = Path(f"{prefix}_{exp.name}.json")
        return run_experiment(dataclasses.replace(exp, name=f"{stem}_{exp.name}"), out=out, figures=figures,
                              threads=1, workers=args.workers)  # fmt: skip

    record1 = run(e1(args.data, budget, args.smoke)) if args.only != "E2" else _complete(f"{prefix}_k.json")
    claims: dict[str, Any] = {"data": args.data, "samples": budget.samples, "E1": judge_e1(record1),
                              "E1_described": describe(record1, "K=4", "K=1")}  # fmt: skip
    if args.only != "E1":
        lr = record1["selection"]["K=4"]["hparams"]["lr"]
        records = {eps: run(e2(args.data, budget, eps, lr)) for eps in E2_EPSILONS}
        splits = real_splits(args.data)
        like = balanced_labels(budget.samples, 10)
        ceiling = real_data_ceiling(splits["train"], splits["test"], budget.samples, CLASSIFIERS, like=like,
                                    steps=budget.clf_steps)  # fmt: skip
        claims["E2"] = judge_e2(records, ceiling)
        claims["E2_rows"] = {f"{e:g}": {"dpdm": r["arms"][DPDM]["metrics"]["accuracy"],
                                        "dpsgd": r["arms"][DP_SGD]["metrics"]["accuracy"]}
                             for e, r in records.items()}  # fmt: skip
        write_claims_figure(figures / f"{stem}_accuracy_vs_epsilon.png", claims["E2_rows"], ceiling)
    write_json(Path(f"{prefix}_claims.json"), claims)
    Path(f"{prefix}_claims.md").write_text(claims_markdown(claims))
    print(json.dumps({k: v for k, v in claims.items() if k != "E2_rows"}, indent=1, default=str))
    return claims


def _complete(path: str) -> dict[str, Any]:
    record = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    if record.get("status") != "complete":
        raise SystemExit(f"E2 takes E1's selected lr: run E1 to completion first ({path} is not complete)")
    return record


if __name__ == "__main__":
    main()
