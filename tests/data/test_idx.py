"""MNIST-style IDX files: tiny synthetic files written here, read back; a clear error when they are absent."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dplightning.data import IDXImageDataModule
from dplightning.data.idx import read_idx


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


def make_mnist(root: Path, n_train: int = 20, n_test: int = 7, compress: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    for name, a in arrays.items():
        write_idx(root / (name + (".gz" if compress else "")), a, compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_idx_files_are_read_as_images_in_unit_range(tmp_path, compress) -> None:
    arrays = make_mnist(tmp_path, compress=compress)
    dm = IDXImageDataModule(str(tmp_path), batch_size=4, val_size=5)
    dm.setup("fit")
    assert len(dm.train_set) == 15 and len(dm.val_set) == 5 and len(dm.test_set) == 7
    x, y = dm.test_set[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    torch.testing.assert_close(x[0], torch.from_numpy(arrays["t10k-images-idx3-ubyte"][3] / 255.0).float())
    assert int(y) == int(arrays["t10k-labels-idx1-ubyte"][3])
    train_idx = {int(dm.train_set.indices[i]) for i in range(15)} | {int(i) for i in dm.val_set.indices}
    assert train_idx == set(range(20))  # train and validation partition the training files


def test_missing_files_name_what_is_expected(tmp_path) -> None:
    dm = IDXImageDataModule(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.*t10k-labels-idx1-ubyte"):
        dm.setup("fit")


def test_a_corrupt_file_is_refused(tmp_path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", np.zeros((2, 3), dtype=np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="header says"):
        read_idx(tmp_path / "short")
