"""The module-side per-example loss: one reduction over the privacy units, used by every built-in training_step."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from dplightning.commands.audit import _CanaryProbe
from dplightning.losses import TRAIN_LOSS_KEY, batch_loss, training_loss
from dplightning.tasks import DPCausalLM, DPDiffusion, DPSequenceClassifier, DPTimeSeriesDiffusion, ImageClassifier


class _Logged(pl.LightningModule):
    """Records its ``self.log`` calls instead of sending them to a Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, float, dict[str, Any]]] = []

    def log(self, name: str, value: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append((name, float(value), kwargs))


def test_the_mean_is_the_sum_over_the_units_divided_by_their_number() -> None:
    per_unit = torch.tensor([1.0, 2.0, 6.0])
    assert batch_loss(per_unit).item() == 3.0
    assert batch_loss(per_unit, "sum").item() == 9.0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_empty_batch_gives_a_zero_loss_that_backpropagates(reduction: str) -> None:
    weight = torch.ones(3, requires_grad=True)
    loss = batch_loss(torch.zeros(0, 3) @ weight, reduction)  # type: ignore[arg-type]
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(weight.grad, torch.zeros(3))


def test_each_units_gradient_is_its_own_divided_by_the_batch_size() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    batch_loss(x.square()).backward()
    assert torch.equal(x.grad, 2 * x.detach() / 4)


def test_losses_not_reduced_per_example_are_refused() -> None:
    with pytest.raises(ValueError, match=r"one loss per privacy unit \(shape \[n\]\), got shape \(2, 3\)"):
        batch_loss(torch.ones(2, 3))
    with pytest.raises(ValueError, match="got shape \\(\\)"):
        batch_loss(torch.tensor(1.0))


def test_an_unknown_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        batch_loss(torch.ones(2), "max")  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [3, 0])
def test_training_loss_logs_the_batch_loss_as_nonprivate_with_the_units_as_batch_size(rows: int) -> None:
    module = _Logged()
    loss = training_loss(module, torch.arange(float(rows)))
    assert module.calls == [(TRAIN_LOSS_KEY, loss.item(), {"batch_size": rows})]
    assert TRAIN_LOSS_KEY == "nonprivate/train_loss"


def _calls(function: Any) -> set[str]:
    """Names of the functions ``function``'s body calls (``f(...)`` and ``x.f(...)``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = node.func
            names.add(called.id if isinstance(called, ast.Name) else getattr(called, "attr", ""))
    return names


@pytest.mark.parametrize(
    "module", [ImageClassifier, DPSequenceClassifier, DPCausalLM, DPDiffusion, DPTimeSeriesDiffusion, _CanaryProbe]
)
def test_every_built_in_training_step_reduces_through_the_one_helper(module: type[pl.LightningModule]) -> None:
    calls = _calls(module.training_step)
    assert calls & {"training_loss", "batch_loss"}, f"{module.__name__}.training_step reduces the loss by hand"
    assert "log" not in calls, f"{module.__name__}.training_step logs the loss itself"
