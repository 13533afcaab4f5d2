"""The cyclic sampler's part follows the release index across epochs, cuts and reloads (privacy round 4, 40.1/40.2).

A correlated mechanism's sensitivity assumes that an example participates at most once every
``p`` releases. Each test records which examples each release used and checks that separation
directly, from the batches the module saw (not from the sampler's own bookkeeping).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from tests.helpers import TinyModule, loader, make_dataset, make_trainer

P, N, BATCH = 4, 16, 4  # rate within a part p * B / N = 1: a release takes its whole part


def _strategy(mechanism: str) -> dplightning.DPStrategy:
    extra: dict[str, Any] = dict(bands=P) if mechanism == "band_mf" else dict(blt_buffers=1, cyclic_partitions=P)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dplightning.DPStrategy(noise_mechanism=mechanism, noise_multiplier=0.0, seed=4, **extra)


class _CutsEveryEpoch(TinyModule):
    """Ends every epoch after its first batch and remembers the release index of each batch trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.release_of: list[int] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx == 1 else None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not self.trainer.strategy.dp_state.probing:
            self.release_of.append(self.trainer.strategy.dp_state.steps)
        return super().training_step(batch, batch_idx)


def _min_gap(module: TinyModule, release_of: list[int]) -> int:
    """The smallest distance between two releases that share an example (rows identify examples)."""
    seen: dict[tuple[float, ...], int] = {}
    gap = 10**9
    for (x, _), t in zip(module.batches, release_of):
        for row in x:
            key = tuple(row.tolist())
            if key in seen and seen[key] != t:
                gap = min(gap, t - seen[key])
            seen[key] = t
    return gap


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_an_epoch_cut_after_one_batch_continues_the_cycle(mechanism: str) -> None:
    torch.manual_seed(0)
    module = _CutsEveryEpoch()
    trainer = make_trainer(_strategy(mechanism), max_epochs=12, max_steps=-1)
    trainer.fit(module, loader(make_dataset(N), BATCH))
    assert trainer.strategy.dp_state.steps == 12
    assert len(module.batches) == 12
    assert _min_gap(module, module.release_of) >= P


class _Curriculum(pl.LightningDataModule):
    """A new data set at every reload: the same size, another order (a curriculum)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = make_dataset(N)
        self.reloads = 0

    def train_dataloader(self) -> DataLoader:
        self.reloads += 1
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.reloads))
        x, y = self.base.tensors
        return DataLoader(TensorDataset(x[order], y[order]), batch_size=BATCH, shuffle=True)


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_a_reloaded_loader_with_another_data_set_is_refused(mechanism: str) -> None:
    trainer = make_trainer(_strategy(mechanism), max_epochs=3, max_steps=-1, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(ValueError, match="another data set"):
        trainer.fit(TinyModule(), datamodule=_Curriculum())
    assert trainer.strategy.dp_state.steps == P  # refused before the first step of the second epoch


class _SameData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.data = make_dataset(N)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=BATCH, shuffle=True)


def test_a_reloaded_loader_over_the_same_data_set_trains() -> None:
    module = _CutsEveryEpoch()
    trainer = make_trainer(_strategy("band_mf"), max_epochs=6, max_steps=-1, reload_dataloaders_every_n_epochs=1)
    trainer.fit(module, datamodule=_SameData())
    assert trainer.strategy.dp_state.steps == 6
    assert _min_gap(module, module.release_of) >= P
