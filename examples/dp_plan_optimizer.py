"""An optimizer with a DP plan: SGD on random projections of each weight matrix's gradient.

A toy DP-GRAPE (see ``docs/optimizer_dp_plans.md``). It declares one clip group per weight
matrix, asks the engine to project each per-example gradient G_i ↦ G_i Pᵀ before clipping
(so only the r-column projection is ever clipped, noised and released), and lifts the
noisy release back with P. It never reads the strategy.
"""

from __future__ import annotations

import math

import torch

from dplightning.privacy import ClipGroup
from dplightning.privacy.grad_sample import Projection
from dplightning.protocols import DPPlan, DPRelease


class ProjectedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, rank: int = 2, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr})
        g = torch.Generator().manual_seed(seed)  # public randomness: the same P on every rank
        matrices = [p for group in self.param_groups for p in group["params"] if p.dim() == 2]
        self.projections = {p: (torch.randn(rank, p.shape[1], generator=g) / rank**0.5).to(p.device) for p in matrices}
        self.release: DPRelease | None = None

    def dp_plan(self, named_params, max_grad_norm: float) -> DPPlan:
        matrices = [(name, p) for name, p in named_params if p in self.projections]
        rest = tuple(p for _, p in named_params if p not in self.projections)
        bound = max_grad_norm / math.sqrt(len(matrices) + bool(rest))  # joint sensitivity = max_grad_norm
        groups = [ClipGroup(name, (p,), bound) for name, p in matrices] + [ClipGroup("rest", rest, bound)] * bool(rest)
        return DPPlan(groups, {p: Projection(P, p.shape) for p, P in self.projections.items()})

    def dp_release(self, release: DPRelease) -> None:
        self.release = release  # noisy means in slot coordinates, and their noise std

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None  # the strategy releases inside the closure
        for p, slot in self.release.slots.items():
            p.add_(slot @ self.projections[p] if p in self.projections else slot, alpha=-self.defaults["lr"])
        return loss
