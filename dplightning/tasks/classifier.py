"""A plain image classifier; DP comes from the strategy, not from this module."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from dplightning.losses import training_loss


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classifier around any ``nn.Module`` network.

    The training loss is logged as ``nonprivate/train_loss``: it is computed from the
    private batch and is not differentially private. Validation and test metrics are
    computed on held-out data.

    Args:
        model: The network, mapping images to logits.
        num_classes: Number of classes.
        optimizer: Optimizer factory taking the parameters (``class_path`` in configs).
    """

    def __init__(self, model: nn.Module, num_classes: int = 10, optimizer: OptimizerCallable | None = None) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return training_loss(self, F.cross_entropy(self(x), y, reduction="none"))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: tuple[Tensor, Tensor] | Tensor, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return self.optimizer(self.parameters())
