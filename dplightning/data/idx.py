"""MNIST and Fashion-MNIST from the standard IDX files in a user folder (nothing is downloaded)."""

from __future__ import annotations

import gzip
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset, TensorDataset

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """One IDX file (optionally gzipped) as an array of its stated shape and type."""
    path = Path(path)
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()}).")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.dtype(_DTYPES[raw[2]]), offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape}, but the file holds {data.size} values.")
    return data.reshape(shape)


def find_idx(data_dir: str | Path, name: str) -> Path:
    """``data_dir/name`` or ``data_dir/name.gz``; a clear error naming all expected files otherwise."""
    root = Path(data_dir)
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    expected = ", ".join(f for pair in IDX_FILES.values() for f in pair)
    raise FileNotFoundError(
        f"{name}(.gz) not found in {root}. The folder must hold the four standard IDX files of MNIST or "
        f"Fashion-MNIST (gzipped or not): {expected}. dplightning downloads nothing."
    )


def load_idx_split(data_dir: str | Path, split: str) -> tuple[Tensor, Tensor]:
    """``(images [N, 1, H, W] float in [0, 1], labels [N] int64)`` of the ``"train"`` or ``"test"`` split."""
    images_name, labels_name = IDX_FILES[split]
    images = read_idx(find_idx(data_dir, images_name))
    labels = read_idx(find_idx(data_dir, labels_name))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{data_dir}: {split} images {images.shape} and labels {labels.shape} do not match.")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


class IDXImageDataModule(pl.LightningDataModule):
    """MNIST / Fashion-MNIST (``[1, 28, 28]`` floats in [0, 1]) from IDX files in ``data_dir``.

    The validation split is carved from the training files by a fixed permutation (public
    randomness); the test split is the ``t10k`` files. The privacy unit is one training image.

    Args:
        data_dir: Folder with ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``).
        batch_size: Expected batch size of the train loader (the Poisson rate is batch_size / N).
        val_size: Training images held out for validation (DPDM trains on all 60k: 0).
        split_seed: Seed of the validation permutation.
        eval_batch_size: Batch size of the validation/test loaders.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 4096,
        val_size: int = 0,
        split_seed: int = 0,
        eval_batch_size: int = 1024,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}.")
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.batch_size = batch_size

    def setup(self, stage: str | None = None) -> None:
        x, y = load_idx_split(self.data_dir, "train")
        full = TensorDataset(x, y)
        n_val = self.hparams.val_size
        if n_val >= len(full):
            raise ValueError(f"val_size {n_val} leaves no training images (the train files hold {len(full)}).")
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(self.hparams.split_seed)).tolist()
        self.val_set = Subset(full, order[:n_val])
        self.train_set = Subset(full, order[n_val:])
        self.test_set = TensorDataset(*load_idx_split(self.data_dir, "test"))

    dp_privacy_unit = "one training image (28x28) with its label"
    """What one privacy unit is, for checkpoints, ``privacy-report`` and exports."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.eval_batch_size, num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.eval_batch_size, num_workers=self.hparams.num_workers)
