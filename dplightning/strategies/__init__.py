"""Lightning strategies that train with differential privacy."""

from dplightning.strategies.ddp import DPDDPStrategy
from dplightning.strategies.single_device import DPStrategy

__all__ = ["DPDDPStrategy", "DPStrategy"]
