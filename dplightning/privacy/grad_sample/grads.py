"""Per-example gradients of one slot, materialised or not.

The mechanism needs two things from the per-example gradients g_i of a slot (a parameter,
or a parameter seen through an optimizer's transform): their squared norms ‖g_i‖², and
weighted sums Σ_i w_i g_i (the clipped sum, with w_i the clip factors). Neither needs the
``[n, *shape]`` tensor when the gradient of a layer factors as g_i = L_iᵀ R_i, with
L_i ∈ ℝ^{T×a} and R_i ∈ ℝ^{T×b} (a Linear layer: L = backprops, R = activations):

* ‖L_iᵀ R_i‖² = ⟨L_i L_iᵀ, R_i R_iᵀ⟩, two T×T Gram matrices (the ghost norm);
* Σ_i w_i L_iᵀ R_i is one matrix product of the stacked, reweighted factors.

A sum of such gradients (a layer called twice, several backward passes over one batch,
the K rows of one privacy unit) is again factored: stack the factors along T. A
parameter shared by layers of different kinds (an embedding tied to a linear head) has
norms with cross terms ⟨L_a L_bᵀ, R_a R_bᵀ⟩, also T×T. Opacus' norm samplers compute
the ghost norm of one call of one layer, so they cannot give the norm of such sums; the
Grams are formed here. See ``dp_sgd_core.md`` §5.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def as_tokens(t: Tensor) -> Tensor:
    """``[n, ..., d]`` -> ``[n, T, d]`` (T = 1 for a plain ``[n, d]`` input).

    T is computed, never ``-1``: an empty Poisson batch has n = 0, and a reshape of zero
    elements cannot infer a dimension.
    """
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _fp32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 or not t.is_floating_point() else t.float()


class PerExampleGrad(ABC):
    """The per-example gradients g_i (i < n) of one slot of shape :attr:`shape`."""

    shape: torch.Size

    @property
    @abstractmethod
    def rows(self) -> int:
        """n, the number of examples."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The precision the gradients were computed in."""

    @abstractmethod
    def sq_norms(self) -> Tensor:
        """‖g_i‖², ``[n]`` fp32."""

    @abstractmethod
    def weighted_sum(self, weights: Tensor) -> Tensor:
        """Σ_i w_i g_i, fp32, of shape :attr:`shape` (rows with weight 0 add exactly 0, even if not finite)."""

    @abstractmethod
    def instantiate(self) -> Tensor:
        """``[n, *shape]``: every g_i formed."""

    @abstractmethod
    def units(self, k: int) -> PerExampleGrad:
        """The gradients of units of ``k`` consecutive rows (the sum over each unit's rows)."""

    @abstractmethod
    def tensors(self) -> list[Tensor]:
        """The tensors this object keeps alive (formed gradients, or factors)."""


@dataclass
class Dense(PerExampleGrad):
    """Materialised per-example gradients ``[n, *shape]``."""

    value: Tensor

    def __post_init__(self) -> None:
        self.shape = self.value.shape[1:]

    @property
    def rows(self) -> int:
        return self.value.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype

    def sq_norms(self) -> Tensor:
        # vector_norm reduces in fp32 without an upcast copy of the gradients
        return torch.linalg.vector_norm(self.value.flatten(1), dim=1, dtype=torch.float32).square()

    def weighted_sum(self, weights: Tensor) -> Tensor:
        flat = self.value.flatten(1)
        keep = weights != 0
        if not bool(keep.all()):  # 0 * inf would be nan: drop those rows outright
            flat = torch.where(keep.unsqueeze(1), flat, torch.zeros_like(flat))
        return (weights.float() @ flat.float()).view(self.shape)

    def instantiate(self) -> Tensor:
        return self.value

    def units(self, k: int) -> Dense:
        return Dense(self.value.reshape(self.rows // k, k, *self.shape).sum(1)) if k > 1 else self

    def tensors(self) -> list[Tensor]:
        return [self.value]


def ghost_norm_pays(tokens: int, elements: int) -> bool:
    """The ghost-norm rule: two T×T Grams per example take less memory than one a×b gradient (2T² < a·b).

    The one statement of the rule. It lives here, under the engines, because the per-example gradients
    below take their norms by it; :mod:`.engines` re-exports it, and the auto engine and the memory
    planner decide by it.

    Args:
        tokens: T, the rows per example of the gradient's factors.
        elements: a·b, the entries of the weight.
    """
    return 2 * tokens**2 < elements


@dataclass
class Factored(PerExampleGrad):
    """g_i = L_iᵀ R_i viewed as :attr:`shape` (a·b elements).

    Attributes:
        left: ``[n, T, a]``, or ``[n, T]`` int64 indices into ``a`` rows (one-hot L, an embedding).
        right: ``[n, T, b]``.
        width: a.
        shape: The slot's shape.
    """

    left: Tensor
    right: Tensor
    width: int
    shape: torch.Size

    @property
    def rows(self) -> int:
        return self.right.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.right.dtype

    @property
    def indexed(self) -> bool:
        """Whether L is one-hot, given as indices."""
        return not self.left.is_floating_point()

    @property
    def tokens(self) -> int:
        """T, the length of the factors."""
        return self.right.shape[1]

    def ghost_is_cheaper(self) -> bool:
        """Whether the norm is taken from the Grams: :func:`ghost_norm_pays` for this call's T and a·b."""
        return ghost_norm_pays(self.tokens, math.prod(self.shape))

    def sq_norms(self) -> Tensor:
        if self.ghost_is_cheaper():
            return _pair_inner(self, self)
        return _instantiated_sq_norms(self)

    def weighted_sum(self, weights: Tensor) -> Tensor:
        w = weights.float().view(-1, 1, 1)
        left, right = self.left, _fp32(self.right)
        scale_left = not self.indexed and left.shape[2] < right.shape[2]  # reweight the smaller factor
        left = _fp32(left) * w if scale_left else (left if self.indexed else _fp32(left))
        right = right if scale_left else right * w
        keep = weights != 0
        if not bool(keep.all()):  # 0 * inf would be nan: drop those rows outright
            right = torch.where(keep.view(-1, 1, 1), right, torch.zeros_like(right))
            if not self.indexed:
                left = torch.where(keep.view(-1, 1, 1), left, torch.zeros_like(left))
        flat_right = right.flatten(0, 1)
        if self.indexed:
            out = flat_right.new_zeros(self.width, flat_right.shape[1])
            return out.index_add_(0, self.left.flatten(), flat_right).view(self.shape)
        return (left.flatten(0, 1).transpose(0, 1) @ flat_right).view(self.shape)

    def instantiate(self) -> Tensor:
        right = _fp32(self.right)
        if self.indexed:
            out = right.new_zeros(self.rows, self.width, right.shape[2])
            index = self.left.unsqueeze(-1).expand(*self.left.shape, right.shape[2])
            return out.scatter_add_(1, index, right).view(self.rows, *self.shape)
        return torch.bmm(_fp32(self.left).transpose(1, 2), right).view(self.rows, *self.shape)

    def units(self, k: int) -> Factored:
        if k == 1:
            return self
        n = self.rows // k
        left = self.left.reshape(n, k * self.tokens, *self.left.shape[2:])
        return Factored(left, self.right.reshape(n, k * self.tokens, self.right.shape[2]), self.width, self.shape)

    def tensors(self) -> list[Tensor]:
        return [self.left, self.right]


@dataclass
class Summed(PerExampleGrad):
    """g_i = Σ_c g_i^(c): the contributions of several calls or backward passes to one slot."""

    parts: list[PerExampleGrad]

    def __post_init__(self) -> None:
        self.shape = self.parts[0].shape

    @property
    def rows(self) -> int:
        return self.parts[0].rows

    @property
    def dtype(self) -> torch.dtype:
        return min((p.dtype for p in self.parts), key=lambda d: torch.finfo(d).bits)

    def sq_norms(self) -> Tensor:
        factored = [p for p in self.parts if isinstance(p, Factored)]
        if len(factored) < len(self.parts):
            return Dense(self.instantiate()).sq_norms()
        tokens = sum(p.tokens for p in factored)  # the calls' factors side by side: T = Σ_c T_c
        if not ghost_norm_pays(tokens, math.prod(self.shape)):
            return _rows_sq_norms(self.instantiate())
        total = torch.zeros(self.rows, device=factored[0].right.device)
        for i, a in enumerate(factored):  # ‖Σ_c g_c‖² = Σ_c ‖g_c‖² + 2 Σ_{c<d} ⟨g_c, g_d⟩
            total += _pair_inner(a, a)
            for b in factored[i + 1 :]:
                total += 2.0 * _pair_inner(a, b)
        return total

    def weighted_sum(self, weights: Tensor) -> Tensor:
        return torch.stack([p.weighted_sum(weights) for p in self.parts]).sum(0)

    def instantiate(self) -> Tensor:
        return torch.stack([p.instantiate().float() for p in self.parts]).sum(0)

    def units(self, k: int) -> Summed:
        return Summed([p.units(k) for p in self.parts])

    def tensors(self) -> list[Tensor]:
        return [t for p in self.parts for t in p.tensors()]


def held_bytes(grads: Iterable[PerExampleGrad]) -> int:
    """Bytes the gradients keep alive, each storage counted once (a layer input shared by several weights)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for g in grads:
        for t in g.tensors():
            storage = t.untyped_storage()
            seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def add(parts: Sequence[PerExampleGrad]) -> PerExampleGrad:
    """The sum of contributions to one slot, kept factored where the factors stack."""
    dense = [p for p in parts if isinstance(p, Dense)]
    factored: dict[tuple[bool, int, int], list[Factored]] = {}
    others: list[PerExampleGrad] = []
    for p in parts:
        if isinstance(p, Factored):
            factored.setdefault((p.indexed, p.width, p.right.shape[2]), []).append(p)
        elif not isinstance(p, Dense):
            others.extend(p.parts if isinstance(p, Summed) else [p])
    merged: list[PerExampleGrad] = [_stack(group) for group in factored.values()] + others
    if dense:
        merged.append(Dense(sum((d.value for d in dense[1:]), start=dense[0].value)))
    return merged[0] if len(merged) == 1 else Summed(merged)


def _stack(parts: list[Factored]) -> Factored:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    dtype = first.right.dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.right.dtype)
    right = torch.cat([p.right.to(dtype) for p in parts], dim=1)
    left = torch.cat([p.left if p.indexed else p.left.to(dtype) for p in parts], dim=1)
    return Factored(left, right, first.width, first.shape)


def _gram(a: Factored, b: Factored) -> Tensor:
    """L_a L_bᵀ, ``[n, T_a, T_b]`` fp32, for dense or one-hot L."""
    if a.indexed and b.indexed:
        return (a.left.unsqueeze(2) == b.left.unsqueeze(1)).float()
    if a.indexed:
        return _gram(b, a).transpose(1, 2)
    left = _fp32(a.left)
    if b.indexed:  # (L_a onehot(ids_b)ᵀ)[t, s] = L_a[t, ids_b[s]]
        return left.gather(2, b.left.unsqueeze(1).expand(-1, left.shape[1], -1))
    return torch.bmm(left, _fp32(b.left).transpose(1, 2))


def _pair_inner(a: Factored, b: Factored) -> Tensor:
    """⟨g_i^a, g_i^b⟩ = ⟨L_a L_bᵀ, R_a R_bᵀ⟩ per example, ``[n]`` fp32 (no a×b tensor)."""
    right = torch.bmm(_fp32(a.right), _fp32(b.right).transpose(1, 2))
    return (_gram(a, b) * right).sum((1, 2))


def _instantiated_sq_norms(g: Factored) -> Tensor:
    return _rows_sq_norms(g.instantiate())


def _rows_sq_norms(value: Tensor) -> Tensor:
    return torch.linalg.vector_norm(value.flatten(1), dim=1, dtype=torch.float32).square()
