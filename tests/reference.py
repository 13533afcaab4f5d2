"""Reference implementations the tests compare against (never hand-typed numbers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

_CLIP_EPS = 1e-6


def per_example_grads(
    model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor
) -> dict[str, Tensor]:
    """Exact per-example gradients of the trainable parameters by ``vmap(grad(...))``."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one(params: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def clipped_sum(grads: dict[str, Tensor], max_norm: float, groups: list[list[str]] | None = None) -> dict[str, Tensor]:
    """Σ_i clip(g_i) with flat clipping, or per group with bounds ``max_norm / sqrt(len(groups))``."""
    groups = groups or [list(grads)]
    bound = max_norm / len(groups) ** 0.5
    out = {}
    for names in groups:
        norms = torch.stack([grads[n].flatten(1).pow(2).sum(1) for n in names]).sum(0).sqrt()
        factors = (bound / (norms + _CLIP_EPS)).clamp(max=1.0)
        for n in names:
            out[n] = torch.einsum("i,i...->...", factors, grads[n])
    return out
