"""Planning tools that read a training config and predict what a run needs, without running it.

:mod:`dplightning.planning.memory`: the per-GPU memory of a DP step (its command is
:mod:`dplightning.commands.memory_plan`, ``dplightning memory-plan``).
"""
