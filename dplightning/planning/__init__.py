"""Planning tools that read a training config and predict what a run needs, without running it.

:mod:`dplightning.planning.memory` (``dplightning memory-plan``): the per-GPU memory of a DP step.
"""
