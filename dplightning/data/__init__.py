"""Data: Poisson sampling for train loaders, the embedded digits DataModule and text DataModules."""

from dplightning.data.digits import DigitsDataModule
from dplightning.data.poisson import EmptySafeCollate, PoissonBatchSampler, PoissonDataLoader
from dplightning.data.text import E2EDataModule, SST2DataModule, TextDataModule, TextFileDataModule

__all__ = [
    "DigitsDataModule",
    "E2EDataModule",
    "EmptySafeCollate",
    "PoissonBatchSampler",
    "PoissonDataLoader",
    "SST2DataModule",
    "TextDataModule",
    "TextFileDataModule",
]
