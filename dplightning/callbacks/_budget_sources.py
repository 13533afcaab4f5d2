"""Where :class:`~dplightning.callbacks.PrivacyBudget` reads the privacy spent: a DP strategy or Opacus.

Both sources expose the same three things: a :class:`PrivacyLedger` with the history so
far, the (σ, q) the next step will be accounted with, and a default δ. All are public
values, so everything derived from them may be released.
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl

from dplightning.privacy.accounting import PrivacyLedger
from dplightning.protocols import AccountingSource, dp_state_of


class BudgetSource(Protocol):
    """What the budget needs: the history, the next step's (σ, q) and a default δ."""

    @property
    def ledger(self) -> PrivacyLedger:
        """The accounted history so far."""
        ...

    @property
    def default_delta(self) -> float | None:
        """δ to use when the callback was given none."""
        ...

    def next_step(self) -> tuple[float, float]:
        """(σ, q) the next step will be accounted with."""
        ...


class StrategySource:
    """A DP strategy's own ledger, read from its DP state (see :class:`~dplightning.callbacks.AccountingSource`)."""

    def __init__(self, state: AccountingSource) -> None:
        if not state.poisson_sampling:
            raise ValueError("PrivacyBudget needs poisson_sampling=True: without it ε is infinite from the first step.")
        self.state = state

    @property
    def ledger(self) -> PrivacyLedger:
        return self.state.ledger

    @property
    def default_delta(self) -> float | None:
        return self.state.delta

    def next_step(self) -> tuple[float, float]:
        sigma, q = self.state.accounted_noise_multiplier, self.state.sample_rate
        if sigma is None or q is None:
            raise RuntimeError("The strategy's σ and q are unknown before its train loader is set up.")
        return sigma, q


class OpacusSource:
    """An Opacus ``PrivacyEngine``'s accountant, mirrored into a :class:`PrivacyLedger`.

    The accountant records (σ, q, steps) in ``optimizer.step()``; the mirror replays new
    steps so that the ledger's cached exact ε and cheap bound work for Opacus projects too.
    Before the first step q is not recorded yet; it is then taken as ``1 / len(train loader)``,
    which is what ``make_private`` uses when given the Trainer's train loader.

    Args:
        engine: The ``opacus.PrivacyEngine`` (its ``accountant`` has ``history`` and ``mechanism()``).
        optimizer: The ``DPOptimizer`` it returned (its ``noise_multiplier`` is the next step's σ).
        batches_per_epoch: Length of the train loader passed to ``make_private``.
    """

    def __init__(self, engine: Any, optimizer: Any, batches_per_epoch: int) -> None:
        self.accountant = engine.accountant
        self.optimizer = optimizer
        self.first_sample_rate = 1.0 / batches_per_epoch
        self._ledger = PrivacyLedger(self.accountant.mechanism())

    @property
    def ledger(self) -> PrivacyLedger:
        seen = 0
        for sigma, q, n in self.accountant.history:  # history only grows at its end: replay the steps not seen
            self._ledger.step(sigma, q, seen + n - max(seen, self._ledger.steps))
            seen += n
        return self._ledger

    @property
    def default_delta(self) -> float | None:
        return None  # Opacus' engine does not know δ

    def next_step(self) -> tuple[float, float]:
        history = self.accountant.history
        q = history[-1][1] if history else self.first_sample_rate
        return float(self.optimizer.noise_multiplier), float(q)


def find_source(trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Any | None) -> BudgetSource:
    """The strategy if it is a DP strategy, else the Opacus engine given or found on the module.

    Raises:
        TypeError: If neither is available.
    """
    state = dp_state_of(trainer.strategy)
    if engine is None and isinstance(state, AccountingSource):
        return StrategySource(state)
    engine = engine if engine is not None else _find_engine(pl_module)
    optimizer = _find_dp_optimizer(trainer)
    if engine is None or optimizer is None:
        raise TypeError(
            "PrivacyBudget found no privacy accounting: use a DP strategy (Trainer(strategy='dp')), or call "
            "opacus.PrivacyEngine().make_private(...) in configure_optimizers, keep the engine as an attribute "
            "of the LightningModule (or pass PrivacyBudget(privacy_engine=...)) and return its DPOptimizer."
        )
    return OpacusSource(engine, optimizer, _batches_per_epoch(trainer))


def _find_engine(pl_module: pl.LightningModule) -> Any | None:
    from opacus import PrivacyEngine

    engines = [v for v in vars(pl_module).values() if isinstance(v, PrivacyEngine)]
    if len(engines) > 1:
        raise ValueError("The LightningModule holds several PrivacyEngines; pass PrivacyBudget(privacy_engine=...).")
    return engines[0] if engines else None


def _find_dp_optimizer(trainer: pl.Trainer) -> Any | None:
    from opacus.optimizers import DPOptimizer

    found = [opt for opt in trainer.optimizers if isinstance(opt, DPOptimizer)]
    return found[0] if len(found) == 1 else None


def _batches_per_epoch(trainer: pl.Trainer) -> int:
    loader = trainer.train_dataloader
    if loader is None or not hasattr(loader, "__len__"):
        raise ValueError("PrivacyBudget with Opacus needs a train loader with a length (Opacus uses q = 1 / length).")
    return len(loader)
