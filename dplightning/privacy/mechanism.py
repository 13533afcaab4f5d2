"""The subsampled Gaussian mechanism on gradients: clip, sum, noise once, average.

:class:`GradientPrivatizer` owns persistent fp32 buckets laid out in parameter order
(identical on every rank, independent of the data). Each backward pass adds its
clipped per-example gradients to them; one release per optimizer step adds
N(0, (σΔ)²) noise, lets a reducer combine the ranks, divides by the public expected
batch size and writes the result to ``p.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from dplightning.privacy.clipping import ClipGroup, clip_factors, joint_sensitivity
from dplightning.privacy.grad_sample.grads import Dense, PerExampleGrad
from dplightning.privacy.grad_sample.transforms import SlotTransform
from dplightning.privacy.noise import GaussianNoise
from dplightning.privacy.release import Release, ReleaseObserver, ReleaseSpec, observers

if TYPE_CHECKING:
    from torch.distributed import Work

    from dplightning.privacy.correlated_noise import CorrelatedBucketNoise

BucketReducer = Callable[[Tensor], "Work | None"]
"""Starts the in-place cross-rank sum of one bucket; may return an async handle to wait on."""


@dataclass
class _Slot:
    shape: torch.Size
    bucket: int
    offset: int

    def view(self, buckets: Sequence[Tensor]) -> Tensor:
        return buckets[self.bucket][self.offset : self.offset + self.shape.numel()].view(self.shape)


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

    Each privatized parameter has one *slot*: the coordinates that are clipped, noised and
    released for it, of the parameter's shape, or of the shape an optimizer's transform
    gives (a projected gradient).

    Args:
        groups: Clip groups; their parameters, in order, define the bucket layout.
        bucket_cap_mb: Largest bucket in MiB of fp32 (the unit of noise and all-reduce).
        slot_shapes: Shape of the slot of each transformed parameter (default: its own shape).
    """

    def __init__(
        self,
        groups: Sequence[ClipGroup],
        bucket_cap_mb: float = 25.0,
        slot_shapes: Mapping[nn.Parameter, torch.Size] | None = None,
    ) -> None:
        if not groups or not any(g.params for g in groups):
            raise ValueError("Nothing to privatize: no trainable parameters are in the optimizer.")
        self.groups = list(groups)
        self.sensitivity = joint_sensitivity(self.groups)
        self.params = [p for g in self.groups for p in g.params]
        self._group_of = {p: j for j, g in enumerate(self.groups) for p in g.params}
        self._column = {p: i for i, p in enumerate(self.params)}
        offsets = [0]
        for g in self.groups:
            offsets.append(offsets[-1] + len(g.params))
        self._group_columns = [torch.arange(a, b) for a, b in zip(offsets, offsets[1:])]
        shapes = {p: (slot_shapes or {}).get(p, p.shape) for p in self.params}
        self._own_shape = [p for p in self.params if p not in (slot_shapes or {})]
        self.buckets, self._slots = self._layout(self.params, shapes, int(bucket_cap_mb * 2**20 / 4))
        self._released = False

    @staticmethod
    def _layout(
        params: Sequence[nn.Parameter], shapes: Mapping[nn.Parameter, torch.Size], cap: int
    ) -> tuple[list[Tensor], dict[nn.Parameter, _Slot]]:
        sizes: list[int] = []
        devices: list[torch.device] = []
        slots: dict[nn.Parameter, _Slot] = {}
        for p in params:
            numel = shapes[p].numel()
            if not sizes or sizes[-1] + numel > cap or devices[-1] != p.device:
                sizes.append(0)
                devices.append(p.device)
            slots[p] = _Slot(torch.Size(shapes[p]), len(sizes) - 1, sizes[-1])
            sizes[-1] += numel
        buckets = [torch.zeros(n, dtype=torch.float32, device=d) for n, d in zip(sizes, devices)]
        return buckets, slots

    def slot(self, p: nn.Parameter) -> Tensor:
        """The bucket view of ``p``'s slot (after :meth:`release`: its noisy mean)."""
        return self._slots[p].view(self.buckets)

    def accumulate(
        self,
        grads: Mapping[nn.Parameter, PerExampleGrad | Tensor],
        scale: float = 1.0,
        groups: Sequence[int] | None = None,
    ) -> MicroBatchStats:
        """Clip the per-example gradients of one batch (or micro-batch) and add them to the buckets.

        Args:
            grads: Per-example gradients per parameter (a ``[n, *shape]`` tensor is taken as
                formed gradients); missing parameters count as zero.
            scale: Factor applied to every per-example gradient before clipping (e.g. the
                accumulation factor Lightning divided the loss by).
            groups: Indices of the clip groups ``grads`` covers completely (default: all), so
                that a group can be clipped as soon as its layer's backward is done. The
                statistics of the other groups are zero; add them up with :func:`merge_stats`.
        """
        per_example = {p: g if isinstance(g, PerExampleGrad) else Dense(g) for p, g in grads.items()}
        n = common_rows(g.rows for g in per_example.values())
        stats, factors = self.clip(self.sq_norm_table(per_example, n), scale, groups)
        for p, g in per_example.items():
            self.add_clipped(p, g, factors)
        return stats

    def clip(
        self, param_sq: Tensor, scale: float = 1.0, groups: Sequence[int] | None = None
    ) -> tuple[MicroBatchStats, dict[int, Tensor]]:
        """The clip factors of one batch from its per-example squared norms (the first half of :meth:`accumulate`).

        Args:
            param_sq: ``[n, params]`` squared norms in :attr:`params` order, before ``scale``.
            scale: As in :meth:`accumulate`.
            groups: As in :meth:`accumulate`.

        Returns:
            The batch's statistics and, per selected group, the weights (clip factor × finite × scale)
            that :meth:`add_clipped` applies to each per-example gradient.
        """
        if self._released:
            for b in self.buckets:
                b.zero_()
            self._released = False
        n = param_sq.shape[0]
        selected = list(range(len(self.groups))) if groups is None else list(groups)
        param_sq = param_sq * scale**2
        norms = param_sq.new_zeros(n, len(self.groups))
        for j in selected:
            norms[:, j] = param_sq[:, self._group_columns[j]].sum(1).sqrt()
        finite = torch.isfinite(norms).all(dim=1)
        # A partial accumulation's count is left to merge_stats: one device sync per backward pass, not per group.
        nonfinite = int(n - finite.sum().item()) if groups is None else 0
        factors = {j: clip_factors(norms[:, j], self.groups[j].max_norm) * finite * scale for j in selected}
        return MicroBatchStats(norms=norms, param_sq_norms=param_sq, nonfinite=nonfinite), factors

    def add_clipped(self, p: nn.Parameter, g: PerExampleGrad, factors: Mapping[int, Tensor]) -> None:
        """Add Σ_i w_i g_i to ``p``'s slot, with w the weights of ``p``'s group from :meth:`clip`."""
        self.slot(p).add_(g.weighted_sum(factors[self._group_of[p]]))

    def column(self, p: nn.Parameter) -> int:
        """``p``'s column in the ``[n, params]`` squared-norm tables."""
        return self._column[p]

    def sq_norm_table(self, grads: Mapping[nn.Parameter, PerExampleGrad], n: int) -> Tensor:
        """``[n, params]`` per-example squared norms of ``grads`` (missing parameters: zero), for :meth:`clip`."""
        sq = torch.zeros(n, len(self.params), dtype=torch.float32, device=self.buckets[0].device)
        for p, g in grads.items():
            sq[:, self._column[p]] = g.sq_norms()
        return sq

    def discard(self) -> None:
        """Zero the buckets: what was accumulated since the last release must never be released (a refused step)."""
        for b in self.buckets:
            b.zero_()
        self._released = False

    def group_of(self, p: nn.Parameter) -> int:
        """Index of ``p``'s clip group."""
        return self._group_of[p]

    def release(
        self,
        noise: GaussianNoise | CorrelatedBucketNoise | None,
        noise_std: float,
        expected_batch_size: float,
        reduce: BucketReducer | None = None,
        write_grads: bool = True,
        spec: ReleaseSpec | None = None,
    ) -> None:
        """Add this rank's noise, sum across ranks, divide by the expected batch and set ``p.grad``.

        Args:
            noise: This rank's noise source (unused when ``noise_std`` is 0); a correlated source is
                asked once per bucket, in bucket order (its stream i noises bucket i).
            noise_std: Std of the noise this rank adds: σΔ on one process (Δ =
                :attr:`sensitivity`); the ranks' shares must sum to variance (σΔ)².
            expected_batch_size: The public expected batch size q·N (never the realised one).
            reduce: Starts the in-place cross-rank sum of one bucket; ``None`` on one process.
                Bucket ``b``'s reduction overlaps the noise of bucket ``b + 1``.
            write_grads: Set ``p.grad`` to the released slot of every parameter without a
                transform; the release stays readable in :meth:`slot` either way.
            spec: What the strategy declares about this release, for the observers of the
                release seam (:mod:`dplightning.privacy.release`); required while any observes.
        """
        if self._released:  # a step with no backward pass at all: release pure noise
            for b in self.buckets:
                b.zero_()
        watching = observers()
        if watching and spec is None:
            raise RuntimeError("A release is observed but its caller declared no ReleaseSpec.")
        clipped = torch.cat([b.detach().flatten() for b in self.buckets]) if watching else None
        pending = []
        for bucket in self.buckets:
            if noise is not None and noise_std > 0:
                bucket.add_(noise.sample(bucket, noise_std))
            if reduce is not None:
                pending.append(reduce(bucket))
        for work in pending:
            if work is not None:
                work.wait()
        if watching:
            self._observe(watching, Release(cast(ReleaseSpec, spec), cast(Tensor, clipped)))
        for bucket in self.buckets:
            bucket.div_(expected_batch_size)
        self._released = True
        if write_grads:
            for p in self._own_shape:
                view = self.slot(p)
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)

    def _observe(self, watching: Sequence[ReleaseObserver], release: Release) -> None:
        """Hand the release to each observer; write back an output one substitutes."""
        output = torch.cat([b.detach().flatten() for b in self.buckets])
        for observer in watching:
            replaced = observer(release, output.clone())
            if replaced is not None:
                if replaced.shape != output.shape:
                    shapes = f"{tuple(replaced.shape)}, not {tuple(output.shape)}"
                    raise ValueError(f"A release observer returned shape {shapes}.")
                output = replaced.to(output.device, output.dtype)
        offset = 0
        for bucket in self.buckets:
            bucket.copy_(output[offset : offset + bucket.numel()])
            offset += bucket.numel()


def common_rows(rows: Iterable[int]) -> int:
    """The one number of examples that a batch's per-example gradients share (0 for none).

    Raises:
        RuntimeError: If they disagree.
    """
    found = set(rows)
    if len(found) > 1:
        raise RuntimeError(f"Per-example gradients disagree on the number of examples: {sorted(found)}.")
    return found.pop() if found else 0


def merge_stats(parts: Sequence[MicroBatchStats]) -> MicroBatchStats:
    """The statistics of one backward pass whose clip groups were accumulated in several parts."""
    rows = max(p.norms.shape[0] for p in parts)
    parts = [p for p in parts if p.norms.shape[0] == rows]  # a part without gradients has no rows
    norms = torch.stack([p.norms for p in parts]).sum(0)
    param_sq = torch.stack([p.param_sq_norms for p in parts]).sum(0)
    nonfinite = int((~torch.isfinite(norms).all(dim=1)).sum().item())
    return MicroBatchStats(norms=norms, param_sq_norms=param_sq, nonfinite=nonfinite)


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def verify_per_example_sum(
    params: Sequence[nn.Parameter],
    grads: Mapping[nn.Parameter, PerExampleGrad],
    per_row: float = 1.0,
    transforms: Mapping[nn.Parameter, SlotTransform] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> list[tuple[nn.Parameter, float]]:
    """Parameters whose autograd gradient ``p.grad`` is not ``per_row`` x the sum of their per-example gradients.

    The tolerance is relative to s_p = ‖p.grad‖ + per_row · Σ_i ‖g_i‖, which bounds the
    rounding error of either sum: 1e-3 in fp32, 5e-2 (6.4 ulp of bf16) when the backward pass
    ran in 16 bits, times max(s_p, 10⁻³·‖s‖) so that a parameter whose gradient is zero up to
    rounding (a key bias under softmax) is not judged by its own noise. The precision is the
    one the computation ran in (``compute_dtype``, e.g. bf16 under ``bf16-mixed``), else either
    side's dtype: an fp32 tensor computed from bf16 activations (a projected gradient, an fp32
    parameter's gradient under autocast) carries bf16's error. Parameters with a non-finite side are
    skipped (their examples are dropped and counted by the mechanism). A transformed
    parameter is compared in its slot's coordinates (the transforms are linear). A parameter with
    a nonzero autograd gradient and no per-example gradient at all is a mismatch whatever its
    scale: its gradient reached it by a path the hooks never saw (a weight read outside its
    layer's call), which the floor must not hide.

    Returns:
        ``(parameter, relative error)`` for each mismatch, in ``params`` order.
    """
    transforms = transforms or {}
    checked: list[nn.Parameter] = []
    errors: list[Tensor] = []
    scales: list[Tensor] = []
    tolerances: list[float] = []
    missing: list[bool] = []  # autograd has a gradient, the hooks none at all: a path escaped them entirely
    for p in params:
        g, grad = grads.get(p), p.grad
        if g is None and grad is None:
            continue
        if grad is not None and p in transforms:
            grad = transforms[p].dense(grad)
        if g is not None:
            expected = g.weighted_sum(torch.ones(g.rows, device=p.device)) * per_row
            spread = g.sq_norms().sqrt().sum() * per_row
        else:
            expected = torch.zeros(grad.shape, device=p.device)  # type: ignore[union-attr]
            spread = expected.new_zeros(())
        actual = grad.float() if grad is not None else torch.zeros_like(expected)
        low = (
            compute_dtype in _LOW_PRECISION
            or (g is not None and g.dtype in _LOW_PRECISION)
            or (grad is not None and grad.dtype in _LOW_PRECISION)
        )
        checked.append(p)
        missing.append(g is None)
        errors.append(torch.linalg.vector_norm(actual - expected.view(actual.shape)))
        scales.append(torch.linalg.vector_norm(actual) + spread)
        tolerances.append(5e-2 if low else 1e-3)
    if not checked:
        return []
    err, scale = torch.stack(errors).tolist(), torch.stack(scales).tolist()  # one device sync for all parameters
    floor = 1e-3 * math.sqrt(math.fsum(s * s for s in scale if math.isfinite(s)))
    return [
        (p, e / max(s, floor))
        for p, e, s, tol, none in zip(checked, err, scale, tolerances, missing)
        if math.isfinite(e) and math.isfinite(s) and (e > tol * max(s, floor) or (none and e > 0))
    ]
