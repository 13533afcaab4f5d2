"""Plain ``nn.Module`` networks and the Hugging Face model builders (:mod:`dplightning.models.hf`).

No Lightning, no DP code: the LightningModules that train these live in :mod:`dplightning.tasks`.
"""

from dplightning.models.adaln import AdaLNFinalLayer, AdaLNZeroBlock, ModulationBounds
from dplightning.models.dit_ts import TimeSeriesDiT
from dplightning.models.edm import EMA, Denoiser, EDMPreconditioning, VPreconditioning
from dplightning.models.hf_vision import HFImageClassifier
from dplightning.models.small import MLP, SmallCNN
from dplightning.models.unet import NCSNppUNet

__all__ = [
    "EMA",
    "MLP",
    "AdaLNFinalLayer",
    "AdaLNZeroBlock",
    "Denoiser",
    "EDMPreconditioning",
    "HFImageClassifier",
    "ModulationBounds",
    "NCSNppUNet",
    "SmallCNN",
    "TimeSeriesDiT",
    "VPreconditioning",
]
