"""scikit-learn's bundled 8x8 digits (1,797 images), the embedded default data set."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset


class DigitsDataModule(pl.LightningDataModule):
    """Handwritten digits 0-9 as ``[1, 8, 8]`` float images in [0, 1], split train/val/test.

    The split is a fixed permutation (public randomness, ``split_seed``); the privacy
    unit is one image of the training split.

    Args:
        batch_size: Expected batch size of the train loader; under DP training, the
            Poisson rate is ``batch_size / len(train split)``.
        val_fraction: Share of the 1,797 images held out for validation.
        test_fraction: Share held out for testing.
        split_seed: Seed of the split permutation.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 <= val_fraction < 1 or not 0 < test_fraction < 1 or val_fraction + test_fraction >= 1:
            raise ValueError("val_fraction and test_fraction must be in [0, 1) and sum to less than 1.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits  # imported lazily: scikit-learn is slow to import

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        full = TensorDataset(images, labels)
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(self.hparams.split_seed)).tolist()
        n_test = round(self.hparams.test_fraction * len(full))
        n_val = round(self.hparams.val_fraction * len(full))
        self.test_set = Subset(full, order[:n_test])
        self.val_set = Subset(full, order[n_test : n_test + n_val])
        self.train_set = Subset(full, order[n_test + n_val :])

    dp_privacy_unit = "one training image (8x8) with its label"
    """What one privacy unit is, for checkpoints, ``privacy-report`` and exports."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
