"""LightningModules shipped with dplightning (they contain no DP code themselves)."""

from dplightning.modules.classifier import ImageClassifier
from dplightning.modules.timeseries_diffusion import DPTimeSeriesDiffusion

__all__ = ["DPTimeSeriesDiffusion", "ImageClassifier"]
