"""Moved to :mod:`dplightning.tasks.diffusion` (issue 26: LightningModules are in tasks/); still importable.

A checkpoint or config that names a class by this path gets the same class object.
"""

from dplightning.tasks.diffusion import Batch, DPDiffusion

__all__ = ["Batch", "DPDiffusion"]
