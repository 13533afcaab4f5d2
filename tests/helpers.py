"""Test helpers: a tiny LightningModule, synthetic data and a quiet Trainer."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning


def make_dataset(n: int = 64, features: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Gaussian features with labels from a random linear rule."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def mlp(features: int = 6, classes: int = 3, hidden: int = 5) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))


class TinyModule(pl.LightningModule):
    """Cross-entropy on any network; records the batches it trained on.

    Args:
        net: The network.
        lr: SGD learning rate (1.0 makes the update equal to the released gradient).
        zero_loss: Use ``0 * output.sum()`` so that every data gradient is zero.
        optimizer: ``"sgd"`` or a factory ``params -> Optimizer``.
    """

    def __init__(self, net: nn.Module | None = None, lr: float = 1.0, zero_loss: bool = False,
                 optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> None:
        super().__init__()
        self.net = net if net is not None else mlp()
        self.lr = lr
        self.zero_loss = zero_loss
        self.make_optimizer = optimizer
        self.batches: list[tuple[Tensor, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return 0.0 * out.sum() if self.zero_loss else F.cross_entropy(out, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.batches.append((x.detach().clone(), y.detach().clone()))
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.make_optimizer is not None:
            return self.make_optimizer(self.parameters())
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(dataset: TensorDataset, batch_size: int = 16, **kwargs: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, **kwargs)


def make_trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, max_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


def dp(**kwargs: Any) -> dplightning.DPStrategy:
    kwargs.setdefault("noise_multiplier", 0.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 warns by design
        return dplightning.DPStrategy(**kwargs)


def params_of(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}
