"""Synthetic labelled image sets: the labels to generate for (predict), PNG grids, and the file a run releases.

A released set is one ``torch.save`` file ``{"images": uint8 [N, C, H, W], "labels": int64 [N]}``
plus a PNG grid of its first rows; :func:`load_synthetic` reads it back as float images in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from dplightning.data.prediction_writer import run_folder


def image_grid(images: Tensor, nrow: int = 10, pad: int = 1) -> np.ndarray:
    """``[N, C, H, W]`` floats in [0, 1] -> one ``uint8`` grid image (``[h, w]`` grey or ``[h, w, 3]``)."""
    n, c, h, w = images.shape
    cols = min(nrow, max(n, 1))
    rows = -(-n // cols)
    grid = torch.ones(c, rows * (h + pad) + pad, cols * (w + pad) + pad)
    for i, img in enumerate(images.detach().float().clamp(0, 1).cpu()):
        r, k = divmod(i, cols)
        grid[:, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + k * (w + pad) : pad + k * (w + pad) + w] = img
    out = (grid * 255).round().byte().permute(1, 2, 0).numpy()
    return out[..., 0] if c == 1 else out


def save_grid(images: Tensor, path: str | Path, nrow: int = 10, scale: int = 1) -> Path:
    """Write :func:`image_grid` as a PNG, each pixel enlarged ``scale`` times (nearest)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(image_grid(images, nrow))
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    img.save(path)
    return path


def class_sorted(images: Tensor, labels: Tensor, per_class: int = 10) -> Tensor:
    """The first ``per_class`` images of each class, one class per row (for grids)."""
    rows = [images[labels == c][:per_class] for c in labels.unique().tolist()]
    return torch.cat(rows) if rows else images[:0]


def save_synthetic(images: Tensor, labels: Tensor, directory: str | Path, nrow: int = 10) -> tuple[Path, Path]:
    """Write ``synthetic.pt`` (uint8 images, labels) and ``grid.png`` (10 per class) under ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = {"images": (images.clamp(0, 1) * 255).round().byte().cpu(), "labels": labels.long().cpu()}
    tensor_path = directory / "synthetic.pt"
    torch.save(data, tensor_path)
    grid_path = save_grid(class_sorted(images, labels, nrow), directory / "grid.png", nrow, scale=4)
    return tensor_path, grid_path


def load_synthetic(path: str | Path) -> tuple[Tensor, Tensor]:
    """Images (float in [0, 1]) and labels of a set written by :func:`save_synthetic`."""
    data = torch.load(path, weights_only=True)
    return data["images"].float() / 255, data["labels"]


def balanced_labels(n: int, num_classes: int) -> Tensor:
    """``n`` labels cycling 0..num_classes−1 (a class-balanced synthetic set)."""
    return torch.arange(n) % num_classes


class LabelsDataModule(pl.LightningDataModule):
    """Predict-only data: the class labels to generate one image each for (``dplightning predict``).

    Args:
        num_samples: Size of the synthetic set.
        num_classes: Classes, cycled so the set is balanced.
        batch_size: Labels per predict batch (images sampled per network call).
    """

    def __init__(self, num_samples: int = 1000, num_classes: int = 10, batch_size: int = 500) -> None:
        super().__init__()
        if num_samples < 1 or num_classes < 1:
            raise ValueError(f"num_samples and num_classes must be >= 1, got {num_samples}, {num_classes}.")
        self.num_samples, self.num_classes, self.batch_size = num_samples, num_classes, batch_size

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(
            TensorDataset(balanced_labels(self.num_samples, self.num_classes)), batch_size=self.batch_size
        )


class SyntheticDataWriter(BasePredictionWriter):
    """Collects ``{"images", "labels"}`` predictions and writes them with :func:`save_synthetic` at the end.

    Args:
        output_dir: Where ``synthetic.pt`` and ``grid.png`` go; default ``<trainer.log_dir>/synthetic``
            (see :func:`~dplightning.data.prediction_writer.run_folder`).
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def write_on_epoch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        batches = predictions[0] if predictions and isinstance(predictions[0], list) else predictions
        images = torch.cat([b["images"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        folder = self.output_dir or run_folder(trainer) / "synthetic"
        tensor_path, grid_path = save_synthetic(images, labels, folder)
        print(f"Wrote {len(labels)} synthetic images to {tensor_path} (grid: {grid_path}).")
