"""Linear maps applied to every per-example gradient of a parameter, inside the engine.

An optimizer's DP plan may ask that a parameter's per-example gradients be released in
other coordinates (DP-GRAPE: a random projection G ↦ G Pᵀ). The map is applied to the
engine's representation, so a factored gradient L_iᵀ R_i stays factored and the slot
(what is clipped, noised and released) has the projected shape; the full per-example
gradient of a projected layer is never formed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dplightning.privacy.grad_sample.grads import Dense, Factored, PerExampleGrad, Summed


class SlotTransform(ABC):
    """A linear map of one parameter's gradient, viewed as a matrix ``[shape[0], prod(shape[1:])]``."""

    @abstractmethod
    def slot_shape(self, shape: torch.Size) -> torch.Size:
        """Shape of the transformed gradient of a parameter of ``shape``."""

    @abstractmethod
    def dense(self, grads: Tensor) -> Tensor:
        """Transform ``[..., *shape]`` gradients (formed per example, or ``p.grad`` itself)."""

    @abstractmethod
    def factored(self, grad: Factored) -> Factored:
        """Transform factored per-example gradients, keeping them factored."""

    def apply(self, grad: PerExampleGrad) -> PerExampleGrad:
        """Transform any per-example representation."""
        if isinstance(grad, Factored):
            return self.factored(grad)
        if isinstance(grad, Summed):
            return Summed([self.apply(p) for p in grad.parts])
        return Dense(self.dense(grad.instantiate()))


@dataclass
class Projection(SlotTransform):
    """G ↦ G Pᵀ (``side="right"``, P ``[r, prod(shape[1:])]``) or G ↦ P G (``"left"``, P ``[r, shape[0]]``).

    Attributes:
        matrix: P.
        shape: Shape of the parameter whose gradient is projected.
        side: Which side of the gradient matrix P multiplies.
    """

    matrix: Tensor
    shape: torch.Size
    side: Literal["left", "right"] = "right"

    def slot_shape(self, shape: torch.Size) -> torch.Size:
        r, rows, cols = self.matrix.shape[0], shape[0], torch.Size(shape[1:]).numel()
        return torch.Size((rows, r) if self.side == "right" else (r, cols))

    def dense(self, grads: Tensor) -> Tensor:
        lead = grads.shape[: grads.dim() - len(self.shape)]
        columns = math.prod(self.shape[1:])  # named, not -1: an empty batch has zero elements
        matrix, p = grads.reshape(*lead, self.shape[0], columns).float(), self.matrix.to(grads.device, torch.float32)
        return matrix @ p.T if self.side == "right" else p @ matrix

    def factored(self, grad: Factored) -> Factored:
        dtype = grad.right.dtype
        p = self.matrix.to(grad.right.device, dtype)
        if self.side == "right":  # (L_iᵀ R_i) Pᵀ = L_iᵀ (R_i Pᵀ)
            return Factored(grad.left, grad.right @ p.T, grad.width, self.slot_shape(self.shape))
        # P (L_iᵀ R_i) = (L_i Pᵀ)ᵀ R_i; a one-hot L_i picks columns of P
        left = p.T[grad.left] if grad.indexed else grad.left.to(dtype) @ p.T
        return Factored(left, grad.right, p.shape[0], self.slot_shape(self.shape))
