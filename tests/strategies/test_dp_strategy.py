"""DPStrategy: public API, clear errors for bad input, and hygiene after fit."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, WeightedRandomSampler

import dplightning
from tests.helpers import (
    ACCELERATOR,
    ManualModule,
    Scale,
    TinyModule,
    dp,
    loader,
    make_dataset,
    make_trainer,
    params_of,
)

N, BATCH = 64, 16


def _fit(module: pl.LightningModule | None = None, strategy=None, data=None, **trainer_kwargs) -> pl.Trainer:
    trainer = make_trainer(strategy if strategy is not None else dp(), **trainer_kwargs)
    trainer.fit(module or TinyModule(), data or loader(make_dataset(N), BATCH))
    return trainer


# ------------------------------------------------------------------ constructor arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of noise_multiplier"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "exactly one of noise_multiplier"),
        ({"noise_multiplier": -0.1}, "noise_multiplier must be"),
        ({"target_epsilon": -1.0}, "target_epsilon must be"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "max_grad_norm": -1.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "delta": 1.5}, "delta"),
        ({"noise_multiplier": 1.0, "accountant": "magic"}, "Unknown accountant"),
        ({"noise_multiplier": 1.0, "clipping": "magic"}, "Unknown clipping"),
        ({"noise_multiplier": 1.0, "grad_sample_mode": "magic"}, "Unknown grad_sample_mode"),
        ({"noise_multiplier": 1.0, "loss_reduction": "max"}, "loss_reduction"),
        ({"target_epsilon": 1.0, "poisson_sampling": False}, "poisson_sampling=True"),
    ],
)
def test_bad_arguments_raise_naming_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dplightning.DPStrategy(**kwargs)


def test_zero_noise_warns_that_epsilon_is_infinite() -> None:
    with pytest.warns(UserWarning, match="infinite"):
        dplightning.DPStrategy(noise_multiplier=0.0)


def test_registered_name_works_with_a_default_sigma() -> None:
    trainer = _fit(strategy="dp", max_steps=2)
    assert isinstance(trainer.strategy, dplightning.DPStrategy)
    assert trainer.strategy.noise_multiplier == 1.0 and trainer.strategy.steps == 2


# ------------------------------------------------------------------ errors before training


class _BatchNormModule(TinyModule):
    def __init__(self) -> None:
        super().__init__(net=nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)))


def test_batchnorm_is_refused_with_the_module_name() -> None:
    with pytest.raises(ValueError, match=r"net\.1.*GroupNorm"):
        _fit(_BatchNormModule())


def test_module_without_sampler_is_listed_under_hooks_mode() -> None:
    with pytest.raises(ValueError, match=r"net\.1 \(Scale\)"):
        _fit(TinyModule(net=nn.Sequential(nn.Linear(6, 3), Scale())), dp(grad_sample_mode="hooks"))


def test_custom_sampler_is_refused() -> None:
    ds = make_dataset(N)
    data = DataLoader(ds, batch_size=BATCH, sampler=WeightedRandomSampler(torch.ones(N), N))
    with pytest.raises(ValueError, match="custom sampler"):
        _fit(data=data)


def test_fp16_grad_scaler_is_refused() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="bf16-mixed"):
        _fit(plugins=[plugin])


def test_two_optimizers_are_refused() -> None:
    class Two(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=1), torch.optim.SGD(self.net[2].parameters(), lr=1)]

    with pytest.raises(ValueError, match="exactly one optimizer"):
        _fit(Two())


def test_accumulation_scheduler_is_refused() -> None:
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        _fit(callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})])


@pytest.mark.skipif(ACCELERATOR != "cpu", reason="needs two devices of the test accelerator")
def test_several_devices_need_dp_ddp() -> None:
    with pytest.raises(ValueError, match="dp_ddp"):
        _fit(devices=2)


def test_target_epsilon_needs_a_finite_run() -> None:
    with pytest.raises(ValueError, match="max_epochs or max_steps"):
        _fit(strategy=dplightning.DPStrategy(target_epsilon=1.0), max_steps=-1, max_epochs=-1)


def test_sequence_first_layers_are_detected() -> None:
    class SeqFirst(TinyModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x.unsqueeze(0).expand(2, -1, -1).reshape(-1, x.shape[-1]))  # rows != examples
            return torch.nn.functional.cross_entropy(out, y.repeat(2))

    with pytest.raises(RuntimeError, match="batch_first"):
        _fit(SeqFirst())


@pytest.mark.parametrize("steps_per_batch", [0.5, 2])
def test_manual_optimization_must_step_once_per_batch(steps_per_batch: float) -> None:
    class Irregular(ManualModule):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(self.loss(self(batch[0]), batch[1]))
            for _ in range(int(steps_per_batch) if steps_per_batch >= 1 else batch_idx % 2):
                opt.step()  # every other batch (accumulating across Poisson batches), or twice per batch

    with pytest.raises(RuntimeError, match="exactly once per training batch"):
        _fit(Irregular(), max_steps=4)


def test_resuming_a_non_dp_checkpoint_is_refused(tmp_path) -> None:
    plain = make_trainer("auto", max_steps=1)
    plain.fit(TinyModule(), loader(make_dataset(N), BATCH))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="no privacy ledger"):
        make_trainer(dp(), max_steps=2).fit(
            TinyModule(), loader(make_dataset(N), BATCH), ckpt_path=tmp_path / "plain.ckpt"
        )


# ------------------------------------------------------------------ warnings


def test_large_delta_warns() -> None:
    with pytest.warns(UserWarning, match="1/N"):
        _fit(strategy=dp(delta=0.5))


def test_gradient_clip_val_warns() -> None:
    with pytest.warns(UserWarning, match="gradient_clip_val"):
        _fit(gradient_clip_val=1.0)


def test_on_after_backward_override_warns() -> None:
    class Peeks(TinyModule):
        def on_after_backward(self) -> None:
            pass

    with pytest.warns(UserWarning, match="on_after_backward"):
        _fit(Peeks())


# ------------------------------------------------------------------ hygiene


def test_state_dict_keys_unchanged_and_no_hooks_left() -> None:
    module = TinyModule()
    keys = list(module.state_dict())
    _fit(module, max_steps=3)
    assert list(module.state_dict()) == keys
    for m in module.modules():
        assert not m._forward_hooks and not m._backward_hooks and not hasattr(m, "activations")
    for p in module.parameters():
        assert not hasattr(p, "grad_sample") and not hasattr(p, "_forward_counter")


class _Observe(pl.Callback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.cpu() for n, p in pl_module.named_parameters() if p.grad is not None})


def test_on_before_optimizer_step_sees_the_private_gradient() -> None:
    torch.manual_seed(0)
    module = TinyModule(lr=1.0)
    before = params_of(module)
    observer = _Observe()
    _fit(module, strategy=dp(noise_multiplier=2.0), callbacks=[observer])
    (seen,) = observer.grads
    for n, p in module.named_parameters():
        torch.testing.assert_close(seen[n], before[n] - p.detach())  # SGD lr=1 applied exactly what was seen


def test_frozen_parameters_stay_fixed() -> None:
    module = TinyModule()
    module.net[0].requires_grad_(False)
    before = params_of(module)
    _fit(module, strategy=dp(noise_multiplier=1.0), max_steps=3)
    torch.testing.assert_close(module.net[0].weight, before["net.0.weight"])
    assert not torch.equal(module.net[2].weight, before["net.2.weight"])


def test_non_finite_example_adds_nothing() -> None:
    x = torch.randn(N, 6)
    x[3] = float("inf")
    ds = torch.utils.data.TensorDataset(x, torch.zeros(N, dtype=torch.long))
    module = TinyModule()
    trainer = _fit(module, data=DataLoader(ds, batch_size=N), max_steps=2)  # q = 1
    assert trainer.strategy.nonfinite_examples == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_validation_does_no_per_example_work() -> None:
    class Validates(TinyModule):
        def validation_step(self, batch, batch_idx):
            self.seen = [hasattr(p, "grad_sample") and p.grad_sample is not None for p in self.parameters()]
            return self.loss(self(batch[0]), batch[1])

    module = Validates()
    data = loader(make_dataset(N), BATCH)
    make_trainer(dp(), max_steps=2, limit_val_batches=1, val_check_interval=1).fit(module, data, data)
    assert not any(module.seen)


def test_public_api_after_fit() -> None:
    trainer = _fit(strategy=dp(noise_multiplier=1.0), max_steps=5)
    s = trainer.strategy
    assert s.steps == 5 and s.sample_rate == BATCH / N and s.expected_batch_size == BATCH
    assert s.get_epsilon() == s.get_epsilon(s.delta) > 0
    assert s.get_epsilon(1e-3) < s.get_epsilon(1e-8)
    assert s.noise_std == 1.0 * s.max_grad_norm


@pytest.mark.e2e
def test_target_epsilon_is_met_at_the_end() -> None:
    trainer = _fit(strategy=dplightning.DPStrategy(target_epsilon=2.0, max_grad_norm=1.0), max_epochs=3, max_steps=-1)
    s = trainer.strategy
    assert s.steps == 3 * 4
    assert 1.9 < s.get_epsilon() <= 2.0


def test_poisson_sampling_off_reports_infinite_epsilon() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _fit(strategy=dplightning.DPStrategy(noise_multiplier=1.0, poisson_sampling=False), max_steps=2)
    assert trainer.strategy.get_epsilon() == float("inf")


def test_epsilon_is_in_the_logged_metrics() -> None:
    trainer = _fit(strategy=dp(noise_multiplier=1.0), max_steps=3, enable_progress_bar=True)
    assert trainer.progress_bar_metrics["epsilon"] >= trainer.strategy.get_epsilon()
