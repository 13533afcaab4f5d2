"""The invariants of design/lightning_dp.md for DPStrategy, run through a real Trainer.

References are computed independently: per-example gradients by torch.func, noise by
regenerating the documented stream, ε by Opacus' accountants built directly.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn

from dplightning.privacy.noise import GaussianNoise
from tests.helpers import DEVICE, ManualModule, TinyModule, dp, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import clipped_sum, per_example_grads

N, BATCH = 64, 16  # q = 0.25, expected batch B = 16


def _reference_step(module: TinyModule, before: dict, max_norm: float, groups=None) -> dict:
    """Σ clip(g_i) / B over every example the module trained on in its (single) step."""
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x = torch.cat([b[0] for b in module.batches])
    y = torch.cat([b[1] for b in module.batches])
    grads = per_example_grads(net, F.cross_entropy, x, y)
    summed = clipped_sum(grads, max_norm, groups)
    return {f"net.{n}": v / BATCH for n, v in summed.items()}


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("k", [1, 3])
def test_zero_noise_step_is_the_clipped_mean(clipping: str, k: int) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    before = params_of(module)
    trainer = make_trainer(dp(max_grad_norm=0.3, clipping=clipping, seed=1), accumulate_grad_batches=k)
    trainer.fit(module, loader(make_dataset(N), BATCH))
    assert len(module.batches) == k  # empty micro-batches run training_step too (dp_ddp ranks stay in lock-step)
    groups = [["0.weight", "0.bias"], ["2.weight", "2.bias"]] if clipping == "per_layer" else None
    expected = _reference_step(module, before, 0.3, groups)
    for name, p in module.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], rtol=1e-5, atol=1e-7)


def test_noise_is_added_exactly_once() -> None:
    sigma, c = 1.3, 0.7
    torch.manual_seed(0)
    module = TinyModule(net=nn.Sequential(nn.Linear(6, 400), nn.Linear(400, 3)), zero_loss=True)
    before = params_of(module)
    trainer = make_trainer(dp(noise_multiplier=sigma, max_grad_norm=c, seed=7))
    trainer.fit(module, loader(make_dataset(N), BATCH))
    update = torch.cat([(before[n] - p.detach()).flatten() for n, p in module.named_parameters()])
    n = update.numel()
    # Statistical: the update (before - after = lr * grad) is noise/B with std σC/B, not more (twice added) nor less.
    assert abs(update.std().item() / (sigma * c / BATCH) - 1) < 5 / math.sqrt(2 * n)
    # Exact: it is the documented stream of (seed, rank 0, step 0).
    noise = GaussianNoise(seed=7, rank=0)
    noise.start_step(0)
    torch.testing.assert_close(update, noise.sample(torch.zeros(n, device=DEVICE), sigma * c).cpu() / BATCH)


@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_accumulation_equals_one_big_batch(sigma: float) -> None:
    def run(k: int) -> dict:
        torch.manual_seed(0)
        module = TinyModule(lr=0.5)
        trainer = make_trainer(dp(noise_multiplier=sigma, seed=3), accumulate_grad_batches=k, max_steps=4)
        trainer.fit(module, loader(make_dataset(N), BATCH))
        assert trainer.strategy.steps == 4
        return params_of(module)

    one, three = run(1), run(3)
    for name in one:
        torch.testing.assert_close(one[name], three[name], rtol=1e-5, atol=1e-6)


class _CountBatches(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.batches += 1


@pytest.mark.timeout(120)
def test_tiny_sampling_rate_with_many_empty_batches() -> None:
    torch.manual_seed(0)
    module = TinyModule()
    counter = _CountBatches()
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=30, accumulate_grad_batches=2, callbacks=[counter])
    trainer.fit(module, loader(make_dataset(200), batch_size=1))  # q = 0.005: most batches are empty
    assert trainer.strategy.steps == 30
    assert counter.batches == 60
    assert len(module.batches) == counter.batches  # training_step ran on every micro-batch ...
    assert any(len(x) == 0 for x, _ in module.batches)  # ... empty ones included
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize(("accountant", "cls"), [("prv", PRVAccountant), ("rdp", RDPAccountant)])
def test_epsilon_equals_a_direct_opacus_accountant(accountant: str, cls: type) -> None:
    trainer = make_trainer(dp(noise_multiplier=1.1, accountant=accountant), max_steps=7)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    reference = cls()
    for _ in range(7):
        reference.step(noise_multiplier=1.1, sample_rate=BATCH / N)
    delta = 1 / (10 * N)
    assert trainer.strategy.delta == delta
    assert trainer.strategy.get_epsilon() == pytest.approx(reference.get_epsilon(delta=delta), rel=1e-12)


@pytest.mark.parametrize("first_steps", [6, 8])  # mid-epoch and end-of-epoch checkpoints
def test_resume_continues_epsilon_exactly_and_never_replays_noise(tmp_path, first_steps: int) -> None:
    ckpt = tmp_path / "first.ckpt"
    torch.manual_seed(0)
    module = TinyModule(zero_loss=True)
    trainer = make_trainer(dp(noise_multiplier=0.9, seed=11), max_steps=first_steps)
    trainer.fit(module, loader(make_dataset(N), BATCH))
    trainer.save_checkpoint(ckpt)

    resumed_module = TinyModule(zero_loss=True)
    resumed = make_trainer(dp(noise_multiplier=0.9, seed=11), max_steps=first_steps + 1)
    before = params_of(module)
    resumed.fit(resumed_module, loader(make_dataset(N), BATCH), ckpt_path=ckpt)
    assert resumed.strategy.steps == first_steps + 1
    reference = PRVAccountant()
    reference.history = [(0.9, BATCH / N, first_steps + 1)]
    assert resumed.strategy.get_epsilon() == pytest.approx(reference.get_epsilon(delta=1 / (10 * N)), rel=1e-12)
    # The resumed step drew the stream of step `first_steps`, not that of step 0.
    update = torch.cat([(before[n] - p.detach()).flatten() for n, p in resumed_module.named_parameters()])
    noise = GaussianNoise(seed=11)
    noise.start_step(first_steps)
    torch.testing.assert_close(update, noise.sample(torch.zeros(update.numel(), device=DEVICE), 0.9).cpu() / BATCH)


def test_adversarial_example_moves_sgd_by_at_most_lr_c_over_b() -> None:
    torch.manual_seed(0)
    x = torch.zeros(N, 6)
    x[0] = 1e4  # one huge example
    ds = torch.utils.data.TensorDataset(x, torch.zeros(N, dtype=torch.long))
    module = TinyModule(lr=0.5)
    before = params_of(module)
    trainer = make_trainer(dp(max_grad_norm=0.2, seed=0), max_steps=1)
    trainer.fit(module, torch.utils.data.DataLoader(ds, batch_size=N))  # q = 1: everyone is sampled
    moved = math.sqrt(sum((before[n] - p.detach()).pow(2).sum().item() for n, p in module.named_parameters()))
    assert moved <= 0.5 * 0.2 * N / N + 1e-6  # lr * C per example, N examples, / B = N


def test_bf16_mixed_keeps_norms_and_noise_in_fp32() -> None:
    torch.manual_seed(0)
    module = TinyModule()
    before = params_of(module)
    trainer = make_trainer(dp(max_grad_norm=0.3, seed=1), precision="bf16-mixed")
    trainer.fit(module, loader(make_dataset(N), BATCH))
    stats = trainer.strategy.last_step_stats
    assert stats and all(s.norms.dtype == torch.float32 for s in stats)
    expected = _reference_step(module, before, 0.3)
    for name, p in module.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], rtol=0.05, atol=2e-3)


def test_manual_optimization_takes_the_same_private_step() -> None:
    torch.manual_seed(0)
    module = ManualModule()
    before = params_of(module)
    trainer = make_trainer(dp(max_grad_norm=0.3, seed=1))
    trainer.fit(module, loader(make_dataset(N), BATCH))
    assert trainer.strategy.steps == 1
    expected = _reference_step(module, before, 0.3)
    for name, p in module.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], rtol=1e-5, atol=1e-7)
