"""Data: Poisson sampling for train loaders, the embedded digits DataModule and the ETT benchmarks."""

from dplightning.data.digits import DigitsDataModule
from dplightning.data.ett import ETTDataModule
from dplightning.data.poisson import EmptySafeCollate, PoissonBatchSampler, PoissonDataLoader

__all__ = ["DigitsDataModule", "ETTDataModule", "EmptySafeCollate", "PoissonBatchSampler", "PoissonDataLoader"]
