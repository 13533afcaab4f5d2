"""Moved to :mod:`dplightning.tasks.timeseries_diffusion` (issue 26: LightningModules are in tasks/); still importable.

A checkpoint or config that names a class by this path gets the same class object.
"""

from dplightning.tasks.timeseries_diffusion import (
    Batch,
    Centering,
    CRPSSpace,
    DPTimeSeriesDiffusion,
    Parameterization,
    Task,
    context_mean,
    forecast_mask,
    masked_mse_per_example,
    point_missing_mask,
    random_missing_mask,
)

__all__ = [
    "Batch",
    "CRPSSpace",
    "Centering",
    "DPTimeSeriesDiffusion",
    "Parameterization",
    "Task",
    "context_mean",
    "forecast_mask",
    "masked_mse_per_example",
    "point_missing_mask",
    "random_missing_mask",
]
