"""LightningModules shipped with dplightning (they contain no DP code themselves)."""

from dplightning.modules.classifier import ImageClassifier

__all__ = ["ImageClassifier"]
