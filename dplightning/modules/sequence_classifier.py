"""Moved to :mod:`dplightning.tasks.sequence_classifier` (issue 26: LightningModules are in tasks/); still importable.

A checkpoint or config that names a class by this path gets the same class object.
"""

from dplightning.tasks.sequence_classifier import DPSequenceClassifier, Pooling

__all__ = ["DPSequenceClassifier", "Pooling"]
