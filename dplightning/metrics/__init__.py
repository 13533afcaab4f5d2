"""Metrics that torchmetrics does not ship (CRPS of sample forecasts)."""

from dplightning.metrics.crps import CSDI_QUANTILES, QuantileCRPS

__all__ = ["CSDI_QUANTILES", "QuantileCRPS"]
