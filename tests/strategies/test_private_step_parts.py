"""The parts PrivateStep is composed of: gradient verification and manual accumulation, on their own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dplightning.privacy.grad_sample.grads import Dense
from dplightning.strategies.accumulation import ManualAccumulation
from dplightning.strategies.verification import VERIFIED_STEPS, GradientVerification


def _checked_steps(verification: GradientVerification, rows_per_step: list[int]) -> list[bool]:
    """Whether each step (one batch of that many rows) was checked; the check itself passes."""
    layer = nn.Linear(2, 1, bias=False)
    layer.weight.grad = torch.zeros_like(layer.weight)
    checked = []
    for rows in rows_per_step:
        checked.append(verification.active)
        if verification.active:
            verification.check(layer, [layer.weight], {}, {}, rows)
        verification.step_done()
    return checked


def test_first_steps_checks_the_first_steps_with_rows_and_again_after_a_restart() -> None:
    verification = GradientVerification("first_steps")
    # An empty Poisson batch does not count as a checked step.
    assert _checked_steps(verification, [0, 3, 0, 4, 5]) == [True, True, True, True, False]
    assert VERIFIED_STEPS == 2
    verification.restart()
    assert _checked_steps(verification, [3, 3, 3]) == [True, True, False]


@pytest.mark.parametrize(("mode", "active"), [("always", True), ("never", False)])
def test_always_and_never_do_not_count(mode: str, active: bool) -> None:
    assert _checked_steps(GradientVerification(mode), [3, 3, 3, 3]) == [active] * 4


def test_a_gradient_that_bypassed_the_hooks_is_named() -> None:
    module = nn.Sequential(nn.Linear(2, 1, bias=False))
    weight = module[0].weight
    per_example = torch.ones(3, *weight.shape)
    weight.grad = per_example.sum(0)
    verification = GradientVerification("first_steps")
    verification.check(module, [weight], {weight: Dense(per_example)}, {}, 3)  # equal: passes
    weight.grad = weight.grad + 1.0  # a contribution the hooks did not see
    with pytest.raises(RuntimeError, match=r"0\.weight \(relative error"):
        verification.check(module, [weight], {weight: Dense(per_example)}, {}, 3)


def test_manual_accumulation_sums_each_parameters_passes_and_empties() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    accumulation = ManualAccumulation()
    assert not accumulation.pending and accumulation.take() is None
    first, second, other = torch.randn(4, 2), torch.randn(4, 2), torch.randn(4, 3)
    accumulation.add({a: Dense(first), b: Dense(other)}, scale=2.0)
    accumulation.add({a: Dense(second)}, scale=3.0)
    assert accumulation.pending
    taken = accumulation.take()
    assert taken is not None
    grads, scale = taken
    assert scale == 3.0 and set(grads) == {a, b}
    ones = torch.ones(4)
    torch.testing.assert_close(grads[a].weighted_sum(ones), (first + second).sum(0))
    torch.testing.assert_close(grads[b].weighted_sum(ones), other.sum(0))
    assert not accumulation.pending and accumulation.take() is None
    accumulation.add({a: Dense(first)}, scale=1.0)
    accumulation.clear()
    assert not accumulation.pending
