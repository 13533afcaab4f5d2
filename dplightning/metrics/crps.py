"""CRPS of sample forecasts in CSDI's quantile-loss form, as a torchmetrics ``Metric``."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

CSDI_QUANTILES = tuple(round(0.05 * i, 2) for i in range(1, 20))
"""The 19 levels 0.05, 0.10, ..., 0.95."""


class QuantileCRPS(Metric):
    """Normalised CRPS approximated by quantile losses (CSDI, Tashiro et al. 2021).

    CRPS = (1/|Q|) Σ_q 2 Σ |(F̂_q − y)·M·(1{y ≤ F̂_q} − q)| / Σ |y·M|, with F̂_q the per-point
    q-quantile of the samples (``torch.quantile``, linear interpolation, as CSDI) and M the
    evaluation mask. Sums run over everything seen since the last reset, like CSDI's
    accumulation over the test set. With ``sum_features=True`` it is CRPS-sum: samples and
    targets are first summed over the feature axis (the last one) and M is averaged over it,
    as CSDI does (the sums are unmasked: meant for masks that are constant across features,
    like a forecast horizon).

    Args:
        quantiles: Quantile levels.
        sum_features: Compute CRPS-sum.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, quantiles: tuple[float, ...] = CSDI_QUANTILES, sum_features: bool = False) -> None:
        super().__init__()
        self.quantiles = quantiles
        self.sum_features = sum_features
        self.add_state("losses", default=torch.zeros(len(quantiles), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("denominator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, samples: Tensor, target: Tensor, mask: Tensor | None = None) -> None:
        """Add a batch.

        Args:
            samples: ``[S, *shape]``, S samples of every point.
            target: ``[*shape]``.
            mask: ``[*shape]``, 1 where the point is evaluated (default: everywhere).
        """
        samples, target = samples.double(), target.double()  # float64 sums over a whole test set
        mask = torch.ones_like(target) if mask is None else mask.to(target.dtype)
        if self.sum_features:
            samples, target, mask = samples.sum(-1), target.sum(-1), mask.mean(-1)
        levels = torch.tensor(self.quantiles, dtype=samples.dtype, device=samples.device)
        predicted = torch.quantile(samples, levels, dim=0)  # [Q, *shape]
        indicator = (target <= predicted).to(target.dtype)
        loss = 2 * ((predicted - target) * mask * (indicator - levels.view(-1, *[1] * target.dim()))).abs()
        self.losses += loss.flatten(1).sum(1)
        self.denominator += (target * mask).abs().sum()

    def compute(self) -> Tensor:
        return (self.losses / self.denominator).mean()
