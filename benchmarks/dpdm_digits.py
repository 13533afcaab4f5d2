"""DPDM on the embedded 8×8 digits (CPU): downstream accuracy and local-feature FID per run, with sample grids.

Runs (each trains a fresh DPDiffusion, samples a class-balanced synthetic set with the EMA
weights, and scores it):

* ``nonprivate``, ``eps10``, ``eps1``: noise multiplicity K = --k, expected batch --batch-size;
* ``k1``, ``k8``, ``k32``: K ∈ {1, 8, 32} at ε = --k-eps with expected batch --k-batch-size;
* ``real``: the real training split scored as if it were synthetic (FID against the real test split);
* ``dpsgd_eps10``, ``dpsgd_eps1``: the quickstart's discriminative DP-SGD classifier
  (configs/quickstart.yaml settings) at the same ε, the bar a synthetic-data classifier meets.

Every DP run's ε comes from the strategy's own accountant after training. The FID uses a
:class:`~dplightning.metrics.synthetic.LocalFeatures` network trained on the real training
split: NOT comparable to Inception FID. The real test split is used only for the accuracies.

    OMP_NUM_THREADS=1 python benchmarks/dpdm_digits.py --out benchmarks/results/dpdm_digits.json
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from _outputs import default_figures, default_result

import dplightning
from dplightning.data import DigitsDataModule
from dplightning.data.synthetic import balanced_labels, class_sorted, save_grid
from dplightning.metrics.synthetic import (
    DEFAULT_STEPS,
    LocalFeatures,
    downstream_accuracy,
    frechet_distance,
    real_data_ceiling,
)
from dplightning.models import NCSNppUNet, SmallCNN
from dplightning.modules import DPDiffusion, ImageClassifier


def stack(ds) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*[ds[i] for i in range(len(ds))])
    return torch.stack(xs), torch.tensor(ys)


def trainer(steps: int, epsilon: float | None, **kwargs) -> pl.Trainer:
    strategy = "auto" if epsilon is None else dplightning.DPStrategy(target_epsilon=epsilon, max_grad_norm=1.0)
    return pl.Trainer(
        max_steps=steps, strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, **kwargs,
    )  # fmt: skip


def run_dpdm(name: str, args, epsilon: float | None, k: int, batch_size: int, steps: int, real, test, features):
    torch.manual_seed(args.seed)
    net = NCSNppUNet(image_size=8, nf=args.nf, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,))
    module = DPDiffusion(
        net, noise_multiplicity=k, sampler="ddim", sampling_steps=args.sampling_steps, sample_batch_size=500,
        optimizer=lambda p: torch.optim.Adam(p, lr=args.lr),
    )  # fmt: skip
    t = trainer(steps, epsilon)
    start = time.perf_counter()
    t.fit(module, DigitsDataModule(batch_size=batch_size))
    train_s = time.perf_counter() - start
    eps = t.strategy.get_epsilon() if epsilon is not None else float("inf")
    sigma = t.strategy.dp_state.accounted_noise_multiplier if epsilon is not None else 0.0
    start = time.perf_counter()
    labels = balanced_labels(args.samples, 10)
    images = module.generate(labels, generator=torch.Generator().manual_seed(args.seed))
    sample_s = time.perf_counter() - start
    grid = save_grid(class_sorted(images, labels, 10), Path(args.figures) / f"dpdm_digits_{name}.png", scale=4)
    acc = downstream_accuracy((images, labels), test, steps=args.clf_steps)
    # The ceiling: the same classifiers, same protocol, on as many real training images with these class counts.
    ceiling = real_data_ceiling(real, test, len(labels), like=labels, steps=args.clf_steps)
    fid = frechet_distance(real[0], images, features)
    row = {
        "run": name, "epsilon": eps, "sigma": sigma, "K": k, "batch_size": batch_size, "steps": steps,
        "fid_local": fid, **{f"acc_{kk}": v for kk, v in acc.items()},
        **{f"ceiling_acc_{kk}": v for kk, v in ceiling.items()}, "train_s": train_s, "sample_s": sample_s,
        "grid": str(grid),
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def run_dpsgd(name: str, epsilon: float, seed: int) -> dict:
    """The quickstart classifier (SmallCNN 16 channels, SGD lr 4, batch 256, 40 epochs) at ``epsilon``."""
    torch.manual_seed(seed)
    module = ImageClassifier(SmallCNN(channels=16), optimizer=lambda p: torch.optim.SGD(p, lr=4.0))
    dm = DigitsDataModule(batch_size=256)
    t = pl.Trainer(
        max_epochs=40, strategy=dplightning.DPStrategy(target_epsilon=epsilon, max_grad_norm=1.0), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    t.fit(module, dm)
    acc = t.test(module, dm, verbose=False)[0]["test_acc"]
    row = {"run": name, "epsilon": t.strategy.get_epsilon(), "test_acc": acc}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="real,eps10,eps1,nonprivate,dpsgd_eps10,dpsgd_eps1,k1,k8,k32")
    parser.add_argument("--nf", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--k-eps", type=float, default=10.0)
    parser.add_argument("--k-batch-size", type=int, default=32)
    parser.add_argument("--k-steps", type=int, default=50)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--sampling-steps", type=int, default=32)
    parser.add_argument("--clf-steps", type=int, default=DEFAULT_STEPS, help="downstream classifiers' Adam steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figures", default=str(default_figures()))
    parser.add_argument("--out", default=str(default_result("dpdm_digits.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dm = DigitsDataModule()
    dm.setup("fit")
    real, test = stack(dm.train_set), stack(dm.test_set)
    features = LocalFeatures.fit(*real)
    print(json.dumps({"feature_net_real_test_acc": _feature_acc(features, test)}), flush=True)
    specs = {
        "nonprivate": (None, args.k, args.batch_size, args.steps),
        "eps10": (10.0, args.k, args.batch_size, args.steps),
        "eps1": (1.0, args.k, args.batch_size, args.steps),
        **{f"k{k}": (args.k_eps, k, args.k_batch_size, args.k_steps) for k in (1, 8, 32)},
    }
    rows = [dict(vars(args))]
    for name in args.runs.split(","):
        if name == "real":  # the reference: as many real training images as a run has samples, the same draw
            row = {"run": "real", "fid_local": frechet_distance(real[0], test[0], features)}
            like = balanced_labels(args.samples, 10)
            ceiling = real_data_ceiling(real, test, len(like), like=like, steps=args.clf_steps)
            row |= {f"acc_{kk}": v for kk, v in ceiling.items()}
            print(json.dumps(row), flush=True)
            rows.append(row)
        elif name.startswith("dpsgd_eps"):
            rows.append(run_dpsgd(name, float(name.removeprefix("dpsgd_eps")), args.seed))
        else:
            rows.append(run_dpdm(name, args, *specs[name], real, test, features))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))


def _feature_acc(features: LocalFeatures, test) -> float:
    from dplightning.metrics.synthetic import accuracy

    return accuracy(features.classifier, *test)


if __name__ == "__main__":
    main()
