"""One noisy release per Poisson batch, accounted once: the paths that could break it.

Several backward passes or closure evaluations per step, several train loaders, partial
accumulations, and resumed runs whose q or length changed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import CombinedLoader
from opacus.accountants import PRVAccountant
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.privacy.grad_sample import available_engines
from tests.helpers import ManualModule, TinyModule, dp, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import clipped_sum, per_example_grads

N, BATCH = 64, 16


class _Repeats(ManualModule):
    """Manual optimization with ``passes`` backward passes over the same batch before one step."""

    def __init__(self, passes: int) -> None:
        super().__init__(lr=1.0)
        self.passes = passes

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.record(x, y)
        for _ in range(self.passes):
            self.manual_backward(self.loss(self(x), y))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("engine", available_engines())
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_backward_passes_over_one_batch_are_summed_before_clipping(passes: int, engine: str) -> None:
    torch.manual_seed(0)
    module = _Repeats(passes)
    before = params_of(module)
    make_trainer(dp(max_grad_norm=0.3, seed=2, clipping_engine=engine)).fit(module, loader(make_dataset(N), BATCH))
    x = torch.cat([b[0] for b in module.batches])
    y = torch.cat([b[1] for b in module.batches])
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    grads = per_example_grads(net, lambda out, t: passes * F.cross_entropy(out, t), x, y)
    expected = clipped_sum(grads, 0.3)
    for name, p in module.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name.removeprefix("net.")] / BATCH,
                                   rtol=1e-5, atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("engine", available_engines())
def test_one_example_moves_the_release_by_at_most_c_whatever_the_backward_passes(engine: str) -> None:
    x = torch.zeros(1, 6)
    x[0, 0] = 1e3
    data = DataLoader(TensorDataset(x, torch.zeros(1, dtype=torch.long)), batch_size=1)  # q = 1, B = 1
    module = _Repeats(3)
    before = params_of(module)
    make_trainer(dp(max_grad_norm=1.0, clipping_engine=engine)).fit(module, data)
    moved = math.sqrt(sum((before[n] - p.detach()).square().sum().item() for n, p in module.named_parameters()))
    assert moved <= 1.0 + 1e-6  # lr 1 x C / B; three separately clipped passes moved it by 3


class _SharpnessAware(torch.optim.SGD):
    """Evaluates the closure twice per step, as SAM does."""

    def step(self, closure=None):  # type: ignore[override]
        closure()
        return super().step(closure)


def test_a_second_closure_evaluation_in_one_step_is_refused() -> None:
    module = TinyModule(optimizer=lambda params: _SharpnessAware(params, lr=0.1))
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=2)
    with pytest.raises(RuntimeError, match="closure a second time"):
        trainer.fit(module, loader(make_dataset(N), BATCH))
    assert trainer.strategy.steps == 1  # the one release that happened is accounted


class _TwoLoaders(TinyModule):
    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch["a"] if isinstance(batch, dict) else batch[0]
        return self.loss(self(x), y)


@pytest.mark.parametrize("wrap", ["dict", "list", "combined"])
def test_several_train_loaders_are_refused(wrap: str) -> None:
    big, small = loader(make_dataset(N), BATCH), loader(make_dataset(N // 4, seed=1), 2)
    data = {"dict": {"a": big, "b": small}, "list": [big, small]}.get(wrap) or CombinedLoader({"a": big, "b": small})
    module = _TwoLoaders()
    before = params_of(module)
    with pytest.raises(ValueError, match="exactly one train loader"):
        make_trainer(dp(noise_multiplier=1.0), max_steps=2).fit(module, data)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_partial_accumulation_at_the_end_of_an_epoch_is_refused() -> None:
    with pytest.raises(ValueError, match="limit_train_batches=2 or 4"):
        make_trainer(dplightning.DPStrategy(target_epsilon=1.0), accumulate_grad_batches=2, limit_train_batches=3,
                     max_epochs=2, max_steps=-1).fit(TinyModule(), loader(make_dataset(N), BATCH))  # fmt: skip


def test_calibration_counts_the_steps_the_loop_runs_with_a_limit() -> None:
    trainer = make_trainer(dplightning.DPStrategy(target_epsilon=1.0), accumulate_grad_batches=2,
                           limit_train_batches=4, max_epochs=2, max_steps=-1)  # fmt: skip
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    assert trainer.strategy.steps == 4 == trainer.global_step
    assert 0.9 < trainer.strategy.get_epsilon() <= 1.0


def _first_run(tmp_path, strategy, batch: int = BATCH, steps: int = 4):
    trainer = make_trainer(strategy, max_steps=steps)
    trainer.fit(TinyModule(), loader(make_dataset(N), batch))
    trainer.save_checkpoint(tmp_path / "first.ckpt")
    return tmp_path / "first.ckpt"


def test_resuming_target_epsilon_at_another_sampling_rate_is_refused(tmp_path) -> None:
    ckpt = _first_run(tmp_path, dplightning.DPStrategy(target_epsilon=2.0))
    resumed = make_trainer(dplightning.DPStrategy(target_epsilon=2.0), max_steps=8)
    with pytest.raises(ValueError, match=r"q = 0\.25.*q = 0\.5.*overspent"):
        resumed.fit(TinyModule(), loader(make_dataset(N), 2 * BATCH), ckpt_path=ckpt)


def test_resuming_a_fixed_sigma_at_another_sampling_rate_warns_and_accounts_both(tmp_path) -> None:
    ckpt = _first_run(tmp_path, dp(noise_multiplier=1.0))
    resumed = make_trainer(dp(noise_multiplier=1.0), max_steps=6)
    with pytest.warns(UserWarning, match=r"q = 0\.5.*ε stays exact"):
        resumed.fit(TinyModule(), loader(make_dataset(N), 2 * BATCH), ckpt_path=ckpt)
    reference = PRVAccountant()
    reference.history = [(1.0, 0.25, 4), (1.0, 0.5, 2)]
    assert resumed.strategy.get_epsilon() == pytest.approx(reference.get_epsilon(delta=1 / (10 * N)), rel=1e-12)


@pytest.mark.e2e
def test_resuming_target_epsilon_for_longer_warns_of_the_overshoot(tmp_path) -> None:
    ckpt = _first_run(tmp_path, dplightning.DPStrategy(target_epsilon=1.0))
    resumed = make_trainer(dplightning.DPStrategy(target_epsilon=1.0), max_steps=12)
    with pytest.warns(UserWarning, match=r"will end at ε = .* > 1\.0"):
        resumed.fit(TinyModule(), loader(make_dataset(N), BATCH), ckpt_path=ckpt)
    assert resumed.strategy.get_epsilon() > 1.0


def test_empty_batches_reach_training_step() -> None:
    class Sizes(TinyModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.record(x, y)
            return F.cross_entropy(self(x), y, reduction="sum") / max(len(y), 1)

    module = Sizes()
    make_trainer(dp(noise_multiplier=1.0), max_steps=40).fit(module, loader(make_dataset(200), batch_size=1))
    assert len(module.batches) == 40 and any(len(x) == 0 for x, _ in module.batches)


def test_a_step_that_fails_on_an_empty_batch_names_the_cause() -> None:
    class NeedsRows(TinyModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss(self(x), y) + x.max()  # max of an empty tensor raises

    with pytest.raises(RuntimeError, match="empty batch.*max\\(n, 1\\)"):
        make_trainer(dp(noise_multiplier=1.0), max_steps=60).fit(NeedsRows(), loader(make_dataset(400), batch_size=1))


def _gpt2(head: str):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=17, n_positions=8, num_labels=2,
                                     pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, head)(config)


class _BuiltInLoss(TinyModule):
    """A module returning the Hugging Face model's own loss, the most common way to fine-tune."""

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.net(input_ids=ids, labels=labels).loss


def _lm_data() -> DataLoader:
    ids = torch.randint(1, 17, (8, 6), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids, ids.clone()), batch_size=8)


def test_hugging_face_token_mean_loss_is_refused_before_any_update() -> None:
    module = _BuiltInLoss(net=_gpt2("GPT2LMHeadModel"))
    before = params_of(module)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel was called with labels=.*all counted target tokens(.|\n)*"
                       r"per_example = \(per_token \* counted\)"):  # fmt: skip
        make_trainer(dp(noise_multiplier=1.0)).fit(module, _lm_data())
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_hugging_face_example_mean_loss_keeps_working() -> None:
    ids = torch.randint(1, 17, (8, 6), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids, torch.arange(8) % 2), batch_size=8)
    module = _BuiltInLoss(net=_gpt2("GPT2ForSequenceClassification"))
    before = params_of(module)
    make_trainer(dp(noise_multiplier=0.0, max_grad_norm=1e6, poisson_sampling=False)).fit(module, data)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())


def test_hugging_face_example_mean_loss_with_ignored_labels_is_refused() -> None:
    ids = torch.randint(1, 17, (8, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, -100, 1, 0, 1, 0, -100])  # CE's mean then runs over the 6 others
    data = DataLoader(TensorDataset(ids, labels), batch_size=8)
    with pytest.raises(ValueError, match="ignored \\(negative\\) entries"):
        make_trainer(dp(noise_multiplier=1.0)).fit(_BuiltInLoss(net=_gpt2("GPT2ForSequenceClassification")), data)