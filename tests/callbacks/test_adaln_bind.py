"""AdaLNBindFractions: exact shares on constructed inputs, training batches only, nonprivate/ logs, no hook when off."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

import dplightning
from dplightning.callbacks import AdaLNBindFractions
from dplightning.callbacks.adaln_bind import PREFIX, coordinate_binds, projection_binds
from dplightning.data import ETTDataModule
from dplightning.models import TimeSeriesDiT
from dplightning.models.adaln import bound, modulation_chunks
from dplightning.tasks import DPTimeSeriesDiffusion
from dplightning.tasks.timeseries_diffusion import forecast_mask
from tests.data.test_ett import MONTH, write_csv
from tests.helpers import make_trainer

D = 16


def network(**bounds: Any) -> TimeSeriesDiT:
    net = TimeSeriesDiT(num_features=3, hidden=D, depth=2, heads=2, mlp_ratio=2.0, position_dim=8, **bounds)
    g = torch.Generator().manual_seed(0)
    for name, p in net.named_parameters():  # trained-looking weights: the modulation leaves its zero init
        if "adaLN_modulation" in name or "t_embedder" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.5
    return net


def test_the_counting_functions_are_exact() -> None:
    c = torch.zeros(5, 4)
    c[:, 0] = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0])  # norms 0.5 ... 3
    binding, total = projection_binds(c, 1.5)
    assert (int(binding), total) == (2, 5)  # strictly above the radius: 2.0 and 3.0
    raw = torch.tensor([[-3.0, -1.0, 0.0, 1.0, 1.0001, 2.0]])
    binding, total = coordinate_binds(raw, 1.0)
    assert (int(binding), total) == (3, 6)


def test_the_hooks_count_what_the_network_computes(tmp_path: Path) -> None:
    """The shares equal those recomputed by hand from c̃ and the raw modulation of the same forward."""
    net = network(c_max=3.0, gamma_max=0.5, beta_max=1.0, alpha_max=0.25, bound_mode="hard")
    callback = AdaLNBindFractions()
    assert callback.attach(net) == ["projection", "gamma", "beta", "alpha"]
    callback._trainer = SimpleNamespace(strategy=None)  # type: ignore[assignment]  # no DP state: never probing
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 12, 3, generator=g) * torch.logspace(-1, 1, 32).view(-1, 1, 1)
    cond, t = forecast_mask(torch.ones_like(x), 4), torch.randint(0, 50, (32,), generator=g)
    c_tilde = net.t_embedder(t) + net.ctx_encoder(cond * x, cond)
    net.projection.c_max = float(c_tilde.norm(dim=1).median())  # the ball cuts the batch in two
    c = net.projection(c_tilde)
    callback._armed = True  # as between on_train_batch_start and _end
    net((1 - cond) * x, cond * x, cond, t)
    callback._armed = False
    counts = {name: (int(v[0]), int(v[1])) for name, v in callback._window.items()}
    assert counts["projection"] == (int((c_tilde.norm(dim=1) > net.c_max).sum()), 32)
    expected = {"gamma": [0, 0], "beta": [0, 0], "alpha": [0, 0]}
    for layer in [*net.blocks, net.final_layer]:
        for kind, chunk in modulation_chunks(layer.adaLN_modulation(c), layer.MODULATION_KINDS):
            changed = bound(chunk, layer.bounds.limit(kind), "hard") != chunk  # a hard bound binds where it clamps
            expected[kind][0] += int(changed.sum())
            expected[kind][1] += chunk.numel()
    assert counts == {"projection": counts["projection"], **{k: tuple(v) for k, v in expected.items()}}
    assert 0 < counts["gamma"][0] < counts["gamma"][1] and 0 < counts["projection"][0] < 32  # not all or nothing
    assert counts["alpha"][1] == 2 * 2 * D * 32  # two gates per block, none in the final layer
    net((1 - cond) * x, cond * x, cond, t)  # outside a training batch: not counted
    assert {name: (int(v[0]), int(v[1])) for name, v in callback._window.items()} == counts
    callback.detach()
    assert not any(m._forward_hooks for m in net.modules())


def test_only_the_bounds_a_network_has_are_watched() -> None:
    callback = AdaLNBindFractions()
    assert callback.attach(network(c_max=3.0, beta_max=1.0)) == ["projection", "beta"]
    assert callback.attach(network()) == []  # DP-vanilla: nothing to hook


class BatchRows(pl.Callback):
    """The rows of every real training batch (Lightning's own hook: the coupling probe never calls it)."""

    def __init__(self) -> None:
        self.rows = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.rows += len(batch)


def fit(tmp_path: Path, callbacks: list[pl.Callback], dp: bool, **bounds: Any) -> DPTimeSeriesDiffusion:
    torch.manual_seed(0)
    write_csv(tmp_path / "ETTh1.csv")
    dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH, batch_size=16,
                       max_val_windows=8)  # fmt: skip
    net = TimeSeriesDiT(num_features=7, hidden=16, depth=1, heads=2, mlp_ratio=2.0, position_dim=8, **bounds)
    module = DPTimeSeriesDiffusion(net, horizon=4, n_samples=2)
    strategy = dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0) if dp else "auto"
    logger = CSVLogger(str(tmp_path), name="run")
    trainer = make_trainer(strategy, max_steps=5, callbacks=callbacks, logger=logger, val_check_interval=2,
                           limit_val_batches=1)  # fmt: skip
    trainer.fit(module, dm)
    return module


def test_a_dp_fit_logs_the_shares_of_its_real_training_examples_under_nonprivate(tmp_path: Path) -> None:
    bind, rows = AdaLNBindFractions(every_n_steps=2), BatchRows()
    module = fit(tmp_path, [bind, rows], dp=True, c_max=0.5, gamma_max=1e-4, beta_max=1e-4, alpha_max=1e-4)
    # Every real example once: not the coupling probe's replay, not the validation batches, not the sampler.
    assert bind.run_counts["projection"][1] == rows.rows > 0
    assert bind.run_counts["gamma"][1] == rows.rows * 3 * 16  # one block (2 scales) and the final layer (1)
    assert [r.step for r in bind.history] == [2, 4, 5]
    assert set(bind.run_fractions) == {"projection", "gamma", "beta", "alpha"}
    assert all(0.0 <= v <= 1.0 for v in bind.run_fractions.values())
    assert bind.run_fractions["projection"] > 0.5  # ‖t_emb‖ alone is about 1 > 0.5
    with open(next(tmp_path.rglob("metrics.csv")), newline="") as f:
        columns = set(next(csv.reader(f)))
    assert {f"{PREFIX}/projection", f"{PREFIX}/run/gamma"} <= columns
    assert all(c.startswith("nonprivate/") for c in columns if "adaln_bind" in c)
    assert not any(m._forward_hooks for m in module.modules())  # removed at the end


def test_disabled_registers_no_hook_and_logs_nothing(tmp_path: Path) -> None:
    seen: list[int] = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            seen.append(sum(len(m._forward_hooks) for m in pl_module.modules()))

    bind = AdaLNBindFractions(enabled=False)
    fit(tmp_path, [bind, Spy()], dp=False, c_max=0.5, gamma_max=1e-4)
    assert seen and not any(seen) and bind.run_counts == {} and bind.history == []
    with open(next(tmp_path.rglob("metrics.csv")), newline="") as f:
        assert not any("adaln_bind" in c for c in next(csv.reader(f)))


def test_every_n_steps_is_validated() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        AdaLNBindFractions(every_n_steps=0)
