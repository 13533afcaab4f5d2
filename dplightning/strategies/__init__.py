"""Lightning strategies that train with differential privacy."""

from dplightning.strategies.ddp import DPDDPStrategy
from dplightning.strategies.single_device import DPStrategy
from dplightning.strategies.state import DPState

__all__ = ["DPDDPStrategy", "DPState", "DPStrategy"]
