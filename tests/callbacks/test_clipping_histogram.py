"""ClippingHistogram counts every example once and agrees with per-example norms computed independently."""

from __future__ import annotations

import csv
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dplightning.callbacks import ClippingHistogram
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import per_example_grads

N, BATCH = 64, 16


def _fit(callback: ClippingHistogram, module: pl.LightningModule | None = None, data: DataLoader | None = None,
         **kwargs) -> pl.Trainer:  # fmt: skip
    strategy = dp(seed=0, max_grad_norm=kwargs.pop("max_grad_norm", 1.0), clipping=kwargs.pop("clipping", "flat"))
    trainer = make_trainer(strategy, callbacks=[callback], **kwargs)
    trainer.fit(module or TinyModule(lr=0.3), data or loader(make_dataset(N), BATCH))
    return trainer


@pytest.mark.parametrize(("k", "every"), [(1, 1), (2, 3)])
def test_counts_sum_to_the_examples_seen(k: int, every: int) -> None:
    module = TinyModule(lr=0.3)
    callback = ClippingHistogram(every_n_steps=every, save_figure=False)
    trainer = _fit(callback, module, max_steps=7, accumulate_grad_batches=k)
    seen = sum(len(x) for x, _ in module.batches)
    assert [r.step for r in callback.history] == [*range(every, 7 + 1, every), *([7] if 7 % every else [])]
    assert sum(int(r.counts.sum()) for r in callback.history) == sum(r.examples for r in callback.history) == seen
    assert all(int(r.counts.sum()) == r.examples for r in callback.history)
    assert trainer.global_step == 7


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_first_step_matches_reference_per_example_norms(clipping: str) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    before = params_of(module)
    callback = ClippingHistogram(bins=8, range_max=2.0, save_figure=False)
    _fit(callback, module, max_grad_norm=0.5, clipping=clipping)
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = (torch.cat(t) for t in zip(*module.batches, strict=True))
    grads = per_example_grads(net, F.cross_entropy, x, y)
    groups = [["0.weight", "0.bias"], ["2.weight", "2.bias"]] if clipping == "per_layer" else [list(grads)]
    bound = 0.5 / math.sqrt(len(groups))
    ratios = np.stack([torch.stack([grads[n].flatten(1).pow(2).sum(1) for n in g]).sum(0).sqrt().numpy() / bound
                       for g in groups], axis=1)  # fmt: skip
    edges = callback.edges.numpy()
    (record,) = callback.history
    for j in range(len(groups)):
        bins = np.searchsorted(edges[1:], ratios[:, j], side="left")  # (e_{j-1}, e_j], last bin open
        assert record.counts[j].tolist() == np.bincount(bins, minlength=len(edges)).tolist()
        assert record.clipped[j] == (ratios[:, j] > 1).sum()
    assert record.clip_fraction == pytest.approx((ratios > 1).any(axis=1).mean())


class LinearProbe(pl.LightningModule):
    """loss_i = w·x_i, so the per-example gradient is x_i itself and ‖g_i‖ = ‖x_i‖ is known in advance."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.w = nn.Linear(features, 1, bias=False)
        self.seen: list[Tensor] = []

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        if not self.trainer.strategy.dp_state.probing:  # the coupling probe's replay is not a trained batch
            self.seen.append(x.detach().clone())
        return self.w(x).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_clip_fraction_equals_the_hand_computed_fraction() -> None:
    g = torch.Generator().manual_seed(1)
    directions = F.normalize(torch.randn(N, 5, generator=g), dim=1)
    norms = torch.tensor([0.25, 0.5, 0.9, 1.1, 1.5, 3.0, 8.0, 0.75]).repeat(N // 8)  # C = 1: known clipped set
    module = LinearProbe(5)
    callback = ClippingHistogram(save_figure=False)
    data = DataLoader(TensorDataset(directions * norms.unsqueeze(1)), batch_size=BATCH, shuffle=True)
    _fit(callback, module, data, max_steps=6)
    assert len(module.seen) == len(callback.history) == 6  # no empty batch: one recorded batch per step
    for x, record in zip(module.seen, callback.history, strict=True):
        assert record.clip_fraction == pytest.approx((x.norm(dim=1) > 1.0).float().mean().item())


def test_logs_nonprivate_columns_and_saves_the_figure(tmp_path) -> None:
    callback = ClippingHistogram(every_n_steps=2, bins=4, range_max=2.0)
    trainer = _fit(callback, logger=CSVLogger(tmp_path), max_steps=4)
    rows = list(csv.DictReader(open(f"{trainer.log_dir}/metrics.csv")))
    keys = {k for row in rows for k, v in row.items() if v}
    expected = {"nonprivate/clip_fraction", *(f"nonprivate/norm_over_C/all/{b}" for b in
                ["0.00-0.50", "0.50-1.00", "1.00-1.50", "1.50-2.00", "2.00-inf"])}  # fmt: skip
    assert expected <= keys
    assert not {k for k in keys if "norm" in k or "clip" in k} - expected  # nothing outside nonprivate/
    fractions = [float(r["nonprivate/clip_fraction"]) for r in rows if r.get("nonprivate/clip_fraction")]
    assert fractions == pytest.approx([r.clip_fraction for r in callback.history], rel=1e-6)
    assert callback.figure_path == tmp_path / "lightning_logs" / "version_0" / "nonprivate_clipping.png"
    assert callback.figure_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_gets_histograms(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = ClippingHistogram(every_n_steps=1, save_figure=False)
    trainer = _fit(callback, logger=TensorBoardLogger(tmp_path), max_steps=3)
    events = EventAccumulator(trainer.log_dir, size_guidance={"histograms": 0})
    events.Reload()
    histograms = events.Histograms("nonprivate/norm_over_C/all")
    assert [int(h.histogram_value.num) for h in histograms] == [r.examples for r in callback.history]
    assert "nonprivate/clip_fraction" in events.Tags()["scalars"]


def test_disabled_does_nothing_even_without_a_dp_strategy(tmp_path) -> None:
    callback = ClippingHistogram(enabled=False)
    trainer = make_trainer("auto", callbacks=[callback], max_steps=2, default_root_dir=tmp_path)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    assert callback.history == [] and callback.figure_path is None and not list(tmp_path.rglob("*.png"))


def test_needs_a_dp_strategy() -> None:
    with pytest.raises(TypeError, match="strategy='dp'"):
        make_trainer("auto", callbacks=[ClippingHistogram()]).fit(TinyModule(), loader(make_dataset(N), BATCH))
