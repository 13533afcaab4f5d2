"""Clipping groups and per-example clip factors.

A clipping policy partitions the privatized parameters into groups; group ``b`` has
its own bound ``C_b``. One example then changes the clipped sum by at most the joint
sensitivity ``Δ = sqrt(Σ_b C_b²)``, so the mechanism adds N(0, (σΔ)²) to the
concatenated sum (see ``dp_sgd_core.md`` §3.2). Flat clipping is the single-group case.

New policies register with :func:`register_clipping`; later issues add ``per_matrix``
and optimizer-defined groups through the same registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

_CLIP_EPS = 1e-6  # Opacus' `clip_and_accumulate` uses the same stabiliser.


@dataclass(frozen=True)
class ClipGroup:
    """Parameters clipped together under one bound.

    Attributes:
        name: Human-readable name (module path for ``per_layer``, ``"all"`` for ``flat``).
        params: The group's parameters.
        max_norm: The group's bound ``C_b``.
    """

    name: str
    params: tuple[nn.Parameter, ...]
    max_norm: float


ClippingPolicy = Callable[[Sequence[tuple[str, nn.Parameter]], float], list[ClipGroup]]
_CLIPPING: dict[str, ClippingPolicy] = {}


def register_clipping(name: str) -> Callable[[ClippingPolicy], ClippingPolicy]:
    """Register a clipping policy ``(named_params, max_grad_norm) -> groups`` under ``name``.

    A policy must return groups whose joint sensitivity equals ``max_grad_norm``, so
    that ``max_grad_norm`` keeps its meaning (the noise is σ · max_grad_norm).
    """

    def decorator(policy: ClippingPolicy) -> ClippingPolicy:
        _CLIPPING[name] = policy
        return policy

    return decorator


def available_clipping() -> list[str]:
    """Names accepted by ``clipping=``."""
    return sorted(_CLIPPING)


def make_clip_groups(
    policy: str, named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float
) -> list[ClipGroup]:
    """Build the clipping groups of ``policy`` over ``named_params``."""
    if policy not in _CLIPPING:
        raise ValueError(f"Unknown clipping {policy!r}; choose one of {available_clipping()}.")
    return _CLIPPING[policy](named_params, max_grad_norm)


def joint_sensitivity(groups: Sequence[ClipGroup]) -> float:
    """Δ = sqrt(Σ_b C_b²): the most one example can move the clipped sum."""
    return math.sqrt(sum(g.max_norm**2 for g in groups))


def split_max_grad_norm(max_grad_norm: float, weights: Sequence[float]) -> list[float]:
    """The groups' bounds ``C_b = C · sqrt(w_b / Σ w)``, so that the joint sensitivity ``Δ = sqrt(Σ_b C_b²)`` is C.

    The one place where C is split over groups: the built-in policies weight every group
    alike (``C_b = C / sqrt(k)``, computed as such), DP-Muon's ``clip_split="numel"`` by size.

    Args:
        max_grad_norm: C.
        weights: One non-negative weight per group (not all 0 unless all equal).
    """
    if not weights:
        return []
    if all(w == weights[0] for w in weights):
        return [max_grad_norm / math.sqrt(len(weights))] * len(weights)
    total = sum(weights)
    return [max_grad_norm * math.sqrt(w / total) for w in weights]


@register_clipping("flat")
def _flat(named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float) -> list[ClipGroup]:
    return [ClipGroup("all", tuple(p for _, p in named_params), max_grad_norm)]


@register_clipping("per_layer")
def _per_layer(named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float) -> list[ClipGroup]:
    """One group per module (weight and bias together), ``C_b = C / sqrt(L)`` so ``Δ = C``."""
    layers: dict[str, list[nn.Parameter]] = {}
    for name, p in named_params:
        layers.setdefault(name.rpartition(".")[0], []).append(p)
    bounds = split_max_grad_norm(max_grad_norm, [1.0] * len(layers))
    return [ClipGroup(layer or "<root>", tuple(ps), bound) for (layer, ps), bound in zip(layers.items(), bounds)]


def clip_factors(norms: Tensor, max_norm: float) -> Tensor:
    """Per-example factors ``min(1, C / (‖g‖ + 1e-6))``; a non-finite norm gets 0.

    Args:
        norms: Per-example norms, shape ``[n]``, any float dtype (computed in fp32).
        max_norm: The bound ``C``.
    """
    norms = norms.float()
    factors = (max_norm / (norms + _CLIP_EPS)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


@register_clipping("per_matrix")
def _per_matrix(named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float) -> list[ClipGroup]:
    """Each ≥2-D weight its own group, the other parameters one group; bounds ``C / sqrt(groups)``, so ``Δ = C``."""
    blocks: list[tuple[str, tuple[nn.Parameter, ...]]] = [(name, (p,)) for name, p in named_params if p.dim() >= 2]
    rest = tuple(p for _, p in named_params if p.dim() < 2)
    blocks += [("non-matrix", rest)] if rest else []
    bounds = split_max_grad_norm(max_grad_norm, [1.0] * len(blocks))
    return [ClipGroup(name, ps, bound) for (name, ps), bound in zip(blocks, bounds)]
