"""An existing Lightning project, written without any dplightning import (the starting point of the docs page)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class PlainClassifier(pl.LightningModule):
    """A two-layer classifier with an ``encoder`` and a ``head``."""

    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, 8), nn.Tanh())
        self.head = nn.Linear(8, classes)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.encoder(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def plain_loader(n: int = 64, batch_size: int = 16, features: int = 6, classes: int = 3) -> DataLoader:
    """Gaussian features, labels from a random linear rule."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
