"""The ETT benchmarks (ETTh1/ETTh2 hourly, ETTm1/ETTm2 15-minute) as sliding windows, with the standard splits.

Splits follow Informer/Autoformer (TSLib's ``Dataset_ETT_hour`` / ``Dataset_ETT_minute``):
12/4/4 months of 30 days, i.e. train rows [0, 8640), validation [8640 − L_in, 11520) and
test [11520 − L_in, 14400) for hourly data (×4 for 15-minute data); the validation and
test slices start ``L_in`` rows early so that their first windows have a full input.
Every channel is z-scored with the mean and (population) std of the training rows only.

**Privacy unit: one training window.** With stride 1 a raw row appears in up to
``window`` overlapping windows, so window-level DP says little about one row. With
``train_stride = window`` the training windows are disjoint and each row is in exactly one
of them: the guarantee then covers any single row (and any set of rows inside one window).
The normalisation statistics are computed from the training rows and are **not private**;
for a strict end-to-end guarantee pass ``mean``/``std`` from public data. The data module
declares both (``dp_privacy_unit`` with the window and stride, ``dp_not_covered``), and
checkpoints, ``privacy-report`` and exports state them.

**Faults** (``fault_rate``, ``test_fault_rate``; :mod:`dplightning.data.faults`). An optional, pre-registered
fault process puts level, unit and missing-channel faults into one channel's whole context of exactly
``round(p·N)`` training (and, separately, test) windows, chosen with the kind, channel and size from the
public ``fault_seed`` alone, never from a data value. The targets stay clean. Each fault is a per-window
transform with public randomness, so the privacy unit is still one training window and ``dp_privacy_unit``
is unchanged. With a fault rate of 0 (the default) the windows are exactly those without the option.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from dplightning.data.faults import FaultedWindows, FaultKind, FaultProcess
from dplightning.privacy.provenance import PrivacyUnit

Task = Literal["imputation", "forecasting"]
HOURLY_MONTH = 30 * 24
"""Rows in a 30-day month of hourly data."""


def split_borders(input_len: int, rows_per_month: int = HOURLY_MONTH) -> dict[str, tuple[int, int]]:
    """Row ranges ``[start, end)`` of train/val/test (12/4/4 months; val and test start ``input_len`` early)."""
    train_end, val_end, test_end = 12 * rows_per_month, 16 * rows_per_month, 20 * rows_per_month
    return {"train": (0, train_end), "val": (train_end - input_len, val_end), "test": (val_end - input_len, test_end)}


def read_ett_csv(path: str | Path) -> tuple[list[str], Tensor]:
    """The value columns (all but ``date``) and their rows as float64 ``[T, K]``."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    if header[0] != "date":
        raise ValueError(f"{path}: expected the first column to be 'date', got {header[0]!r}.")
    return header[1:], torch.tensor([[float(v) for v in row[1:]] for row in body], dtype=torch.float64)


class WindowDataset(Dataset):
    """Windows ``series[s : s + window]`` for starts ``0, stride, 2·stride, ...`` (``[window, K]`` float32).

    Args:
        series: ``[T, K]``.
        window: Window length.
        stride: Step between window starts.
        max_windows: Keep only this many starts, evenly spaced over all of them (CPU-sized evaluation).
    """

    def __init__(self, series: Tensor, window: int, stride: int = 1, max_windows: int | None = None) -> None:
        if len(series) < window:
            raise ValueError(f"A series of {len(series)} rows has no window of length {window}.")
        self.series = series.float()
        self.window = window
        starts = torch.arange(0, len(series) - window + 1, stride)
        if max_windows is not None and max_windows < len(starts):
            starts = starts[torch.linspace(0, len(starts) - 1, max_windows).round().long()]
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Tensor:
        s = int(self.starts[i])
        return self.series[s : s + self.window]


class ETTDataModule(pl.LightningDataModule):
    """ETT windows for forecasting (input + horizon steps) or imputation (input steps), all 7 channels.

    Args:
        path: The CSV (e.g. ``../shared/data/ett/ETTh1.csv``, relative to where you run).
        task: ``"forecasting"`` (windows of ``input_len + horizon``) or ``"imputation"``
            (windows of ``input_len``; the masks are drawn by the module).
        input_len: L_in (96 in the standard settings).
        horizon: H (96, 192, 336 or 720); unused for imputation.
        rows_per_month: 720 for hourly data, 2880 for 15-minute data; ``None`` infers it from
            the file name (``ETTm*`` is 15-minute).
        batch_size: Expected train batch size; under DP the Poisson rate is
            ``batch_size / len(train windows)``.
        train_stride: Step between training windows; ``window`` length gives disjoint windows.
        max_val_windows: Evenly spaced subset of the validation windows (``None``: all).
        max_test_windows: Evenly spaced subset of the test windows (``None``: all).
        eval_batch_size: Batch size of the validation/test/predict loaders.
        mean: Per-channel mean to normalise with (public statistics); ``None``: train split.
        std: Per-channel std, given together with ``mean``.
        num_workers: DataLoader workers.
        fault_rate: Share of the training windows given a fault (:mod:`dplightning.data.faults`; the
            pre-registered values are 0.01 and 0.03). 0: the training windows are the plain tensors.
        test_fault_rate: The same process on the test windows (its own plan from the same seed); 1.0
            evaluates on faulted windows only. 0: plain test windows. Validation windows are never faulted.
        fault_seed: The public seed of the fault plans.
        fault_kinds: The kinds drawn from: ``level``, ``unit``, ``missing``.
        fault_level_range: (low, high) of a level fault's size, in train standard deviations.
        fault_unit_factors: The factors a unit fault draws from.
    """

    def __init__(
        self,
        path: str,
        task: Task = "forecasting",
        input_len: int = 96,
        horizon: int = 96,
        rows_per_month: int | None = None,
        batch_size: int = 64,
        train_stride: int = 1,
        max_val_windows: int | None = None,
        max_test_windows: int | None = None,
        eval_batch_size: int = 64,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        num_workers: int = 0,
        fault_rate: float = 0.0,
        test_fault_rate: float = 0.0,
        fault_seed: int = 0,
        fault_kinds: tuple[FaultKind, ...] = ("level", "unit", "missing"),
        fault_level_range: tuple[float, float] = (5.0, 20.0),
        fault_unit_factors: tuple[float, ...] = (10.0,),
    ) -> None:
        super().__init__()
        if task not in ("forecasting", "imputation"):
            raise ValueError(f"task must be 'forecasting' or 'imputation', got {task!r}.")
        if (mean is None) != (std is None):
            raise ValueError("Give both mean and std (public statistics), or neither.")
        self.save_hyperparameters()
        self.path = path
        self.task = task
        self.input_len = input_len
        self.window = input_len + horizon if task == "forecasting" else input_len
        minutely = Path(path).name.startswith("ETTm")
        self.rows_per_month = rows_per_month or (4 * HOURLY_MONTH if minutely else HOURLY_MONTH)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.columns: list[str] = []
        self.mean = torch.tensor(mean, dtype=torch.float64) if mean is not None else None
        self.std = torch.tensor(std, dtype=torch.float64) if std is not None else None
        self.splits: dict[str, Tensor] = {}
        low, high = fault_level_range

        def faults(rate: float) -> FaultProcess:
            return FaultProcess(rate, fault_seed, tuple(fault_kinds), (low, high), tuple(fault_unit_factors))

        self.train_faults, self.test_faults = faults(fault_rate), faults(test_fault_rate)

    @property
    def context_len(self) -> int:
        """Rows of a window that are context (faults stay there): the input of a forecast, all of an imputation."""
        return self.input_len if self.task == "forecasting" else self.window

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.columns, data = read_ett_csv(self.path)
        borders = split_borders(self.input_len, self.rows_per_month)
        if len(data) < borders["test"][1]:
            raise ValueError(f"{self.path} has {len(data)} rows; the standard splits need {borders['test'][1]}.")
        train = data[slice(*borders["train"])]
        if self.mean is None:
            self.mean, self.std = train.mean(0), train.std(0, unbiased=False)  # StandardScaler on train only
        normalised = (data - self.mean) / self.std
        self.splits = {name: normalised[lo:hi] for name, (lo, hi) in borders.items()}
        hp = self.hparams
        train_windows = WindowDataset(self.splits["train"], self.window, hp.train_stride)
        self.train_set = self.with_faults(train_windows, self.train_faults, "train")
        self.val_set = WindowDataset(self.splits["val"], self.window, max_windows=hp.max_val_windows)
        test_windows = WindowDataset(self.splits["test"], self.window, max_windows=hp.max_test_windows)
        self.test_set = self.with_faults(test_windows, self.test_faults, "test")

    @property
    def calibration_set(self) -> WindowDataset:
        """Every window of the validation months alone, for calibrations that must not read a training row.

        The validation split starts ``input_len`` rows early, in the training months, so that its
        first forecast has an input; those first windows hold training rows (for imputation, the
        first is the last training window). Its values are normalised like everything else: with
        ``mean``/``std`` if given, else with the training rows' statistics (see :attr:`dp_not_covered`).
        """
        self.setup("validate")
        return WindowDataset(self.splits["val"][self.input_len :], self.window)

    def with_faults(self, windows: WindowDataset, process: FaultProcess, stream: str) -> WindowDataset | FaultedWindows:
        """``windows`` themselves at a fault rate of 0 (the plain tensors), else wrapped in the fault process."""
        if process.rate == 0:
            return windows
        return FaultedWindows(windows, process, self.context_len, windows.series.shape[1], stream)

    @property
    def dp_privacy_unit(self) -> PrivacyUnit:
        """One training window (its length and stride go to checkpoints and exports)."""
        rows = {HOURLY_MONTH: "hourly rows", 4 * HOURLY_MONTH: "15-minute rows"}.get(self.rows_per_month, "rows")
        horizon = self.window - self.input_len
        parts = f" ({self.input_len} input + {horizon} horizon)" if self.task == "forecasting" else ""
        return PrivacyUnit(
            f"one training window of {self.window} consecutive {rows}{parts}", self.window, self.hparams.train_stride
        )

    @property
    def dp_not_covered(self) -> dict[str, str]:
        """The normalisation statistics, when they come from the training rows rather than ``mean``/``std``."""
        if self.hparams.mean is not None:
            return {}
        return {"normalisation": "the per-channel mean and std of the training rows (pass mean/std from public data)"}

    def denormalise(self, x: Tensor) -> Tensor:
        """Back to the CSV's units (``[..., K]``)."""
        return x * self.std.to(x) + self.mean.to(x)

    def train_dataloader(self) -> DataLoader:
        # The DP strategy replaces shuffling by Poisson sampling with q = batch_size / len(train_set).
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.eval_batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.eval_batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
