"""ETT windows: the standard split borders, train-only normalisation and window counts (synthetic and real CSV)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dplightning.data import ETTDataModule
from dplightning.data.ett import WindowDataset, split_borders

COLUMNS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]
ETTH1 = Path(__file__).parents[2] / ".." / "shared" / "data" / "ett" / "ETTh1.csv"
MONTH = 10  # rows per "month" of the synthetic file: 200 rows of splits


def write_csv(path: Path, rows: int = 20 * MONTH + 7, seed: int = 0) -> np.ndarray:
    """A synthetic ETT file; the values after the train split are shifted far away (train-only statistics show)."""
    values = np.random.default_rng(seed).normal(3.0, 2.0, (rows, len(COLUMNS)))
    values[12 * MONTH :] += 1000.0
    write_values(path, values)
    return values


def write_values(path: Path, values: np.ndarray) -> None:
    """An ETT file of ``values`` (``[rows, 7]``), one hourly date per row."""
    with open(path, "w") as f:
        f.write(",".join(["date", *COLUMNS]) + "\n")
        for i, row in enumerate(values):
            f.write(f"2016-07-01 {i:05d}," + ",".join(repr(float(v)) for v in row) + "\n")


def test_standard_borders_hourly_and_minutely() -> None:
    assert split_borders(96) == {"train": (0, 8640), "val": (8544, 11520), "test": (11424, 14400)}
    assert split_borders(96, 4 * 720) == {"train": (0, 34560), "val": (34464, 46080), "test": (45984, 57600)}


@pytest.mark.parametrize("task, window", [("forecasting", 8 + 4), ("imputation", 8)])
def test_splits_windows_and_train_only_statistics_on_a_synthetic_file(tmp_path: Path, task: str, window: int) -> None:
    values = write_csv(tmp_path / "ETTh1.csv")
    dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), task=task, input_len=8, horizon=4, rows_per_month=MONTH)
    dm.setup()
    train = values[: 12 * MONTH]
    mean, std = train.mean(0), train.std(0)  # population std, like sklearn's StandardScaler
    assert dm.columns == COLUMNS
    np.testing.assert_allclose(dm.mean.numpy(), mean) and np.testing.assert_allclose(dm.std.numpy(), std)
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 120, "val": 40 + 8, "test": 40 + 8}
    for name, start in [("train", 0), ("val", 12 * MONTH - 8), ("test", 16 * MONTH - 8)]:
        rows = (values[start : start + len(dm.splits[name])] - mean) / std
        np.testing.assert_allclose(dm.splits[name].numpy(), rows, rtol=1e-10)
    assert len(dm.train_set) == 120 - window + 1 and len(dm.test_set) == 48 - window + 1  # len - L_in - H + 1
    first_test = torch.from_numpy((values[16 * MONTH - 8 : 16 * MONTH - 8 + window] - mean) / std).float()
    torch.testing.assert_close(dm.test_set[0], first_test)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (64, window, 7) and batch.dtype == torch.float32


def test_disjoint_training_windows_and_public_statistics(tmp_path: Path) -> None:
    write_csv(tmp_path / "ETTm1.csv", rows=20 * 4 * MONTH)
    dm = ETTDataModule(str(tmp_path / "ETTm1.csv"), input_len=8, horizon=4, rows_per_month=4 * MONTH, train_stride=12,
                       mean=[0.0] * 7, std=[1.0] * 7, max_test_windows=5)  # fmt: skip
    dm.setup()
    starts = dm.train_set.starts
    assert len(dm.splits["train"]) == 480 and torch.equal(starts, torch.arange(0, 480 - 12 + 1, 12))
    assert dm.mean.eq(0).all() and len(dm.test_set) == 5
    assert dm.test_set.starts[0] == 0 and dm.test_set.starts[-1] == 160 + 8 - 12
    with pytest.raises(ValueError, match="both mean and std"):
        ETTDataModule("x.csv", mean=[0.0] * 7)


def test_minutely_files_use_four_times_the_rows(tmp_path: Path) -> None:
    assert ETTDataModule(str(tmp_path / "ETTm2.csv")).rows_per_month == 2880
    assert ETTDataModule(str(tmp_path / "ETTh2.csv")).rows_per_month == 720


def test_window_dataset_subset_is_evenly_spaced() -> None:
    ds = WindowDataset(torch.arange(20.0).unsqueeze(1), window=4, max_windows=3)
    assert ds.starts.tolist() == [0, 8, 16] and ds[2].squeeze(1).tolist() == [16.0, 17.0, 18.0, 19.0]
    with pytest.raises(ValueError, match="no window"):
        WindowDataset(torch.zeros(3, 1), window=4)


@pytest.mark.skipif(not ETTH1.exists(), reason="ETTh1.csv not found in ../shared/data/ett/ (real-data check)")
def test_real_etth1_matches_the_standard_protocol() -> None:
    dm = ETTDataModule(str(ETTH1), input_len=96, horizon=96)
    dm.setup()
    assert dm.columns == COLUMNS
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 8640, "val": 2976, "test": 2976}
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (8449, 2785, 2785)
    train = dm.splits["train"]
    torch.testing.assert_close(train.mean(0), torch.zeros(7, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(train.std(0, unbiased=False), torch.ones(7, dtype=torch.float64))
    assert dm.splits["test"].mean(0).abs().max() > 0.05  # test statistics differ: only train was used to fit
