"""Optimizer DP plans and privacy units of several rows, through a real Trainer, against torch.func."""

from __future__ import annotations

import logging
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from dplightning.privacy.noise import GaussianNoise
from examples.dp_plan_optimizer import ProjectedSGD
from tests.helpers import TinyModule, dp, make_dataset, make_trainer, mlp, params_of
from tests.reference import clipped_sum, per_example_grads

N = 12


class _KeepsRelease(ProjectedSGD):
    def dp_release(self, release) -> None:
        super().dp_release(release)
        self.kept = (
            {p: s.clone() for p, s in release.slots.items()},
            release.noise_std,
            [g.max_norm for g in release.groups],
            release.step,
        )


def test_a_plan_receives_the_projected_clipped_sum_plus_noise_of_the_stated_std(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sigma, c = 0.7, 0.5
    torch.manual_seed(0)
    module = TinyModule(optimizer=lambda params: _KeepsRelease(params, lr=0.1, rank=2))
    before = params_of(module)
    data = DataLoader(make_dataset(N), batch_size=N)  # q = 1: every example, in order
    with caplog.at_level(logging.INFO):
        make_trainer(dp(noise_multiplier=sigma, max_grad_norm=c, seed=5)).fit(module, data)
    opt = module.trainer.optimizers[0]
    assert f"clipping = optimizer plan ({len(opt.projections) + 1} groups)" in caplog.text  # not the policy
    slots, noise_std, bounds, step = opt.kept
    # Reference: torch.func per-example gradients, projected, clipped per group, summed, plus the noise stream.
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = torch.cat([b[0] for b in module.batches]), torch.cat([b[1] for b in module.batches])
    grads = per_example_grads(net, F.cross_entropy, x, y)
    names = {p: n.removeprefix("net.") for n, p in module.named_parameters()}
    groups = [[p] for p in opt.projections] + [[p for p in names if p not in opt.projections]]
    projected = {p: grads[names[p]] @ opt.projections[p].T if p in opt.projections else grads[names[p]] for p in names}
    bound = c / math.sqrt(len(groups))
    expected: dict = {}
    for members in groups:
        norms = torch.stack([projected[p].flatten(1).square().sum(1) for p in members]).sum(0).sqrt()
        factors = (bound / (norms + 1e-6)).clamp(max=1.0)
        expected.update({p: torch.einsum("i,i...->...", factors, projected[p]) for p in members})
    order = [p for members in groups for p in members]
    total = sum(expected[p].numel() for p in order)
    noise = GaussianNoise(seed=5)
    noise.start_step(0)
    flat_noise = noise.sample(torch.zeros(total), sigma * c).split([expected[p].numel() for p in order])
    assert step == 0 and bounds == [bound] * len(groups)
    assert noise_std == pytest.approx(sigma * math.sqrt(sum(b * b for b in bounds)) / N)  # σΔ/(qN)
    for p, z in zip(order, flat_noise):
        torch.testing.assert_close(slots[p], (expected[p] + z.view_as(expected[p])) / N, rtol=1e-5, atol=1e-6)
    assert all(slots[p].shape == (p.shape[0], 2) for p in opt.projections)  # released in the projected shape


K = 3


class _Augmented(TinyModule):
    """K views of each example in one forward; one privacy unit = its K consecutive rows."""

    dp_rows_per_unit = K

    def __init__(self) -> None:
        super().__init__(lr=1.0)
        self.offsets = torch.randn(K, 6, generator=torch.Generator().manual_seed(9))

    def views(self, x: Tensor) -> Tensor:
        return (x.unsqueeze(1) + self.offsets).flatten(0, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.record(x, y)
        per_row = F.cross_entropy(self(self.views(x)), y.repeat_interleave(K), reduction="none")
        return per_row.view(-1, K).mean(1).sum() / max(len(y), 1)  # each unit's loss: the mean over its views


def test_a_unit_of_several_rows_is_clipped_as_one() -> None:
    torch.manual_seed(0)
    module = _Augmented()
    before = params_of(module)
    make_trainer(dp(max_grad_norm=0.2)).fit(module, DataLoader(make_dataset(N), batch_size=N))
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = module.batches[0]
    rows = per_example_grads(net, F.cross_entropy, module.views(x), y.repeat_interleave(K))
    units = {n: g.view(N, K, *g.shape[1:]).mean(1) for n, g in rows.items()}  # each unit's gradient
    norms = torch.stack([g.flatten(1).square().sum(1) for g in units.values()]).sum(0).sqrt()
    factors = (0.2 / (norms + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any()  # clipping is active, per unit
    for name, p in module.named_parameters():
        expected = torch.einsum("i,i...->...", factors, units[name.removeprefix("net.")]) / N
        torch.testing.assert_close(before[name] - p.detach(), expected, rtol=1e-5, atol=1e-7)


def test_a_bad_rows_per_unit_is_refused() -> None:
    module = _Augmented()
    module.dp_rows_per_unit = 0
    with pytest.raises(ValueError, match="dp_rows_per_unit"):
        make_trainer(dp()).fit(module, DataLoader(make_dataset(N), batch_size=N))


class _Pending(pl.Callback):
    """Records which parameters still await clipping when the backward pass has just ended."""

    def __init__(self) -> None:
        self.waiting: list[int] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        self.waiting.append(len(trainer.strategy.private_step.hooks._grads))


@pytest.mark.parametrize("clipping", ["per_layer", "per_matrix"])
def test_groups_of_one_layer_are_clipped_when_its_backward_is_done(clipping: str) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    before = params_of(module)
    pending = _Pending()
    strategy = dp(max_grad_norm=0.3, clipping=clipping, verify_gradients="never")
    make_trainer(strategy, accumulate_grad_batches=2, callbacks=[pending]).fit(
        module, DataLoader(make_dataset(N), batch_size=N)
    )
    groups = {
        "per_layer": [["0.weight", "0.bias"], ["2.weight", "2.bias"]],
        "per_matrix": [["0.weight"], ["2.weight"], ["0.bias", "2.bias"]],
    }[clipping]
    expected_waiting = 0 if clipping == "per_layer" else 2  # the non-matrix group spans both layers
    assert pending.waiting == [expected_waiting, expected_waiting]
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = torch.cat([b[0] for b in module.batches]), torch.cat([b[1] for b in module.batches])
    expected = clipped_sum(per_example_grads(net, F.cross_entropy, x, y), 0.3, groups)
    for name, p in module.named_parameters():
        torch.testing.assert_close(
            before[name] - p.detach(), expected[name.removeprefix("net.")] / N, rtol=1e-5, atol=1e-7
        )
