"""Lightning strategies that train with differential privacy."""

from dplightning.strategies.single_device import DPStrategy

__all__ = ["DPStrategy"]
