"""The module side of the per-example loss contract: one loss per privacy unit, reduced to ``training_step``'s.

The DP strategy clips each privacy unit's gradient, so each unit's loss must depend on that unit alone: a module
first reduces each example's own terms (the mean over *its* target tokens, over *its* noise draws, ...) to one loss
per unit, ``[n]``, then hands them to :func:`training_loss`. That reduces them over the batch the way the
strategy's ``loss_reduction`` says (``"mean"`` by default: the strategy multiplies the captured gradients by n to
get each unit's own) and logs the result as ``nonprivate/train_loss``. See docs/dp_sgd_core.md, "The per-example
loss contract".

Every built-in LightningModule's ``training_step`` ends in :func:`training_loss`.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
from torch import Tensor

LossReduction = Literal["mean", "sum"]
TRAIN_LOSS_KEY = "nonprivate/train_loss"
"""Where :func:`training_loss` logs: the loss comes from the private batch and is not differentially private."""


def batch_loss(per_unit: Tensor, reduction: LossReduction = "mean") -> Tensor:
    """The batch's loss from one loss per privacy unit, as the strategy's ``loss_reduction`` expects it.

    ``"mean"`` divides the sum by ``max(n, 1)``: an empty Poisson batch (the strategy runs ``training_step`` on it,
    so that every rank reaches the same collectives) then gives a finite zero that is still part of the graph.

    Args:
        per_unit: ``[n]`` losses, one per privacy unit of the batch.
        reduction: ``"mean"`` or ``"sum"``, the strategy's ``loss_reduction``.

    Returns:
        A scalar loss.

    Raises:
        ValueError: If ``per_unit`` is not one-dimensional (per-token or per-pixel terms not yet reduced per
            example), or ``reduction`` is unknown.
    """
    if per_unit.dim() != 1:
        raise ValueError(
            f"Expected one loss per privacy unit (shape [n]), got shape {tuple(per_unit.shape)}: reduce each "
            "example's own terms first (e.g. the mean over its target tokens), never over the whole batch."
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (the strategy's loss_reduction), not {reduction!r}.")
    total = per_unit.sum()
    return total / max(len(per_unit), 1) if reduction == "mean" else total


def training_loss(module: pl.LightningModule, per_unit: Tensor, reduction: LossReduction = "mean") -> Tensor:
    """:func:`batch_loss` of ``per_unit``, logged by ``module`` as ``nonprivate/train_loss``: ``training_step``'s loss.

    Args:
        module: The LightningModule whose ``training_step`` this is (it does the logging).
        per_unit: ``[n]`` losses, one per privacy unit of the batch.
        reduction: ``"mean"`` or ``"sum"``, the strategy's ``loss_reduction``.

    Returns:
        The scalar loss to return from ``training_step``.
    """
    loss = batch_loss(per_unit, reduction)
    module.log(TRAIN_LOSS_KEY, loss, batch_size=len(per_unit))
    return loss
