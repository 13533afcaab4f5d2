"""The input-validation table of docs/dp_sgd_core.md: the rows not covered elsewhere.

Each bad input raises or warns before the update it concerns (the rows already tested live
next to the code they exercise: tests/strategies/test_dp_strategy.py, test_step_contract.py,
tests/data/test_poisson.py, tests/callbacks/test_privacy_budget.py).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from dplightning.callbacks import PrivacyBudget
from dplightning.callbacks.progress import NONFINITE_METRIC
from dplightning.strategies.accounting import PrivacyAccounting
from dplightning.strategies.config import DPConfig
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import clipped_sum, per_example_grads

N, BATCH = 64, 16


def _unchanged(module: torch.nn.Module, before: dict[str, Tensor]) -> bool:
    return all(torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())


class _Stream(IterableDataset):
    def __iter__(self):
        data = make_dataset(8)
        yield from (data[i] for i in range(8))


@pytest.mark.parametrize(
    ("data", "poisson", "error", "match"),
    [
        (
            lambda: DataLoader(make_dataset(N), batch_sampler=BatchSampler(SequentialSampler(range(N)), 4, False)),
            True,
            ValueError,
            "custom batch_sampler",
        ),  # fmt: skip
        (lambda: DataLoader(_Stream(), batch_size=4), True, TypeError, "map-style"),
        (lambda: DataLoader(_Stream(), batch_size=4), False, TypeError, "no __len__"),
        (
            lambda: DataLoader(TensorDataset(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)), batch_size=4),
            True,
            ValueError,
            "empty",
        ),  # fmt: skip
        (lambda: loader(make_dataset(N), 2 * N), True, ValueError, r"lower the train loader's batch_size"),
    ],
    ids=["user_batch_sampler", "iterable_dataset", "iterable_dataset_no_poisson", "empty_dataset", "batch_gt_N"],
)
def test_bad_train_loaders_are_refused_before_any_update(data, poisson: bool, error: type, match: str) -> None:
    module = TinyModule()
    before = params_of(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # poisson_sampling=False warns that ε is infinite
        with pytest.raises(error, match=match):
            make_trainer(dp(noise_multiplier=1.0, poisson_sampling=poisson), max_steps=2).fit(module, data())
    assert _unchanged(module, before)


def test_zero_noise_with_a_budget_takes_no_step() -> None:
    module = TinyModule()
    before = params_of(module)
    trainer = make_trainer(dp(noise_multiplier=0.0), callbacks=[PrivacyBudget(10.0)], max_steps=5)
    with pytest.warns(UserWarning, match="no step is taken"):
        trainer.fit(module, loader(make_dataset(N), BATCH))
    assert trainer.strategy.steps == 0 and _unchanged(module, before)


class _NaNLoss(TinyModule):
    """The loss of the whole batch is NaN at the first step (e.g. a diverged run)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 0 else loss


def test_a_nan_loss_contributes_zero_and_is_counted_where_the_user_sees_it() -> None:
    module = _NaNLoss()
    before = params_of(module)
    data = DataLoader(make_dataset(N), batch_size=N)  # q = 1: every example in every step
    trainer = make_trainer(dp(noise_multiplier=0.0), max_steps=1)
    with pytest.warns(UserWarning, match=r"Step 1: 64 example\(s\) had a non-finite"):
        trainer.fit(module, data)
    assert trainer.strategy.nonfinite_examples == N and trainer.strategy.steps == 1
    assert _unchanged(module, before)  # σ = 0 and every example contributed zero
    assert trainer.callback_metrics[NONFINITE_METRIC].item() == N


def test_one_nan_example_is_dropped_and_the_others_are_exact() -> None:
    torch.manual_seed(0)
    data = make_dataset(N)
    x, y = data.tensors[0].clone(), data.tensors[1]
    x[5, 2] = float("nan")
    module = TinyModule(lr=1.0)
    before = params_of(module)
    trainer = make_trainer(dp(noise_multiplier=0.0, max_grad_norm=0.5), max_steps=1)
    with pytest.warns(UserWarning, match=r"1 example\(s\) had a non-finite"):
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=N))
    assert trainer.strategy.nonfinite_examples == 1
    (xb, yb), = module.batches  # fmt: skip
    keep = torch.isfinite(xb).all(1)
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    expected = clipped_sum(per_example_grads(net, F.cross_entropy, xb[keep], yb[keep]), 0.5)
    for name, p in module.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name.removeprefix("net.")] / N,
                                   rtol=1e-5, atol=1e-7)  # fmt: skip


def _first_run(path, n: int) -> str:
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=2)
    trainer.fit(TinyModule(), loader(make_dataset(n), BATCH))
    trainer.save_checkpoint(path)
    return str(path)


def test_resuming_on_another_data_set_size_warns_and_accounts_the_new_q(tmp_path) -> None:
    ckpt = _first_run(tmp_path / "a.ckpt", N)
    resumed = make_trainer(dp(noise_multiplier=1.0), max_steps=3)
    with pytest.warns(UserWarning, match=r"from N = 64 examples; now q = 0\.125 from N = 128"):
        resumed.fit(TinyModule(), loader(make_dataset(2 * N), BATCH), ckpt_path=ckpt)
    assert resumed.strategy.ledger.history == ((1.0, BATCH / N, 2), (1.0, BATCH / (2 * N), 1))


def test_a_train_loader_rebuilt_every_epoch_is_poisson_sampled_every_epoch() -> None:
    class Rebuilds(TinyModule):
        def train_dataloader(self):
            return DataLoader(make_dataset(N), batch_size=BATCH, sampler=SequentialSampler(range(N)))

    samplers: list[str] = []

    class Record(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            samplers.append(type(trainer.train_dataloader.batch_sampler).__name__)

    trainer = make_trainer(dp(noise_multiplier=1.0), max_epochs=3, max_steps=-1,
                           reload_dataloaders_every_n_epochs=1, callbacks=[Record()])  # fmt: skip
    trainer.fit(Rebuilds())
    assert samplers == ["PoissonBatchSampler"] * 3
    assert trainer.strategy.ledger.history == ((1.0, BATCH / N, 3 * N // BATCH),)


def test_resuming_on_another_world_size_is_checked_like_another_batch_size() -> None:
    # q = batch_size x world_size / N: a checkpoint of 2 ranks resumed on 1 halves q. Every rank runs
    # this check (the accounting is rank-local and identical), here without spawning processes.
    two_ranks = PrivacyAccounting(DPConfig(target_epsilon=1.0))
    two_ranks.set_sampling(N, 2 * BATCH / N)
    two_ranks.plan(8)
    two_ranks.step()
    one_rank = PrivacyAccounting(DPConfig(target_epsilon=1.0))
    one_rank.load_state_dict(two_ranks.state_dict())
    with pytest.raises(ValueError, match=r"another world size.*overspent"):
        one_rank.set_sampling(N, BATCH / N)


def test_the_non_finite_count_stays_out_of_what_is_handed_on(tmp_path) -> None:
    """One NaN example moved a raw count from 0 to 1 in the checkpoint and privacy-report (finding 51.A2)."""
    from dplightning.commands.export import load_checkpoint
    from dplightning.commands.report import format_report, privacy_report
    from dplightning.strategies._dp import CHECKPOINT_KEY

    data = make_dataset(N)
    x, y = data.tensors[0].clone(), data.tensors[1]
    x[5, 2] = float("nan")
    trainer = make_trainer(dp(noise_multiplier=1.0, max_grad_norm=0.5), max_steps=1)
    with pytest.warns(UserWarning, match=r"1 example\(s\) had a non-finite"):
        trainer.fit(TinyModule(), DataLoader(TensorDataset(x, y), batch_size=N))
    assert trainer.strategy.dp_state.nonfinite_examples == 1  # the user's own view of the run keeps it
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = load_checkpoint(tmp_path / "run.ckpt")
    assert checkpoint[CHECKPOINT_KEY].get("nonfinite_examples") is None
    report = privacy_report(checkpoint)
    assert "nonfinite_examples" not in report and "non-finite" not in format_report(report)
