"""The coupling probe: each example's gradient must not depend on the rest of its batch.

Per-example clipping bounds one example's influence only if its gradient is a function of
that example alone. A loss that couples the examples breaks this silently: a token mean
over the whole batch, batch-normalised or contrastive terms, in-batch negatives, a layer
fed sequence-first input, a lookup shared across the batch and reduced over it. The
gradient verification cannot see any of these (the per-example gradients still sum to
autograd's).

On the first steps of a fit (every step under ``verify_gradients="always"``), after the
real backward pass, the strategy runs ``training_step`` once more on a probe batch: the
first half of the batch unchanged and in place, the second half replaced by copies of the
first. Random draws are replayed (the generators are rewound to where the real step
started, and the batch keeps its shape, so dropout masks and noise are the same), logging
is off and torchmetrics states are restored. If any kept example's per-example gradient
differs between the two passes, its gradient depended on examples that were swapped out,
and training is refused before the update.

What the probe cannot see: coupling through data that is not a tensor whose first
dimension is the batch (the replacement only swaps such tensors), and manual
optimization (its ``training_step`` steps the optimizer, so it cannot be run twice).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from dplightning.privacy.grad_sample import PerExampleGrad
from dplightning.privacy.grad_sample.grads import held_bytes

if TYPE_CHECKING:
    import lightning.pytorch as pl

PROBE_RTOL = 1e-3
"""Relative difference of a kept example's gradient (to the largest) above which the examples are coupled."""


@dataclass
class AloneProbe:
    """One unit of a batch, run alone: its gradient must not depend on the batch's padded shape.

    The swap probe keeps the batch's shape, so it cannot see a loss that depends on it (a mean
    over the padded grid divides by n·T_max; mean pooling over padded steps). This probe
    re-collates one unit by itself with the run's own collate (its own length) and compares its
    gradient there with its gradient in the batch. Both passes run in eval mode (dropout masks
    drawn for two shapes could not agree) with the generators rewound.

    Attributes:
        in_batch: Runs ``training_step`` on the batch in eval mode; returns its loss.
        alone: Runs ``training_step`` on the unit collated alone in eval mode; returns its loss.
        position: The unit's row in the batch.
    """

    in_batch: Callable[[], Tensor | None]
    alone: Callable[[], Tensor | None]
    position: int


@dataclass
class CouplingProbe:
    """One probe of a training batch.

    Attributes:
        run: Runs ``training_step`` on the probe batch and returns its loss (``None``: no loss).
        kept: ``[n]`` bool, the units left unchanged in the probe batch.
        rng: The generators' state when the real step started, replayed by the probe.
        alone: The shape probe of one unit, where collating it alone changes its shape.
    """

    run: Callable[[], Tensor | None]
    kept: Tensor
    rng: tuple[Tensor, list[Tensor]]
    alone: AloneProbe | None = None


def row_shapes_differ(batch: Any, alone: Any, units: int) -> bool:
    """Whether a unit collated alone has other trailing shapes than its row in ``batch`` (padding to the batch)."""
    rows = [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == units]
    single = [t for t in tree_flatten(alone)[0] if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == 1]
    return len(rows) != len(single) or any(a.shape[1:] != b.shape[1:] for a, b in zip(rows, single))


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode for the block, each restored to its own mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def unit_gradient_gap(
    in_batch: Mapping[nn.Parameter, PerExampleGrad],
    alone: Mapping[nn.Parameter, PerExampleGrad],
    position: int,
    scales: tuple[float, float],
) -> float:
    """‖g_batch − g_alone‖ / max(‖g_batch‖, ‖g_alone‖) of one unit, over all parameters.

    ``position`` is the unit's row in the batch; ``scales`` take each pass' captured gradients to the unit's own.
    """
    error = reference = 0.0
    for p in in_batch.keys() | alone.keys():
        sides: list[Tensor | None] = []
        for grads, row, scale in ((in_batch, position, scales[0]), (alone, 0, scales[1])):
            g = grads.get(p)
            if g is None:
                sides.append(None)
                continue
            weights = torch.zeros(g.rows, dtype=torch.float32, device=g.sq_norms().device)
            weights[row] = scale
            sides.append(g.weighted_sum(weights).float())
        given = [t for t in sides if t is not None]
        a, b = (t if t is not None else torch.zeros_like(given[0]) for t in sides)
        error += float((a - b).square().sum())
        reference += max(float(a.square().sum()), float(b.square().sum()))
    return math.sqrt(error) / max(math.sqrt(reference), 1e-12)


def alone_tolerance(*passes: Mapping[nn.Parameter, PerExampleGrad]) -> float:
    """The relative gap that rounding alone can explain between a unit's gradient in a batch and alone.

    The two passes reduce over different shapes, so they round differently: :data:`PROBE_RTOL` in
    fp32, 4 ulp-sized steps (4 x the machine epsilon) of the lowest precision a gradient was
    computed in otherwise (bf16: 0.031; measured gaps of correct bf16 runs: about 0.004).
    """
    dtypes = {g.dtype for grads in passes for g in grads.values() if g.dtype.is_floating_point}
    lowest = max((torch.finfo(d).eps for d in dtypes), default=0.0)
    return max(PROBE_RTOL, 4 * lowest)


def probe_batch(batch: Any, units: int) -> tuple[Any, Tensor]:
    """``batch`` with units ``m..n-1`` replaced by copies of units ``0..m-1`` (m = ⌈n/2⌉), and the kept mask.

    Every tensor whose first dimension is ``units`` is indexed; everything else is left as is.
    """
    kept_units = (units + 1) // 2
    positions = torch.arange(units)
    source = positions % max(kept_units, 1)

    def swap(t: Tensor) -> Tensor:
        return t.index_select(0, source.to(t.device)) if t.dim() > 0 and t.shape[0] == units else t

    return apply_to_collection(batch, Tensor, swap), positions < kept_units


def rng_state() -> tuple[Tensor, list[Tensor]]:
    """The CPU generator's state and, if CUDA is in use, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[Tensor, list[Tensor]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


@contextmanager
def quietly(module: pl.LightningModule) -> Iterator[None]:
    """Run part of a step without logging and without changing torchmetrics' accumulated states."""
    from torchmetrics import Metric

    saved = {
        m: (copy.deepcopy(m.metric_state), m._update_count, m._computed, m._forward_cache)
        for m in module.modules()
        if isinstance(m, Metric)
    }
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
        for m, (state, count, computed, cache) in saved.items():
            for name, value in state.items():
                setattr(m, name, value)
            m._update_count, m._computed, m._forward_cache = count, computed, cache


def step_loss(output: Any) -> Tensor | None:
    """The loss in a ``training_step`` output (a tensor, or a mapping's ``"loss"``), if any."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


@dataclass
class GradientSummary:
    """What the probe compares of one parameter's per-example gradients.

    Attributes:
        norms: ``[n]`` each unit's gradient norm.
        combination: A random combination of the kept units with finite norms (it sees a change
            of direction that keeps the norm), shaped like the parameter.
    """

    norms: Tensor
    combination: Tensor


def _combination_weights(kept: Tensor) -> Tensor:
    return torch.randn(kept.shape[0], generator=torch.Generator().manual_seed(0)) * kept


def _summary(g: PerExampleGrad, weights: Tensor) -> GradientSummary:
    norms = g.sq_norms().sqrt()
    w = (weights.to(norms.device) * norms.isfinite()).to(torch.float32)
    return GradientSummary(norms.detach(), g.weighted_sum(w).float().detach())


def summarize(grads: Mapping[nn.Parameter, PerExampleGrad], kept: Tensor) -> dict[nn.Parameter, GradientSummary]:
    """The real pass' side of the comparison, so that its per-example state can be freed before the probe.

    Its size is one fp32 gradient of the privatized parameters; worth it where the state it
    replaces (the layers' inputs and output gradients, or formed gradients) is larger.
    """
    weights = _combination_weights(kept)
    return {p: _summary(g, weights) for p, g in grads.items()}


def summary_pays(grads: Mapping[nn.Parameter, PerExampleGrad]) -> bool:
    """Whether :func:`summarize`'s fp32 gradient is smaller than the per-example state it lets go.

    Activations win on small models or long sequences (a summary then frees most of the probe's
    extra memory), parameters at small batches of a large model (keeping the state costs less).
    """
    summary = sum(4 * math.prod(g.shape) for g in grads.values())
    return summary < held_bytes(grads.values())


def coupled_parameters(
    real: Mapping[nn.Parameter, GradientSummary | PerExampleGrad],
    probe: Mapping[nn.Parameter, PerExampleGrad],
    kept: Tensor,
) -> dict[nn.Parameter, float]:
    """Parameters whose kept units' gradients differ between the real and the probe pass, with the difference.

    Compared: each kept unit's gradient norm, and a random combination of the kept units'
    gradients (it sees a change of direction that keeps the norm); relative to the largest. A
    kept unit whose norm was finite and is not in the probe counts as changed. ``real`` holds
    :func:`summarize`'s summaries, or the gradients themselves (summarised one parameter at a
    time, so that no more than one parameter's combination is alive at once).
    """
    weights = _combination_weights(kept)
    differing: dict[nn.Parameter, float] = {}
    for p in real.keys() | probe.keys():
        if p not in real or p not in probe:
            differing[p] = 1.0
            continue
        given, b = real[p], probe[p]
        a = given if isinstance(given, GradientSummary) else _summary(given, weights)
        norms_a, norms_b = a.norms, b.sq_norms().sqrt()
        finite_a = kept.to(norms_a.device) & norms_a.isfinite()
        if bool((finite_a & ~norms_b.isfinite()).any()):
            differing[p] = math.inf
            continue
        w = (weights.to(norms_a.device) * norms_a.isfinite()).to(torch.float32)
        sum_a, sum_b = a.combination, b.weighted_sum(w).float()
        scale = max(float(norms_a[finite_a].max()) if finite_a.any() else 0.0, float(sum_a.norm()), 1e-12)
        difference = max(
            float((norms_a[finite_a] - norms_b[finite_a]).abs().max()) if finite_a.any() else 0.0,
            float((sum_a - sum_b).norm()),
        )
        if difference > PROBE_RTOL * scale:
            differing[p] = difference / scale
    return differing
