"""The grad-sample backend contract and its registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from torch import Tensor, nn


class GradSampleBackend(ABC):
    """Computes per-example gradients of a module's parameters during backward.

    Args:
        module: The model to attach to (the LightningModule itself).
        loss_reduction: ``"mean"`` if the loss averages over the batch rows (the
            backend then multiplies by the row count), ``"sum"`` if it sums them.
    """

    def __init__(self, module: nn.Module, loss_reduction: str) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        self.module = module
        self.loss_reduction = loss_reduction

    @abstractmethod
    def pop(self, params: Sequence[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
        """Per-example gradients ``[n, *p.shape]`` of the last backward pass, then forget them.

        Parameters that received no gradient are absent from the result.
        """

    @abstractmethod
    def close(self) -> None:
        """Remove every hook and attribute the backend added to the module."""


_BACKENDS: dict[str, type[GradSampleBackend]] = {}


def register_grad_sample_backend(name: str) -> Callable[[type[GradSampleBackend]], type[GradSampleBackend]]:
    """Class decorator registering a backend under ``name``."""

    def decorator(cls: type[GradSampleBackend]) -> type[GradSampleBackend]:
        _BACKENDS[name] = cls
        return cls

    return decorator


def available_grad_sample_modes() -> list[str]:
    """Names accepted by ``grad_sample_mode=``."""
    return sorted(_BACKENDS)


def make_grad_sample_backend(name: str, module: nn.Module, loss_reduction: str) -> GradSampleBackend:
    """Attach the backend registered as ``name`` to ``module``."""
    if name not in _BACKENDS:
        raise ValueError(f"Unknown grad_sample_mode {name!r}; choose one of {available_grad_sample_modes()}.")
    return _BACKENDS[name](module, loss_reduction)
