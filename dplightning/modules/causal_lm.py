"""Moved to :mod:`dplightning.tasks.causal_lm` (issue 26: LightningModules are in tasks/); still importable.

A checkpoint or config that names a class by this path gets the same class object.
"""

from dplightning.tasks.causal_lm import DPCausalLM, left_padded, per_example_token_mean

__all__ = ["DPCausalLM", "left_padded", "per_example_token_mean"]
