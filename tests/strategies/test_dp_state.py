"""The public DP state (``strategy.dp_state``): one read-only object that callbacks read instead of the strategy."""

from __future__ import annotations

import ast
import inspect
import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import dplightning
from dplightning.callbacks import ClippingHistogram, GradientTailStats, PrivacyBudget, PrivateClipFraction
from dplightning.protocols import (
    AccountingSource,
    NormSource,
    RegistersStepReleases,
    StepReleaseSource,
    dp_state_of,
)
from dplightning.strategies import _dp, state
from dplightning.strategies.state import DPState
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

N, BATCH = 64, 8

ALIASES = [
    "noise_multiplier",
    "accounted_noise_multiplier",
    "ledger",
    "poisson_sampling",
    "max_grad_norm",
    "target_epsilon",
    "sample_rate",
    "expected_batch_size",
    "delta",
    "steps",
    "noise_mechanism",
    "noise_strategy",
    "noise_sensitivity",
    "noise_std",
    "last_step_stats",
    "nonfinite_examples",
    "probing",
]
"""The strategy's deprecated aliases of ``dp_state``: what the docs, scripts and tests read on the strategy."""

REMOVED = ["step_releases", "secure_mode", "clip_groups", "privatized_parameter_names"]
"""Forwarding properties that only the library's callbacks read: now on ``dp_state`` alone."""


def _fit(strategy: dplightning.DPStrategy, callbacks: list[Any], steps: int = 3) -> Any:
    trainer = make_trainer(strategy, callbacks=callbacks, max_steps=steps, enable_progress_bar=True)  # shows ε
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    return trainer


def test_the_state_is_one_object_for_the_strategys_life_and_the_aliases_read_it() -> None:
    strategy = dp(noise_multiplier=1.0, max_grad_norm=0.5, seed=0)
    state_before = strategy.dp_state
    assert isinstance(state_before, DPState) and state_before.steps == 0 and state_before.sample_rate is None
    _fit(strategy, [PrivateClipFraction(4.0, seed=0)])
    assert strategy.dp_state is state_before and dp_state_of(strategy) is state_before
    state_after = strategy.dp_state
    assert state_after.steps == 3 and state_after.sample_rate == BATCH / N and state_after.delta == 1 / (10 * N)
    assert state_after.step_releases == {"clip_count": 4.0} and state_after.noise_std == 0.5
    assert state_after.max_grad_norm == 0.5 and not state_after.secure_mode and state_after.poisson_sampling
    assert len(state_after.last_step_stats) == 1 and state_after.nonfinite_examples == 0
    assert state_after.clip_groups == [] and state_after.privatized_parameter_names == []  # the fit is over
    for name in ALIASES:
        with pytest.warns(DeprecationWarning, match=rf"strategy\.{name} is deprecated.*dp_state\.{name}") as caught:
            alias = getattr(strategy, name)
        assert [w.filename for w in caught] == [__file__], name  # attributed to the reading line, not the library
        value = getattr(state_after, name)
        assert alias is value or alias == value, name
        assert "Deprecated alias" in (getattr(type(strategy), name).__doc__ or ""), name
    with pytest.warns(DeprecationWarning):
        assert strategy.ledger is state_after.ledger
    assert (
        strategy.get_epsilon() == state_after.get_epsilon() and strategy.epsilon_bound() == state_after.epsilon_bound()
    )
    for name in REMOVED:
        assert not hasattr(strategy, name) and hasattr(state_after, name), name


def test_the_state_is_read_only() -> None:
    state_now = dp().dp_state
    for name in [*ALIASES, *REMOVED]:
        with pytest.raises(AttributeError):
            setattr(state_now, name, getattr(state_now, name))


def test_the_state_and_the_strategy_satisfy_the_interfaces() -> None:
    strategy = dp()
    for interface in (AccountingSource, NormSource, StepReleaseSource):
        assert isinstance(strategy.dp_state, interface), interface.__name__
    assert isinstance(strategy, RegistersStepReleases)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python < 3.12 reads the members to check them
        assert isinstance(strategy, AccountingSource)  # through the deprecated aliases: code that checked it still runs
    assert not isinstance(strategy.dp_state, RegistersStepReleases)  # the state cannot be written


def test_a_strategy_without_a_state_object_is_read_as_it_is() -> None:
    plain = object()
    assert dp_state_of(plain) is plain


class _NoAliases(dplightning.DPStrategy):
    """A DP strategy whose deprecated aliases fail when read: whoever reads them is caught."""


def _refuse(name: str) -> property:
    def read(self: Any) -> Any:
        raise RuntimeError(f"the strategy's alias {name!r} was read; read dp_state.{name}")

    return property(read)


for _name in ALIASES:
    setattr(_NoAliases, _name, _refuse(_name))


def test_the_callbacks_and_the_hooks_read_the_state_not_the_strategy() -> None:
    histogram = ClippingHistogram(save_figure=False)
    tails = GradientTailStats(every_n_steps=1, save_figure=False)
    fraction = PrivateClipFraction(4.0, seed=0)
    trainer = _fit(_NoAliases(noise_multiplier=1.0, seed=0), [histogram, tails, fraction])
    assert len(histogram.history) == 3 and len(tails.history) == 3 and len(fraction.noisy_counts) == 3
    assert "epsilon" in trainer.callback_metrics  # the strategy's own ε progress
    budget = PrivacyBudget(target_epsilon=100.0)
    _fit(_NoAliases(noise_multiplier=1.0, seed=0), [budget])
    assert budget.epsilon is not None and budget.epsilon > 0


def _step_internals(module: Any) -> list[str]:
    """Reads of a private step's private attributes or of its parts (hooks, privatizer, noise, ...) in ``module``."""
    internals = {"hooks", "privatizer", "noise", "accumulation", "verification", "transforms"}
    tree = ast.parse(Path(inspect.getfile(module)).read_text())

    def is_step(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "step"
        return isinstance(node, ast.Attribute) and node.attr in {"private_step", "step"}

    return [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and is_step(node.value)
        and (node.attr.startswith("_") or node.attr in internals)
    ]  # fmt: skip


@pytest.mark.parametrize("module", [_dp, state], ids=["_dp", "state"])
def test_the_hooks_and_the_state_use_only_the_private_steps_public_surface(module: Any) -> None:
    assert _step_internals(module) == []


def test_a_fit_without_a_target_says_which_epsilon_it_will_reach(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 42 item 3: σ given, no target: the first lines name the ε at the planned steps, the one reached."""
    strategy = dp(noise_multiplier=1.3)
    with caplog.at_level(logging.INFO):
        make_trainer(strategy, max_steps=6).fit(TinyModule(), loader(make_dataset(64), 16))
    (line,) = [m for m in caplog.messages if m.startswith("No target_epsilon")]
    planned = float(re.search(r"reaches ε = ([0-9.]+)", line).group(1))
    assert "at the 6 planned steps" in line
    assert planned == pytest.approx(strategy.get_epsilon(), rel=1e-3)
