"""``PrivacyBudget``: show (ε, δ) every step and stop before the step that would exceed a target ε."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from dplightning._state import known
from dplightning.callbacks._budget_sources import BudgetSource, find_source
from dplightning.privacy.accounting import Segment, steps_within_budget


class PrivacyBudget(Callback):
    """**private**: shows ε and δ in the progress bar and the logger, and enforces a budget.

    Every step, the progress bar shows ``epsilon (δ=…)`` and the loggers get ``epsilon``
    and ``delta``; ε there is the ledger's cheap upper bound (exact on a geometric grid of
    steps), and :attr:`epsilon` is the exact value.

    After every optimizer step it checks whether one more step would take ε above
    ``target_epsilon`` and, if so, sets ``trainer.should_stop``: training ends at the last
    step whose ε ≤ ``target_epsilon``, never after it (and takes no step at all if even the
    first would exceed). If the Trainer cannot stop (``min_steps``/``min_epochs`` not met),
    the next training batch raises instead of running over budget.

    Reads only public values (the accountant's (σ, q, steps) history), so ε, δ and the
    stopping step may be released. Works with ``strategy="dp"``/``"dp_ddp"`` (it reads the
    strategy's ledger, including extra step releases) and with an Opacus project that
    calls ``PrivacyEngine().make_private(...)`` in ``configure_optimizers``: the engine is
    found as an attribute of the LightningModule, or passed as ``privacy_engine``.

    Cost: the stopping step is found once by bisection over exact ε (about 2·log2(T)
    accountant calls for T allowed steps; PRV takes about 0.1 s per call at small q and
    T < 10³ on CPU, more at large q) and recomputed only when σ or q change. The search is
    capped at the steps the Trainer plans (``trainer.estimated_stepping_batches``).

    Args:
        target_epsilon: The ε not to exceed.
        delta: δ; default the strategy's δ (required with Opacus, whose engine has none).
        privacy_engine: An ``opacus.PrivacyEngine`` to read; default: found on the module.
    """

    shows_epsilon: ClassVar[bool] = True
    """Tells the DP strategy not to add its own ε progress callback."""

    def __init__(self, target_epsilon: float, delta: float | None = None, privacy_engine: Any | None = None) -> None:
        if not target_epsilon > 0 or not math.isfinite(target_epsilon):
            raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon}.")
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {delta}.")
        self.target_epsilon = float(target_epsilon)
        self.delta = delta
        self.privacy_engine = privacy_engine
        self.stopped_early = False
        """Whether the budget ended training (rather than ``max_steps``/``max_epochs``)."""
        self._source: BudgetSource | None = None
        self._delta: float | None = None
        self._key: tuple[Any, ...] | None = None
        self._allowed = 0
        self._binding = False

    @property
    def epsilon(self) -> float:
        """Exact ε spent so far at this callback's δ (0 before training)."""
        if self._source is None or self._delta is None:
            return 0.0
        return self._source.ledger.get_epsilon(self._delta)

    @property
    def last_allowed_step(self) -> int | None:
        """The last step the budget allows, capped at the steps planned (``None`` before training)."""
        return None if self._source is None else self._allowed

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._source = find_source(trainer, pl_module, self.privacy_engine)
        self._delta = self.delta if self.delta is not None else self._source.default_delta
        if self._delta is None:
            raise ValueError("PrivacyBudget needs delta= here: the privacy accounting in use does not define δ.")
        self._key = None
        self._stop_if_exhausted(trainer)
        if trainer.should_stop and self._source.ledger.steps == 0:
            rank_zero_warn(f"PrivacyBudget: even one step would exceed ε = {self.target_epsilon}; no step is taken.")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        known(self._source, "the DP strategy (set in setup)")
        if self._binding and self._source.ledger.steps >= self._allowed:
            # Only reached if the Trainer ignored should_stop (min_steps/min_epochs): refuse to go over budget.
            raise RuntimeError(
                f"PrivacyBudget: the budget ε = {self.target_epsilon} is spent after {self._allowed} steps but the "
                "Trainer keeps training (min_steps or min_epochs not met). Lower them or raise the budget."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        known(self._source, "the DP strategy (set in setup)")
        known(self._delta, "δ")
        if self._source.ledger.steps:
            self._log(pl_module, self._source.ledger.epsilon_bound(self._delta), self._delta)
        self._stop_if_exhausted(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stopped_early and self._source is not None:
            rank_zero_info(
                f"PrivacyBudget: stopped after {self._source.ledger.steps} steps at (ε = {self.epsilon:.4g}, "
                f"δ = {self._delta:.3g}); one more step would exceed ε = {self.target_epsilon}."
            )

    @staticmethod
    def _log(pl_module: pl.LightningModule, epsilon: float, delta: float) -> None:
        options: dict[str, Any] = dict(on_step=True, on_epoch=False, rank_zero_only=True)
        logger = bool(pl_module.trainer.loggers)  # without a logger, Lightning would warn on every step
        pl_module.log_dict({"epsilon": epsilon, "delta": delta}, prog_bar=False, logger=logger, **options)
        # δ goes into the name: progress bars print values with 3 decimals (Rich: "0.000" for δ = 8e-05).
        pl_module.log(progress_bar_key(delta), epsilon, prog_bar=True, logger=False, **options)

    def _stop_if_exhausted(self, trainer: pl.Trainer) -> None:
        known(self._source, "the DP strategy (set in setup)")
        steps = self._source.ledger.steps
        if 0 <= trainer.max_steps <= trainer.global_step:
            return  # max_steps ends training anyway; no need to look further ahead
        self._update_allowed(trainer, steps)
        if self._binding and steps >= self._allowed:
            trainer.should_stop = True
            self.stopped_early = True
            planned = trainer.estimated_stepping_batches
            if math.isfinite(planned) and trainer.global_step < planned:
                # A learning-rate schedule sized for the planned steps ends early too: say so once.
                rank_zero_warn(
                    f"PrivacyBudget: ε = {self.target_epsilon:.4g} allows {trainer.global_step} step(s) of the "
                    f"{int(planned)} the Trainer planned; training stops there. A schedule sized by "
                    "estimated_stepping_batches (OneCycleLR, cosine) did not finish. To spend the budget over the "
                    "whole run, give the strategy target_epsilon instead (σ is then calibrated for the planned steps)."
                )

    def _update_allowed(self, trainer: pl.Trainer, steps: int) -> None:
        """Recompute the last allowed step when (prefix, σ, q) change or a non-binding cap is reached."""
        known(self._source, "the DP strategy (set in setup)")
        known(self._delta, "δ")
        sigma, q = self._source.next_step()
        prefix, tail = _split_tail(self._source.ledger.history, sigma, q)
        key = (prefix, sigma, q)
        if key == self._key and (self._binding or steps < self._allowed):
            return
        done = sum(t for _, _, t in prefix)
        planned = trainer.estimated_stepping_batches
        limit = max(int(planned) - done, tail + 1) if math.isfinite(planned) else None
        accountant = self._source.ledger.accountant
        n = steps_within_budget(prefix, sigma, q, self.target_epsilon, self._delta, accountant, limit)
        # Every rank holds the same ledger; rank 0's answer makes sure all ranks stop at the same step.
        self._allowed, self._binding = trainer.strategy.broadcast((done + n, limit is None or n < limit))
        self._key = key


def progress_bar_key(delta: float) -> str:
    """The progress bar entry of ε at ``delta``, e.g. ``"epsilon (δ=7.9e-05)"``."""
    return f"epsilon (δ={delta:.2g})"


def _split_tail(history: tuple[Segment, ...], sigma: float, q: float) -> tuple[tuple[Segment, ...], int]:
    """Split off the final segment if it runs (σ, q): the ledger merges the next steps into it."""
    if history and history[-1][:2] == (sigma, q):
        return history[:-1], history[-1][2]
    return history, 0
