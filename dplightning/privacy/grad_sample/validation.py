"""Checks that a model can be trained with per-example clipping, naming what cannot."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm


def mixing_modules(module: nn.Module) -> list[str]:
    """Names of modules that mix examples of a batch or store statistics of private data.

    BatchNorm normalises with batch statistics (per-example gradients are undefined)
    and InstanceNorm with ``track_running_stats`` writes running statistics of the
    private data into buffers that would be released unprotected.
    """
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) or (isinstance(m, _InstanceNorm) and m.track_running_stats)
    ]


def owns_trainable(module: nn.Module) -> bool:
    """Whether ``module`` has trainable parameters of its own, not aliases of a child's.

    Opacus' ``DPLSTM`` re-registers its ``RNNLinear`` children's weights under
    ``nn.LSTM``'s names; those children, not the wrapper, compute them.
    """
    children = {id(p) for child in module.children() for p in child.parameters()}
    return any(p.requires_grad and id(p) not in children for p in module.parameters(recurse=False))


def modules_without_sampler(module: nn.Module, has_sampler: Callable[[nn.Module], bool]) -> list[str]:
    """Names (and types) of modules owning trainable parameters that no sampler handles."""
    return [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if owns_trainable(m) and not has_sampler(m)
    ]
