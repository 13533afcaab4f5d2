"""Data: Poisson sampling for train loaders and the embedded digits DataModule."""

from dplightning.data.digits import DigitsDataModule
from dplightning.data.poisson import EmptySafeCollate, PoissonBatchSampler, PoissonDataLoader

__all__ = ["DigitsDataModule", "EmptySafeCollate", "PoissonBatchSampler", "PoissonDataLoader"]
