"""How good a synthetic labelled image set is: downstream accuracy on real test data, and FID.

* :func:`downstream_accuracy`: DPDM's protocol. Train a classifier on synthetic images only
  (Adam 3e-4, batch 128, inputs in [−1, 1]), pick the epoch by accuracy on a held-out part of
  the *synthetic* set, report accuracy on the *real* test split.
* :func:`frechet_distance`: torchmetrics' ``FrechetInceptionDistance`` with a pluggable
  feature network: the Inception features when torchmetrics can load them locally
  (``torch-fidelity`` and its weights), otherwise a :class:`LocalFeatures` network trained
  on the real training split. A local-feature FID is **not comparable** to Inception FID
  (nor across feature networks); it only ranks sets scored with the same network.

Run ``python -m dplightning.metrics.synthetic --synthetic run/synthetic.pt --data digits`` for both.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.image.fid import FrechetInceptionDistance

from dplightning.models.small import SmallCNN


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
    )  # 8×8 digits: the paper's CNN needs ≥ 28×28


CLASSIFIERS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "logreg": lambda shape, k: nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), k)),
    "mlp": lambda shape, k: nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 100), nn.ReLU(), nn.Linear(100, k)),
    "cnn": _cnn,
}
"""DPDM's three downstream classifiers by name: ``(image shape, classes) -> network``."""


@torch.no_grad()
def accuracy(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` on images in [0, 1] (scaled to [−1, 1] as in training)."""
    model.eval()
    correct = sum(
        int((model(x * 2 - 1).argmax(1) == y).sum()) for x, y in zip(images.split(batch_size), labels.split(batch_size))
    )
    return correct / max(len(labels), 1)


def train_classifier(
    images: Tensor,
    labels: Tensor,
    kind: str | nn.Module = "cnn",
    num_classes: int = 10,
    epochs: int = 50,
    batch_size: int = 128,
    lr: float = 3e-4,
    holdout: float = 0.1,
    seed: int = 0,
) -> tuple[nn.Module, float]:
    """Train ``kind`` (a :data:`CLASSIFIERS` name or a network) on images in [0, 1]; keep its best held-out epoch.

    Returns:
        The selected model and its held-out (synthetic) accuracy.
    """
    if isinstance(kind, str) and kind not in CLASSIFIERS:
        raise ValueError(f"Unknown classifier {kind!r}; choose one of {sorted(CLASSIFIERS)}.")
    if len(images) < 2:
        raise ValueError(f"Need at least 2 images to train and select a classifier, got {len(images)}.")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=g)
    n_hold = max(1, round(holdout * len(images)))
    hold, train = order[:n_hold], order[n_hold:]
    torch.manual_seed(seed)
    model = CLASSIFIERS[kind](tuple(images.shape[1:]), num_classes) if isinstance(kind, str) else kind
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    best, best_acc = copy.deepcopy(model), -1.0
    for _ in range(epochs):
        model.train()
        for idx in train[torch.randperm(len(train), generator=g)].split(batch_size):
            loss = F.cross_entropy(model(images[idx] * 2 - 1), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        acc = accuracy(model, images[hold], labels[hold])
        if acc > best_acc:
            best, best_acc = copy.deepcopy(model), acc
    return best, best_acc


def downstream_accuracy(
    synthetic: tuple[Tensor, Tensor],
    real_test: tuple[Tensor, Tensor],
    kinds: tuple[str, ...] = ("logreg", "mlp", "cnn"),
    **train_options: object,
) -> dict[str, float]:
    """Real-test accuracy of each classifier trained on the synthetic set only (``{kind: accuracy}``)."""
    out = {}
    for kind in kinds:
        model, _ = train_classifier(*synthetic, kind=kind, **train_options)  # type: ignore[arg-type]
        out[kind] = accuracy(model, *real_test)
    return out


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
        """Train the feature network as a classifier on (real training) images in [0, 1]."""
        net = cls(tuple(images.shape[1:]), **kwargs)
        torch.manual_seed(seed)
        net.classifier, _ = train_classifier(images, labels, kind=net.classifier, epochs=epochs, lr=1e-3, seed=seed)
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


def main(argv: list[str] | None = None) -> None:
    """Downstream accuracy and local-feature FID of a synthetic set (see the module docstring)."""
    from dplightning.data.digits import DigitsDataModule
    from dplightning.data.idx import IDXImageDataModule
    from dplightning.data.synthetic import load_synthetic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", required=True, help="synthetic.pt written by DPDiffusion's predict")
    parser.add_argument("--data", default="digits", help="'digits' or a folder with MNIST/Fashion-MNIST IDX files")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--feature", default="local", choices=["local", "inception"])
    args = parser.parse_args(argv)
    dm = DigitsDataModule() if args.data == "digits" else IDXImageDataModule(args.data)
    dm.setup("fit")

    def stack(ds) -> tuple[Tensor, Tensor]:
        xs, ys = zip(*[ds[i] for i in range(len(ds))])
        return torch.stack(xs), torch.tensor(ys)

    train, test = stack(dm.train_set), stack(dm.test_set)
    synthetic = load_synthetic(args.synthetic)
    for kind, acc in downstream_accuracy(synthetic, test, epochs=args.epochs).items():
        print(f"downstream {kind}: {100 * acc:.1f}% on the real test split")
    feature = LocalFeatures.fit(*train) if args.feature == "local" else "inception"
    label = "local-feature FID (NOT comparable to Inception FID)" if args.feature == "local" else "Inception FID"
    print(f"{label}: {frechet_distance(train[0], synthetic[0], feature):.3f}")


if __name__ == "__main__":
    main()
