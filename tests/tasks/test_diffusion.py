"""DPDiffusion: noise multiplicity as one privacy unit per image, through a real Trainer, against torch.func."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.models import NCSNppUNet
from dplightning.tasks import DPDiffusion
from tests.helpers import dp, make_trainer, params_of

B, K, C = 6, 4, 0.05


def tiny_net() -> NCSNppUNet:
    net = NCSNppUNet(image_size=4, nf=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(2,), num_classes=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # no zero-initialised layers: every parameter gets a gradient
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return net


class _Recording(DPDiffusion):
    """Records the images, (dropped) labels and noise draws of each training step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(tiny_net(), num_classes=3, optimizer=lambda p: torch.optim.SGD(p, lr=1.0), **kwargs)
        self.records: list[dict[str, Tensor]] = []

    def drop_labels(self, labels, generator=None):
        dropped = super().drop_labels(labels, generator)
        self.records.append({"labels": dropped.clone()})
        return dropped

    def draw_noise(self, rows, generator=None):
        sigma, noise = super().draw_noise(rows, generator)
        if self.training:
            self.records[-1].update(rows=rows.detach().clone(), sigma=sigma.clone(), noise=noise.clone())
        return sigma, noise


def images(n: int = B) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def reference_grads(module: DPDiffusion, before: dict[str, Tensor], rec: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Per draw, the gradient of ℓ_ik by torch.func, for every image i (``[B][K]`` dicts)."""
    params = {n.removeprefix("denoiser."): v for n, v in before.items() if n.startswith("denoiser.")}

    def draw_loss(p, x, y, s, n):  # the spec's ℓ(x, σ, n) = mean over pixels of λ(σ)·(D(x + σn; σ, y) − x)²
        denoised = functional_call(module.denoiser, p, ((x + s * n)[None], s[None], y[None]))[0]
        return module.denoiser.precond.weight(s) * (denoised - x).square().mean()

    labels = rec["labels"].repeat_interleave(K)
    rows = vmap(grad(draw_loss), in_dims=(None, 0, 0, 0, 0))(params, rec["rows"], labels, rec["sigma"], rec["noise"])
    return [[{n: g[r] for n, g in rows.items()} for r in range(i * K, (i + 1) * K)] for i in range(B)]


def test_each_image_is_one_unit_whose_gradient_is_the_mean_over_its_draws_clipped_once() -> None:
    torch.manual_seed(0)
    module = _Recording(noise_multiplicity=K, label_dropout=0.5)
    before = params_of(module)
    make_trainer(dp(noise_multiplier=0.0, max_grad_norm=C)).fit(module, DataLoader(images(), batch_size=B))
    rec = module.records[0]
    assert len(rec["rows"]) == B * K
    assert torch.equal(rec["rows"][::K], rec["rows"][K - 1 :: K])  # an image's K rows are consecutive
    draws = reference_grads(module, before, rec)
    # The image's loss is the mean over its K draws; torch.func on that loss = the mean of the per-draw gradients.
    units = [{n: torch.stack([d[n] for d in ds]).mean(0) for n in ds[0]} for ds in draws]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in u.values())) for u in units])
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    assert (factors < 1).all()  # every image is clipped
    stats = module.trainer.strategy.last_step_stats[0]
    assert stats.norms.shape[0] == B  # B norms (one per image), not B·K
    torch.testing.assert_close(stats.norms[:, 0], norms, rtol=1e-4, atol=1e-7)
    released = {}
    for name, p in module.named_parameters():
        key = name.removeprefix("denoiser.")
        expected = sum(f * u[key] for f, u in zip(factors, units)) / B
        torch.testing.assert_close(before[name] - p.detach(), expected, rtol=1e-4, atol=1e-7)
        released[key] = before[name] - p.detach()
    # Each image's clipped contribution has norm <= C, so the released mean has norm <= C.
    assert math.sqrt(sum(v.square().sum() for v in released.values())) <= C + 1e-6
    # Clipping rows separately would give another update: the test tells units from rows apart.
    rows = [d for ds in draws for d in ds]
    row_factors = [min(1.0, C / (math.sqrt(sum(float(g.square().sum()) for g in d.values())) + 1e-6)) for d in rows]
    per_row = sum(f * d["net.conv_in.weight"] for f, d in zip(row_factors, rows)) / (B * K)
    assert not torch.allclose(per_row, released["net.conv_in.weight"], rtol=1e-2)


def test_the_label_drop_is_decided_once_per_image() -> None:
    module = _Recording(noise_multiplicity=K, label_dropout=0.5)
    y = torch.arange(200) % 3
    dropped = module.drop_labels(y, torch.Generator().manual_seed(0))
    assert 0.35 < (dropped == 3).float().mean() < 0.65  # about half the images lose their label
    # The K rows of one image carry its one decision.
    x = torch.rand(200, 1, 4, 4)
    module.train()
    module.per_example_loss(x * 2 - 1, dropped)
    assert len(module.records[-1]["rows"]) == 200 * K


@pytest.mark.parametrize("k", [0, 1.5])
def test_a_bad_noise_multiplicity_is_refused(k) -> None:
    with pytest.raises(ValueError, match="noise_multiplicity"):
        DPDiffusion(tiny_net(), noise_multiplicity=k)


def _fit_tiny(k: int, steps: int = 2, **strategy) -> DPDiffusion:
    module = DPDiffusion(tiny_net(), noise_multiplicity=k, num_classes=3)
    make_trainer(dplightning.DPStrategy(**strategy), max_steps=steps).fit(module, DataLoader(images(24), batch_size=8))
    return module


def test_the_privacy_cost_does_not_depend_on_k() -> None:
    one, four = (_fit_tiny(k, target_epsilon=4.0, accountant="gdp") for k in (1, 4))
    s1, s4 = one.trainer.strategy, four.trainer.strategy
    assert s1.ledger.history == s4.ledger.history and s1.steps == s4.steps == 2
    assert s1.get_epsilon() == s4.get_epsilon()


def test_a_short_dp_run_on_digits_lowers_the_loss_and_writes_samples(tmp_path) -> None:
    import lightning.pytorch as pl

    from dplightning.data import DigitsDataModule, LabelsDataModule, SyntheticDataWriter
    from dplightning.data.synthetic import load_synthetic

    torch.manual_seed(0)
    net = NCSNppUNet(image_size=8, nf=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,))
    module = DPDiffusion(net, noise_multiplicity=2, sampling_steps=6, optimizer=lambda p: torch.optim.Adam(p, lr=3e-3))
    dm = DigitsDataModule(batch_size=32)
    dm.setup("fit")
    x, y = next(iter(DataLoader(dm.val_set, batch_size=128)))

    def fixed_loss() -> float:  # the current weights on fixed held-out images, σ and noise
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            return float(module.per_example_loss(x * 2 - 1, y, g).mean())

    before = fixed_loss()
    make_trainer(
        dp(noise_multiplier=0.5, seed=0, accountant="gdp"),
        max_steps=20,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    ).fit(module, dm)
    assert fixed_loss() < 0.9 * before
    assert module.ema.updates == 20  # one EMA update per optimizer step
    grid = module.log_sample_grid()  # what on_validation_epoch_end writes every grid_every_n_epochs
    assert grid == tmp_path / "samples" / f"epoch={module.current_epoch}.png"
    from PIL import Image

    assert Image.open(grid).size == (4 * (10 * 9 + 1),) * 2  # 10 classes × 10 samples, 8×8 + 1 px padding, 4× scale
    writer = SyntheticDataWriter(str(tmp_path / "synthetic"))
    pl.Trainer(logger=False, callbacks=[writer], enable_progress_bar=False).predict(
        module, LabelsDataModule(num_samples=20, batch_size=10), return_predictions=False
    )
    images_, labels = load_synthetic(tmp_path / "synthetic" / "synthetic.pt")
    assert images_.shape == (20, 1, 8, 8) and labels.tolist() == [i % 10 for i in range(20)]
    assert 0 <= float(images_.min()) and float(images_.max()) <= 1 and float(images_.std()) > 0
    assert (tmp_path / "synthetic" / "grid.png").is_file()


def test_sample_grids_are_written_every_n_epochs_and_reach_a_logger_that_takes_images(tmp_path) -> None:
    class ImageLogger(pl.loggers.CSVLogger):  # the add_images call of TensorBoard's SummaryWriter, recorded
        def __init__(self, root: str) -> None:
            super().__init__(root)
            self.images: list[tuple[str, tuple[int, ...], int]] = []

        @property
        def experiment(self):
            experiment = super().experiment
            experiment.add_images = lambda tag, x, step: self.images.append((tag, tuple(x.shape), step))
            return experiment

    module = DPDiffusion(tiny_net(), num_classes=3, sampling_steps=2, grid_every_n_epochs=2)
    logger = ImageLogger(str(tmp_path))
    trainer = make_trainer(dp(accountant="gdp"), max_epochs=4, max_steps=-1, logger=logger, limit_val_batches=1)
    trainer.fit(module, DataLoader(images(8), batch_size=8), DataLoader(images(8), batch_size=8))
    written = sorted(p.name for p in (Path(trainer.log_dir) / "samples").glob("*.png"))
    assert written == ["epoch=1.png", "epoch=3.png"]  # after the 2nd and 4th epochs
    assert [(tag, step) for tag, _, step in logger.images] == [("samples", 1), ("samples", 3)]
    assert logger.images[0][1] == (30, 1, 4, 4)  # 10 per class, 3 classes
