"""LightningModules shipped with dplightning (they contain no DP code themselves)."""

from dplightning.modules.causal_lm import DPCausalLM
from dplightning.modules.classifier import ImageClassifier
from dplightning.modules.sequence_classifier import DPSequenceClassifier

__all__ = ["DPCausalLM", "DPSequenceClassifier", "ImageClassifier"]
