"""PrivacyBudget stops at the last step whose ε ≤ target (references: Opacus accountants built directly)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from dplightning.callbacks import ClippingHistogram, GradientTailStats, PrivacyBudget, PrivateClipFraction
from dplightning.callbacks.privacy_budget import progress_bar_key
from dplightning.callbacks.progress import EpsilonProgress
from dplightning.privacy.noise import GaussianNoise, derive_seed
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, mlp, run_ddp

N, BATCH = 256, 4  # q = 1/64: accountant calls are cheap at small q (about 0.1 s on CPU)
Q, DELTA = BATCH / N, 1 / (10 * N)


def _epsilon(accountant: type, sigma: float, q: float, steps: int, delta: float = DELTA) -> float:
    reference = accountant()
    reference.history = [(sigma, q, steps)]
    return reference.get_epsilon(delta=delta)


def _budget_allowing(steps: int, accountant: type, sigma: float, q: float = Q, delta: float = DELTA) -> float:
    """A target ε between ε(steps) and ε(steps + 1): exactly ``steps`` steps fit."""
    return (_epsilon(accountant, sigma, q, steps, delta) + _epsilon(accountant, sigma, q, steps + 1, delta)) / 2


def _fit(budget: PrivacyBudget, module: pl.LightningModule | None = None, strategy=None, **kwargs) -> pl.Trainer:
    kwargs.setdefault("max_steps", 50)
    trainer = make_trainer(strategy or dp(noise_multiplier=1.0, accountant="rdp"), callbacks=[budget], **kwargs)
    trainer.fit(module or TinyModule(), loader(make_dataset(N), BATCH))
    return trainer


@pytest.mark.parametrize("k", [1, 3])
def test_stops_at_the_last_step_within_budget(k: int) -> None:
    target = _budget_allowing(5, RDPAccountant, sigma=1.0)
    budget = PrivacyBudget(target)
    trainer = _fit(budget, accumulate_grad_batches=k)
    strategy = trainer.strategy
    assert strategy.dp_state.steps == trainer.global_step == 5  # with accumulation too: each optimizer step counts once
    assert budget.stopped_early and budget.last_allowed_step == 5
    assert budget.epsilon == strategy.get_epsilon() <= target < _epsilon(RDPAccountant, 1.0, Q, 6)


def test_exact_prv_epsilon_equals_the_strategys() -> None:
    delta = 1e-4
    target = _budget_allowing(6, PRVAccountant, sigma=1.0, delta=delta)
    budget = PrivacyBudget(target, delta=delta)
    trainer = _fit(budget, strategy=dp(noise_multiplier=1.0))
    assert trainer.strategy.dp_state.steps == 6
    expected = _epsilon(PRVAccountant, 1.0, Q, 6, delta)
    assert budget.epsilon == trainer.strategy.get_epsilon(delta) == pytest.approx(expected, rel=1e-12)


def test_takes_no_step_if_the_first_would_exceed() -> None:
    module = TinyModule()
    with pytest.warns(UserWarning, match="no step is taken"):
        trainer = _fit(PrivacyBudget(_epsilon(RDPAccountant, 1.0, Q, 1) / 2), module)
    assert trainer.strategy.dp_state.steps == trainer.global_step == 0
    assert module.batches == []


def test_resumed_run_stops_at_the_same_last_step(tmp_path) -> None:
    target = _budget_allowing(5, RDPAccountant, sigma=1.0)
    first = _fit(PrivacyBudget(target), max_steps=2)
    first.save_checkpoint(tmp_path / "two.ckpt")
    trainer = make_trainer(dp(noise_multiplier=1.0, accountant="rdp"), callbacks=[PrivacyBudget(target)], max_steps=50)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH), ckpt_path=tmp_path / "two.ckpt")
    state = trainer.strategy.dp_state
    assert state.steps == 5 and state.ledger.history == ((1.0, Q, 5),)


def test_refuses_to_run_over_budget_when_the_trainer_cannot_stop() -> None:
    with pytest.raises(RuntimeError, match="min_steps"):
        _fit(PrivacyBudget(_budget_allowing(3, RDPAccountant, sigma=1.0)), min_steps=10)


def test_shows_epsilon_and_delta_instead_of_the_strategys_progress_callback() -> None:
    trainer = _fit(PrivacyBudget(100.0), max_steps=3)
    strategy = trainer.strategy
    assert not any(isinstance(cb, EpsilonProgress) for cb in trainer.callbacks)
    bound = strategy.epsilon_bound()
    assert bound >= strategy.get_epsilon() > 0
    delta = strategy.dp_state.delta
    assert trainer.progress_bar_metrics == {progress_bar_key(delta): pytest.approx(bound, rel=1e-6)}  # fp32
    assert trainer.callback_metrics["epsilon"].item() == pytest.approx(bound, rel=1e-6)  # what loggers get
    assert trainer.callback_metrics["delta"].item() == pytest.approx(delta, rel=1e-6)


def test_rejects_bad_arguments_and_missing_accounting() -> None:
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyBudget(0.0)
    with pytest.raises(ValueError, match="delta"):
        PrivacyBudget(1.0, delta=2.0)
    with pytest.raises(TypeError, match="no privacy accounting"):
        make_trainer("auto", callbacks=[PrivacyBudget(1.0)]).fit(TinyModule(), loader(make_dataset(N), BATCH))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="poisson_sampling"):
            _fit(PrivacyBudget(1.0), strategy=dp(noise_multiplier=1.0, poisson_sampling=False))


# ------------------------------------------------------------------ an Opacus project


class OpacusClassifier(pl.LightningModule):
    """A Lightning project that made itself private with Opacus' PrivacyEngine (no dplightning strategy).

    What such a project does, and all PrivacyBudget needs: keep the engine as an attribute,
    call ``make_private`` in ``configure_optimizers`` and return the ``DPOptimizer``.
    """

    def __init__(self, data: TensorDataset, noise_multiplier: float, batch_size: int) -> None:
        super().__init__()
        self.net = mlp()
        self.data, self.noise_multiplier, self.batch_size = data, noise_multiplier, batch_size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Secure RNG turned off"
            self.privacy_engine = PrivacyEngine(accountant="prv")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        # wrap_model=False: Opacus hooks this module's own layers, so Lightning keeps driving the module.
        # poisson_sampling=False: Lightning owns the loader; Opacus accounts q = 1 / len(loader) (its approximation).
        _, optimizer, _ = self.privacy_engine.make_private(
            module=self, optimizer=optimizer, data_loader=self.train_dataloader(),
            noise_multiplier=self.noise_multiplier, max_grad_norm=1.0, poisson_sampling=False, wrap_model=False,
        )  # fmt: skip
        return optimizer


def test_reads_an_opacus_privacy_engine_found_on_the_module() -> None:
    delta = 1e-4  # N / BATCH = 64 batches: Opacus' q = 1/64
    target = _budget_allowing(6, PRVAccountant, sigma=1.0, q=1 / 64, delta=delta)
    module = OpacusClassifier(make_dataset(N), noise_multiplier=1.0, batch_size=BATCH)
    budget = PrivacyBudget(target, delta=delta)
    trainer = make_trainer("auto", callbacks=[budget], max_steps=50)
    trainer.fit(module)
    accountant = module.privacy_engine.accountant
    assert trainer.global_step == 6 and budget.stopped_early
    assert accountant.history == [(1.0, 1 / 64, 6)]
    assert budget.epsilon == pytest.approx(accountant.get_epsilon(delta=delta), rel=1e-12)
    assert trainer.progress_bar_metrics[progress_bar_key(delta)] >= budget.epsilon * (1 - 1e-6)  # a bound, in fp32


def test_opacus_needs_an_explicit_delta() -> None:
    module = OpacusClassifier(make_dataset(N), noise_multiplier=1.0, batch_size=BATCH)
    with pytest.raises(ValueError, match="delta="):
        make_trainer("auto", callbacks=[PrivacyBudget(1.0)]).fit(module)


# ------------------------------------------------------------------ two processes


class _RecordCallbacks(pl.Callback):
    """Writes the other callbacks' state per rank (spawned ranks cannot return it)."""

    def __init__(self, folder: str, budget: PrivacyBudget, fraction: PrivateClipFraction,
                 histogram: ClippingHistogram, tails: GradientTailStats) -> None:  # fmt: skip
        self.folder, self.budget, self.fraction, self.histogram, self.tails = folder, budget, fraction, histogram, tails

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "epsilon": self.budget.epsilon,
            "last_allowed_step": self.budget.last_allowed_step,
            "stopped_early": self.budget.stopped_early,
            "noisy_counts": self.fraction.noisy_counts,
            "histogram": [(r.examples, r.counts) for r in self.histogram.history],
            "tails": [r.examples for r in self.tails.history],
        }
        torch.save(record, f"{self.folder}/callbacks{trainer.global_rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_stop_together_and_the_count_noise_is_added_once(tmp_path) -> None:
    # One 2-process run for all callbacks: the budget (the point), the private count, and the statistics' collectives.
    sigma, sigma_b, world, batch = 1.0, 2.0, 2, 8  # per-process batch 8: q = 8 * 2 / 256, no empty local batch
    sigma_eff = (sigma**-2 + sigma_b**-2) ** -0.5
    q = batch * world / N
    target = _budget_allowing(4, RDPAccountant, sigma=sigma_eff, q=q)
    budget, fraction = PrivacyBudget(target), PrivateClipFraction(sigma_b, seed=5)
    histogram, tails = ClippingHistogram(every_n_steps=3, save_figure=False), GradientTailStats(every_n_steps=2)
    recorder = _RecordCallbacks(str(tmp_path), budget, fraction, histogram, tails)
    torch.manual_seed(0)
    ranks = run_ddp(TinyModule(), loader(make_dataset(N), batch), str(tmp_path), world=world, noise_multiplier=sigma,
                    max_grad_norm=1e-6, accountant="rdp", seed=3, max_steps=50, default_root_dir=str(tmp_path),
                    callbacks=[budget, fraction, histogram, tails, recorder])  # fmt: skip
    records = [torch.load(f"{tmp_path}/callbacks{r}.pt", weights_only=False) for r in range(world)]
    for rank, record in zip(ranks, records, strict=True):
        assert rank["steps"] == 4 and rank["history"] == ((sigma_eff, q, 4),)
        assert record["stopped_early"] and record["last_allowed_step"] == 4
        assert record["epsilon"] == rank["epsilon"] <= target < _epsilon(RDPAccountant, sigma_eff, q, 5)
    assert records[0]["noisy_counts"] == records[1]["noisy_counts"]
    # C is tiny, so every example is clipped: the count is the union's batch size; the noise is rank 0's stream only.
    assert all(len(r["batches"]) == 4 for r in ranks)  # no empty local batch, so batches align with steps
    for step, noisy in enumerate(records[0]["noisy_counts"]):
        count = sum(len(r["batches"][step][0]) for r in ranks)
        noise = GaussianNoise(derive_seed(5, "clip_count"), rank=0)
        noise.start_step(step)
        expected = noise.sample(torch.zeros((), dtype=torch.float64), sigma_b).item()
        assert noisy - count == pytest.approx(expected, abs=1e-9)
    # The statistics are summed (histogram) or gathered (tails) over both ranks' examples, identically on each rank.
    seen = sum(len(x) for r in ranks for x, _ in r["batches"])
    assert [c.tolist() for _, c in records[0]["histogram"]] == [c.tolist() for _, c in records[1]["histogram"]]
    assert [n for n, _ in records[0]["histogram"]] == [int(c.sum()) for _, c in records[0]["histogram"]]
    assert sum(n for n, _ in records[0]["histogram"]) == sum(records[1]["tails"]) == seen
    assert len(list(tmp_path.rglob("nonprivate_tail_stats.png"))) == 1  # saved once, by rank 0


def test_stopping_before_the_planned_steps_warns() -> None:
    """Training stopped at step 241 of the 690 a schedule was sized for, silently (issue 42, item 3)."""
    target = _budget_allowing(5, RDPAccountant, sigma=1.0)
    with pytest.warns(UserWarning, match=r"allows 5 step\(s\) of the 50 the Trainer planned"):
        trainer = _fit(PrivacyBudget(target))
    assert trainer.global_step == 5
