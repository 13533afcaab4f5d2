"""Small image classifiers that need no BatchNorm (DP-compatible)."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Sequential):
    """Flatten, then ``Linear -> Tanh`` blocks and a linear head.

    Args:
        in_features: Input size after flattening (64 for 8x8 digits).
        hidden: Widths of the hidden layers.
        num_classes: Output classes.
    """

    def __init__(self, in_features: int = 64, hidden: tuple[int, ...] = (128,), num_classes: int = 10) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.Tanh()]
            in_features = width
        layers.append(nn.Linear(in_features, num_classes))
        super().__init__(*layers)


class SmallCNN(nn.Module):
    """Two ``Conv -> GroupNorm -> Tanh`` blocks and a linear head (Tanh suits DP-SGD, Papernot et al. 2020).

    Args:
        in_channels: Input channels.
        channels: Channels of the two convolutions.
        num_classes: Output classes.
        groups: GroupNorm groups.
    """

    def __init__(self, in_channels: int = 1, channels: int = 16, num_classes: int = 10, groups: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.Tanh(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.Tanh(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(4 * channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
