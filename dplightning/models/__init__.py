"""Plain ``nn.Module`` networks (no Lightning, no DP code)."""

from dplightning.models.small import MLP, SmallCNN

__all__ = ["MLP", "SmallCNN"]
