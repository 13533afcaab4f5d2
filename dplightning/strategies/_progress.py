"""Moved to :mod:`dplightning.callbacks.progress` (issue 26), where the classes lost their underscore."""

from dplightning.callbacks.progress import NONFINITE_METRIC, EpsilonProgress, NonfiniteCount, OptimizerMetrics

_EpsilonProgress = EpsilonProgress
_NonfiniteCount = NonfiniteCount
_OptimizerMetrics = OptimizerMetrics

__all__ = ["NONFINITE_METRIC", "EpsilonProgress", "NonfiniteCount", "OptimizerMetrics"]
