"""DPGrape's and DPMuon's declared state sizes (DeclaresStateSize) against the state two real DP steps leave."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from dplightning.optim import DPGrape, DPMuon
from dplightning.protocols import DeclaresStateSize
from tests.helpers import TinyModule, dp, make_dataset, make_trainer


class Net(nn.Module):
    """``up`` is tall and ``down`` wide (DP-GRAPE projects both), ``head`` stays full (both optimizers' exclude)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(6, 8), nn.Linear(8, 6), nn.Linear(6, 3)
        self.down.bias.requires_grad_(False)  # frozen: neither privatized nor given state

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


class DeclaredBeforeTheFirstStep(pl.Callback):
    """Keeps what the optimizer declares once the strategy has bound it and asked its DP plan, before any step."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        assert not optimizer.state
        self.declared = optimizer.state_elements()


def held(optimizer: torch.optim.Optimizer) -> Counter[torch.dtype]:
    """Elements of every tensor in the optimizer's state, by dtype."""
    out: Counter[torch.dtype] = Counter()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                out[value.dtype] += value.numel()
    return out


def nbytes(elements: dict[torch.dtype, int]) -> int:
    return sum(n * dtype.itemsize for dtype, n in elements.items())


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "dp-grape": lambda params: DPGrape(params, lr=0.01, rank=3, refresh_every=1),
    "dp-grape-unprojected": lambda params: DPGrape(params, lr=0.01, rank=7),  # the rank exceeds every weight's side
    "dp-muon": lambda params: DPMuon(params, lr=0.02, adam_lr=0.01),
    "dp-muonbc": lambda params: DPMuon(params, lr=0.02, adam_lr=0.01, bias_correction=True),
    "dp-muon-adamw-arm": lambda params: DPMuon(params, matrix_update="adamw"),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_declared_state_is_the_state_two_dp_steps_leave(name: str, precision: str) -> None:
    torch.manual_seed(0)
    module = TinyModule(net=Net(), optimizer=OPTIMIZERS[name])
    declared = DeclaredBeforeTheFirstStep()
    trainer = make_trainer(dp(noise_multiplier=0.5), max_steps=2, precision=precision, callbacks=[declared])
    trainer.fit(module, DataLoader(make_dataset(12), batch_size=12))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, DeclaresStateSize)
    assert trainer.global_step == 2
    weights = torch.float32 if precision == "32-true" else torch.bfloat16
    assert all(p.dtype == weights for p in module.parameters())
    measured = held(optimizer)
    assert nbytes(declared.declared) == nbytes(measured) > 0
    assert declared.declared == dict(measured) == optimizer.state_elements()
    if name == "dp-grape":  # the projected slots, not the weights, carry the moments
        assert len(optimizer.projections) == 2
        assert sum(measured.values()) < 2 * sum(p.numel() for p in module.parameters() if p.requires_grad)
