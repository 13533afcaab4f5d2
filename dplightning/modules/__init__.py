"""LightningModules shipped with dplightning (they contain no DP code themselves)."""

from dplightning.modules.causal_lm import DPCausalLM
from dplightning.modules.classifier import ImageClassifier
from dplightning.modules.diffusion import DPDiffusion
from dplightning.modules.sequence_classifier import DPSequenceClassifier
from dplightning.modules.timeseries_diffusion import DPTimeSeriesDiffusion

__all__ = ["DPCausalLM", "DPDiffusion", "DPSequenceClassifier", "DPTimeSeriesDiffusion", "ImageClassifier"]
