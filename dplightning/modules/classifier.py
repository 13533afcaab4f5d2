"""Moved to :mod:`dplightning.tasks.classifier` (issue 26: LightningModules are in tasks/); still importable.

A checkpoint or config that names a class by this path gets the same class object.
"""

from dplightning.tasks.classifier import ImageClassifier

__all__ = ["ImageClassifier"]
