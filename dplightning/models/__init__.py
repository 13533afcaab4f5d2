"""Plain ``nn.Module`` networks (no Lightning, no DP code)."""

from dplightning.models.adaln import AdaLNFinalLayer, AdaLNZeroBlock, ModulationBounds
from dplightning.models.dit_ts import TimeSeriesDiT
from dplightning.models.hf_vision import HFImageClassifier
from dplightning.models.small import MLP, SmallCNN

__all__ = [
    "MLP",
    "AdaLNFinalLayer",
    "AdaLNZeroBlock",
    "HFImageClassifier",
    "ModulationBounds",
    "SmallCNN",
    "TimeSeriesDiT",
]
