"""Add privacy to an existing Lightning project: a plain classifier, then a three-line change.

Trains SmallCNN on the bundled 8x8 digits with DP-SGD until ε = 4 is spent, and saves the
(non-private) clipping and gradient-tail figures next to the CSV logs. About 1.5 minutes on CPU.

    python examples/add_privacy_to_lightning.py                         # logs under lightning_logs/privacy_demo
    python examples/add_privacy_to_lightning.py --figures docs/figures  # also copy the PNGs there

See docs/add_privacy_to_a_lightning_project.md.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

from dplightning.data import DigitsDataModule  # a plain LightningDataModule (1,258 training images)
from dplightning.models import SmallCNN  # a plain nn.Module (no BatchNorm)


class DigitsClassifier(pl.LightningModule):
    """The existing project: an ordinary LightningModule with no DP code in it."""

    def __init__(self, lr: float = 2.0) -> None:
        super().__init__()
        self.net = SmallCNN()
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y, reduction="sum") / max(len(y), 1)  # Poisson batches can be empty
        self.log("nonprivate/train_loss", loss)  # computed on the private batch: not private
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", type=Path, default=None, help="Also copy the PNG figures to this folder.")
    parser.add_argument("--epsilon", type=float, default=4.0, help="Budget: training stops before exceeding it.")
    args = parser.parse_args()
    pl.seed_everything(0)  # model init only: DP noise and Poisson sampling draw from OS entropy

    from dplightning.callbacks import ClippingHistogram, GradientTailStats, PrivacyBudget  # (1) import

    histogram, tails = ClippingHistogram(every_n_steps=5), GradientTailStats(every_n_steps=20)
    trainer = pl.Trainer(
        strategy="dp",  # (2) DP-SGD: Poisson sampling, clipping (C = 1), Gaussian noise (σ = 1)
        callbacks=[PrivacyBudget(target_epsilon=args.epsilon), histogram, tails],  # (3) ε budget and statistics
        max_epochs=30,
        accelerator="cpu",
        logger=CSVLogger("lightning_logs", name="privacy_demo"),
        log_every_n_steps=5,
        enable_checkpointing=False,
    )
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=64))
    for path in (histogram.figure_path, tails.figure_path):
        print(f"saved {path}")
        if args.figures is not None and path is not None:
            args.figures.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, args.figures / path.name)


if __name__ == "__main__":
    main()
