"""CRPS of sample forecasts in CSDI's quantile-loss form, as a torchmetrics ``Metric`` and a function.

CSDI (Tashiro et al. 2021, ``utils.py``: ``calc_quantile_CRPS`` and ``calc_quantile_CRPS_sum``)
computes both scores on **de-normalised** values: samples and targets are mapped back with the
per-channel ``x·std + mean`` before the quantiles are taken, and the denominator Σ|y·M| is in
the data's units. In z-score space that denominator is a sum of values scattered around 0, so
the ratio is not comparable with CSDI's tables; pass ``mean``/``std`` to score like CSDI.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

CSDI_QUANTILES = tuple(round(0.05 * i, 2) for i in range(1, 20))
"""The 19 levels 0.05, 0.10, ..., 0.95."""


def denormalise(x: Tensor, mean: Tensor | None = None, std: Tensor | None = None) -> Tensor:
    """``x·std + mean`` over the last (feature) axis; the identity when both are ``None``.

    Args:
        x: ``[..., K]`` values in z-score units.
        mean: ``[K]`` per-channel means (the scaler's).
        std: ``[K]`` per-channel standard deviations.

    Raises:
        ValueError: If only one of ``mean`` and ``std`` is given.
    """
    if mean is None and std is None:
        return x
    if mean is None or std is None:
        raise ValueError("Give both mean and std (the scaler of the data), or neither.")
    return x * std.to(x) + mean.to(x)


def quantile_losses(
    samples: Tensor, target: Tensor, mask: Tensor, quantiles: tuple[float, ...] = CSDI_QUANTILES
) -> tuple[Tensor, Tensor]:
    """The summed quantile losses ``[Q]`` and the denominator Σ|y·M| of one batch (float64).

    Args:
        samples: ``[S, *shape]``.
        target: ``[*shape]``.
        mask: ``[*shape]``, the weight of each point (1 = evaluated).
        quantiles: Levels q.
    """
    samples, target, mask = samples.double(), target.double(), mask.double()
    levels = torch.tensor(quantiles, dtype=samples.dtype, device=samples.device)
    predicted = torch.quantile(samples, levels, dim=0)  # [Q, *shape], linear interpolation like CSDI
    indicator = (target <= predicted).to(target.dtype)
    loss = 2 * ((predicted - target) * mask * (indicator - levels.view(-1, *[1] * target.dim()))).abs()
    return loss.flatten(1).sum(1), (target * mask).abs().sum()


def _prepare(
    samples: Tensor, target: Tensor, mask: Tensor | None, sum_features: bool, mean: Tensor | None, std: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """De-normalise, then (CRPS-sum) sum samples and targets over the features and average the mask."""
    samples, target = denormalise(samples.double(), mean, std), denormalise(target.double(), mean, std)
    mask = torch.ones_like(target) if mask is None else mask.to(target.dtype)
    if sum_features:
        samples, target, mask = samples.sum(-1), target.sum(-1), mask.mean(-1)
    return samples, target, mask


def quantile_crps(
    samples: Tensor,
    target: Tensor,
    mask: Tensor | None = None,
    *,
    sum_features: bool = False,
    mean: Tensor | None = None,
    std: Tensor | None = None,
    quantiles: tuple[float, ...] = CSDI_QUANTILES,
) -> Tensor:
    """CSDI's CRPS (or CRPS-sum) of one set of samples: :class:`QuantileCRPS` on a single batch.

    Args:
        samples: ``[S, ..., K]``.
        target: ``[..., K]``.
        mask: ``[..., K]``, 1 where the point is evaluated (default: everywhere).
        sum_features: CRPS-sum: score the sum over the K channels.
        mean: Per-channel means ``[K]``: score ``x·std + mean`` (CSDI), with ``std``.
        std: Per-channel standard deviations ``[K]``.
        quantiles: Levels q.
    """
    losses, denominator = quantile_losses(*_prepare(samples, target, mask, sum_features, mean, std), quantiles)
    return (losses / denominator).mean()


class QuantileCRPS(Metric):
    """Normalised CRPS approximated by quantile losses (CSDI, Tashiro et al. 2021).

    CRPS = (1/|Q|) Σ_q 2 Σ |(F̂_q − y)·M·(1{y ≤ F̂_q} − q)| / Σ |y·M|, with F̂_q the per-point
    q-quantile of the samples (``torch.quantile``, linear interpolation, as CSDI) and M the
    evaluation mask. Sums run over everything seen since the last reset, like CSDI's
    accumulation over the test set. With ``sum_features=True`` it is CRPS-sum: samples and
    targets are first summed over the feature axis (the last one) and M is averaged over it,
    as CSDI does (the sums are unmasked: meant for masks that are constant across features,
    like a forecast horizon). With ``mean``/``std`` given to :meth:`update`, samples and
    targets are de-normalised first (``x·std + mean`` per channel), as CSDI scores them.

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

    def update(
        self,
        samples: Tensor,
        target: Tensor,
        mask: Tensor | None = None,
        mean: Tensor | None = None,
        std: Tensor | None = None,
    ) -> None:
        """Add a batch.

        Args:
            samples: ``[S, *shape]``, S samples of every point.
            target: ``[*shape]``.
            mask: ``[*shape]``, 1 where the point is evaluated (default: everywhere).
            mean: Per-channel means (last axis) to de-normalise with; ``None``: score as given.
            std: Per-channel standard deviations, given together with ``mean``.
        """
        losses, denominator = quantile_losses(
            *_prepare(samples, target, mask, self.sum_features, mean, std), self.quantiles
        )
        self.losses += losses
        self.denominator += denominator

    def compute(self) -> Tensor:
        return (self.losses / self.denominator).mean()
