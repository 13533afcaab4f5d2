"""The subsampled Gaussian mechanism on gradients: clip, sum, noise once, average.

:class:`GradientPrivatizer` owns persistent fp32 buckets laid out in parameter order
(identical on every rank, independent of the data). Each backward pass adds its
clipped per-example gradients to them; one release per optimizer step adds
N(0, (σΔ)²) noise, lets a reducer combine the ranks, divides by the public expected
batch size and writes the result to ``p.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dplightning.privacy.clipping import ClipGroup, clip_factors, joint_sensitivity
from dplightning.privacy.noise import GaussianNoise

if TYPE_CHECKING:
    from torch.distributed import Work

BucketReducer = Callable[[Tensor], "Work | None"]
"""Starts the in-place cross-rank sum of one bucket; may return an async handle to wait on."""


@dataclass
class _Slot:
    param: nn.Parameter
    bucket: int
    offset: int

    def view(self, buckets: Sequence[Tensor]) -> Tensor:
        numel = self.param.numel()
        return buckets[self.bucket][self.offset : self.offset + numel].view(self.param.shape)


@dataclass
class MicroBatchStats:
    """What one backward pass contributed, for diagnostics (not private).

    Attributes:
        norms: Per-example gradient norms per clip group, fp32, shape ``[n, groups]``
            (after the accumulation rescale, before clipping).
        param_sq_norms: Per-example squared norms per privatized parameter, fp32,
            ``[n, params]`` in :attr:`GradientPrivatizer.params` order; ``norms`` are
            the square roots of their sums over each group.
        nonfinite: Number of examples whose gradient was not finite (they add zero).
    """

    norms: Tensor
    param_sq_norms: Tensor
    nonfinite: int


class GradientPrivatizer:
    """Accumulates clipped per-example gradients and releases their noisy average.

    Args:
        groups: Clip groups; their parameters, in order, define the bucket layout.
        bucket_cap_mb: Largest bucket in MiB of fp32 (the unit of noise and all-reduce).
    """

    def __init__(self, groups: Sequence[ClipGroup], bucket_cap_mb: float = 25.0) -> None:
        if not groups or not any(g.params for g in groups):
            raise ValueError("Nothing to privatize: no trainable parameters are in the optimizer.")
        self.groups = list(groups)
        self.sensitivity = joint_sensitivity(self.groups)
        self.params = [p for g in self.groups for p in g.params]
        offsets = [0]
        for g in self.groups:
            offsets.append(offsets[-1] + len(g.params))
        self._group_columns = [torch.arange(a, b) for a, b in zip(offsets, offsets[1:])]
        self.buckets, self._slots = self._layout(self.params, int(bucket_cap_mb * 2**20 / 4))
        self._released = False

    @staticmethod
    def _layout(params: Sequence[nn.Parameter], cap: int) -> tuple[list[Tensor], dict[nn.Parameter, _Slot]]:
        sizes: list[int] = []
        devices: list[torch.device] = []
        slots: dict[nn.Parameter, _Slot] = {}
        for p in params:
            if not sizes or sizes[-1] + p.numel() > cap or devices[-1] != p.device:
                sizes.append(0)
                devices.append(p.device)
            slots[p] = _Slot(p, len(sizes) - 1, sizes[-1])
            sizes[-1] += p.numel()
        buckets = [torch.zeros(n, dtype=torch.float32, device=d) for n, d in zip(sizes, devices)]
        return buckets, slots

    def accumulate(self, grad_samples: dict[nn.Parameter, Tensor], scale: float = 1.0) -> MicroBatchStats:
        """Clip the per-example gradients of one backward pass and add them to the buckets.

        Args:
            grad_samples: ``[n, *p.shape]`` per-example gradients; missing parameters count as zero.
            scale: Factor applied to every per-example gradient before clipping (e.g. the
                accumulation factor Lightning divided the loss by).
        """
        if self._released:
            for b in self.buckets:
                b.zero_()
            self._released = False
        rows = {gs.shape[0] for gs in grad_samples.values()}
        if len(rows) > 1:
            raise RuntimeError(f"Per-example gradients disagree on the number of examples: {sorted(rows)}.")
        n = rows.pop() if rows else 0
        param_sq = self._param_sq_norms(grad_samples, n) * scale**2
        norms = torch.stack([param_sq[:, idx].sum(dim=1) for idx in self._group_columns], dim=1).sqrt()
        finite = torch.isfinite(norms).all(dim=1)
        nonfinite = int(n - finite.sum().item())
        factors = torch.stack([clip_factors(norms[:, j], g.max_norm) for j, g in enumerate(self.groups)], dim=1)
        factors = factors * finite.unsqueeze(1) * scale
        for j, group in enumerate(self.groups):
            for p in group.params:
                if p in grad_samples:
                    self._add_clipped(p, grad_samples[p], factors[:, j], finite if nonfinite else None)
        return MicroBatchStats(norms=norms, param_sq_norms=param_sq, nonfinite=nonfinite)

    def _param_sq_norms(self, grad_samples: dict[nn.Parameter, Tensor], n: int) -> Tensor:
        sq = torch.zeros(n, len(self.params), dtype=torch.float32, device=self.buckets[0].device)
        for j, p in enumerate(self.params):
            if p in grad_samples:
                # vector_norm reduces in fp32 without a squared (or upcast) copy of the grad sample
                sq[:, j] = torch.linalg.vector_norm(grad_samples[p].flatten(1), dim=1, dtype=torch.float32).square()
        return sq

    def _add_clipped(self, p: nn.Parameter, gs: Tensor, factors: Tensor, finite: Tensor | None) -> None:
        flat = gs.flatten(1).float()
        if finite is not None:  # 0 * inf would be nan: drop non-finite rows outright
            flat = torch.where(finite.unsqueeze(1), flat, torch.zeros_like(flat))
        self._slots[p].view(self.buckets).view(-1).add_(factors @ flat)

    def release(
        self,
        noise: GaussianNoise | None,
        noise_std: float,
        expected_batch_size: float,
        reduce: BucketReducer | None = None,
    ) -> None:
        """Add this rank's noise, sum across ranks, divide by the expected batch and set ``p.grad``.

        Args:
            noise: This rank's noise source (unused when ``noise_std`` is 0).
            noise_std: Std of the noise this rank adds: σΔ on one process (Δ =
                :attr:`sensitivity`); the ranks' shares must sum to variance (σΔ)².
            expected_batch_size: The public expected batch size q·N (never the realised one).
            reduce: Starts the in-place cross-rank sum of one bucket; ``None`` on one process.
                Bucket ``b``'s reduction overlaps the noise of bucket ``b + 1``.
        """
        if self._released:  # a step with no backward pass at all: release pure noise
            for b in self.buckets:
                b.zero_()
        pending = []
        for bucket in self.buckets:
            if noise is not None and noise_std > 0:
                bucket.add_(noise.sample(bucket, noise_std))
            if reduce is not None:
                pending.append(reduce(bucket))
        for work in pending:
            if work is not None:
                work.wait()
        for bucket in self.buckets:
            bucket.div_(expected_batch_size)
        for p, slot in self._slots.items():
            view = slot.view(self.buckets)
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        self._released = True


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def verify_per_example_sum(
    params: Sequence[nn.Parameter], grad_samples: dict[nn.Parameter, Tensor], per_row: float = 1.0
) -> list[tuple[nn.Parameter, float]]:
    """Parameters whose autograd gradient ``p.grad`` is not ``per_row`` x the sum of their per-example gradients.

    The tolerance is relative to s_p = ‖p.grad‖ + per_row · Σ_i ‖g_i‖, which bounds the
    rounding error of either sum: 1e-3 in fp32, 5e-2 when either side is in 16-bit, times
    max(s_p, 10⁻³·‖s‖) so that a parameter whose gradient is zero up to rounding (a key bias
    under softmax) is not judged by its own noise. Parameters with a non-finite side are
    skipped (their examples are dropped and counted by the mechanism).

    Returns:
        ``(parameter, relative error)`` for each mismatch, in ``params`` order.
    """
    checked: list[nn.Parameter] = []
    errors: list[Tensor] = []
    scales: list[Tensor] = []
    tolerances: list[float] = []
    for p in params:
        gs, grad = grad_samples.get(p), p.grad
        if gs is None and grad is None:
            continue
        expected = gs.sum(0).float() * per_row if gs is not None else torch.zeros(p.shape, device=p.device)
        actual = grad.float() if grad is not None else torch.zeros_like(expected)
        spread = gs.flatten(1).float().norm(dim=1).sum() * per_row if gs is not None else actual.new_zeros(())
        low = (gs is not None and gs.dtype in _LOW_PRECISION) or (grad is not None and grad.dtype in _LOW_PRECISION)
        checked.append(p)
        errors.append(torch.linalg.vector_norm(actual - expected))
        scales.append(torch.linalg.vector_norm(actual) + spread)
        tolerances.append(5e-2 if low else 1e-3)
    if not checked:
        return []
    err, scale = torch.stack(errors).tolist(), torch.stack(scales).tolist()  # one device sync for all parameters
    floor = 1e-3 * math.sqrt(math.fsum(s * s for s in scale if math.isfinite(s)))
    return [
        (p, e / max(s, floor))
        for p, e, s, tol in zip(checked, err, scale, tolerances)
        if math.isfinite(e) and math.isfinite(s) and e > tol * max(s, floor)
    ]
