"""Downstream accuracy and local-feature FID separate real-like from wrong synthetic sets."""

from __future__ import annotations

import pytest
import torch

from dplightning.data import DigitsDataModule
from dplightning.metrics.synthetic import LocalFeatures, downstream_accuracy, frechet_distance, train_classifier


@pytest.fixture(scope="module")
def digits():
    dm = DigitsDataModule()
    dm.setup("fit")

    def stack(ds):
        xs, ys = zip(*[ds[i] for i in range(len(ds))])
        return torch.stack(xs), torch.tensor(ys)

    return stack(dm.train_set), stack(dm.test_set)


def test_downstream_accuracy_rewards_right_labels(digits) -> None:
    (x, y), test = digits
    right = downstream_accuracy((x, y), test, kinds=("logreg",), epochs=15, lr=3e-3)
    wrong = downstream_accuracy(
        (x, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]),
        test,
        kinds=("logreg",),
        epochs=15,
        lr=3e-3,
    )
    assert right["logreg"] > 0.85 and wrong["logreg"] < 0.3


def test_local_fid_ranks_real_images_before_noise(digits) -> None:
    (x, y), (xt, _) = digits
    features = LocalFeatures.fit(x, y, epochs=5)
    near = frechet_distance(x, xt, features)
    far = frechet_distance(x, torch.rand_like(xt), features)
    assert 0 <= near < 0.2 * far
    with pytest.raises(ValueError, match="feature"):
        frechet_distance(x, xt, "vgg")


def test_an_unknown_classifier_is_refused(digits) -> None:
    (x, y), _ = digits
    with pytest.raises(ValueError, match="Unknown classifier"):
        train_classifier(x, y, kind="resnet")
