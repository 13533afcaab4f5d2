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


def test_inception_fid_feeds_gray_images_as_three_channels_or_names_what_is_missing(digits, monkeypatch) -> None:
    from torchmetrics.image.fid import FrechetInceptionDistance

    from dplightning.metrics import synthetic

    (x, _), (xt, _) = digits
    try:  # on a machine with torch-fidelity and its weights this is the real network
        synthetic.inception_features()
    except RuntimeError as err:
        assert "torch-fidelity" in str(err) and "feature='local'" in str(err)
    seen: list[tuple[int, ...]] = []

    class ColourStats(torch.nn.Module):  # stands in for Inception: what it is fed, and 6 colour statistics
        num_features = 6

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            seen.append(tuple(images.shape[1:]))
            flat = images.flatten(2)
            return torch.cat([flat.mean(-1), flat.std(-1)], 1).double()

    stand_in = FrechetInceptionDistance(feature=ColourStats(), normalize=True)
    monkeypatch.setattr(synthetic, "inception_features", lambda: stand_in)
    assert frechet_distance(x[:200], xt[:200], "inception") >= 0
    assert set(seen) == {(3, 8, 8)}  # 1-channel digits expanded to RGB, as Inception needs
