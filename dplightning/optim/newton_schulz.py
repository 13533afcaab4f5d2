"""Newton–Schulz orthogonalisation (Muon's NS5 and the DP-Muon paper's Taylor forms), batched per shape.

One step X ← (c₀ + c₁A + … + c_k A^k)X with A = XXᵀ acts on each singular value s of X as
s·(c₀ + c₁s² + … + c_k s^{2k}) and leaves the singular vectors alone, so after the input is
scaled to spectral norm ≤ 1 a few steps push every singular value towards 1. Two families
(:data:`NS_PRESETS`):

* ``"muon"``: Keller Jordan's quintic (3.4445, −4.7750, 2.0315) maximises the slope at 0; five
  steps map singular values in [0.01, 1] into about [0.68, 1.13] (the output is U S′ Vᵀ with
  S′ ≈ 1). On a noise-dominated input it lifts the noise directions as much as the signal.
* ``"taylorκ"``: the DP-Muon paper's p_κ(A), the degree-κ Taylor polynomial of λ^{−1/2} at 1
  (κ = 1: the cubic (1.5, −0.5); κ = 2: (15/8, −10/8, 3/8)). Its slope at 0 is small (1.5 or
  1.875 per step), so small singular values stay nearly proportional to the input.

Written by hand because neither torch nor its ecosystem ships it (reference: KellerJordan/Muon).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

NS5_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Muon's quintic coefficients (a, b, c)."""


def taylor_coefficients(kappa: int) -> tuple[float, ...]:
    """Coefficients (c₀, …, c_κ) in powers of A of p_κ(A) = Σ_{s≤κ} (2s)!/(4^s (s!)²)·(I − A)^s.

    Args:
        kappa: Degree κ ≥ 1 of the Taylor polynomial of λ^{−1/2} at λ = 1.
    """
    if kappa < 1:
        raise ValueError(f"The Taylor degree must be >= 1, got {kappa}.")
    coefficients = [0.0] * (kappa + 1)
    for s in range(kappa + 1):
        weight = math.comb(2 * s, s) / 4**s
        for j in range(s + 1):  # (1 − λ)^s = Σ_j C(s, j)(−λ)^j
            coefficients[j] += weight * math.comb(s, j) * (-1) ** j
    return tuple(coefficients)


NS_PRESETS: dict[str, tuple[float, ...]] = {
    "muon": NS5_COEFFICIENTS,
    "taylor1": taylor_coefficients(1),
    "taylor2": taylor_coefficients(2),
    "taylor3": taylor_coefficients(3),
}
"""Named coefficient sets: Muon's quintic and the DP-Muon paper's Taylor forms of degree κ = 1, 2, 3."""


def ns_coefficients(spec: str | Sequence[float]) -> tuple[float, ...]:
    """The coefficients (c₀, c₁, …) of a preset name in :data:`NS_PRESETS` or of an explicit sequence."""
    if isinstance(spec, str):
        if spec not in NS_PRESETS:
            raise ValueError(f"Unknown Newton–Schulz preset {spec!r}; choose one of {sorted(NS_PRESETS)}.")
        return NS_PRESETS[spec]
    coefficients = tuple(float(c) for c in spec)
    if not coefficients or not all(math.isfinite(c) for c in coefficients):
        raise ValueError(f"Newton–Schulz coefficients must be a non-empty sequence of finite numbers, got {spec!r}.")
    return coefficients


Normalization = Literal["frobenius", "max1"]
NORMALIZATIONS: dict[str, str] = {
    "frobenius": "X / (‖X‖_F + 1e-7), Muon's (scale invariant)",
    "max1": "X / max(1, ‖X‖_F), the DP-Muon paper's (keeps small inputs small)",
}


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (Muon's choice: NS tolerates its rounding), fp32 elsewhere (CPU bf16 matmuls are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: str | Sequence[float] = NS5_COEFFICIENTS,
    normalization: Normalization = "frobenius",
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Orthogonalise the last two dimensions of ``G`` (``[..., m, n]``, batched over the leading ones).

    Args:
        G: The matrices; a tall one (m > n) is transposed so that the iteration works on the
            smaller Gram matrix, and transposed back.
        steps: Iterations.
        coefficients: ``(c₀, c₁, …, c_k)`` of the step's polynomial in XXᵀ, or a name in
            :data:`NS_PRESETS`; ``(1.5, -0.5)`` is the cubic Newton–Schulz.
        normalization: See :data:`NORMALIZATIONS`.
        dtype: Working precision; default :func:`default_ns_dtype`.

    Returns:
        A tensor of ``G``'s shape and dtype.
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs matrices [..., m, n], got shape {tuple(G.shape)}.")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"Unknown normalization {normalization!r}; choose one of {sorted(NORMALIZATIONS)}.")
    coefficients = ns_coefficients(coefficients)
    X = G.to(dtype or default_ns_dtype(G.device))
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    norm = torch.linalg.matrix_norm(X.float(), keepdim=True).to(X.dtype)
    X = X / (norm + 1e-7) if normalization == "frobenius" else X / norm.clamp(min=1.0)
    for _ in range(steps):
        X = _polynomial_step(X, coefficients)
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def _polynomial_step(X: Tensor, coefficients: tuple[float, ...]) -> Tensor:
    """(c₀ + c₁A + … + c_k A^k)X with A = XXᵀ, by Horner's rule on the small Gram side."""
    if len(coefficients) == 1:
        return coefficients[0] * X
    A = X @ X.mT
    if len(coefficients) == 3:  # Muon's form, kept operation for operation (bf16 results match the reference)
        a, b, c = coefficients
        return a * X + (b * A + c * (A @ A)) @ X
    P = coefficients[-1] * A
    for c in reversed(coefficients[1:-1]):
        P = (P + c * torch.eye(A.size(-1), dtype=A.dtype, device=A.device)) @ A
    return coefficients[0] * X + P @ X


def newton_schulz_many(matrices: Sequence[Tensor], **kwargs: object) -> list[Tensor]:
    """:func:`newton_schulz` of each 2-D matrix, one batched call per distinct shape and device.

    Args:
        matrices: 2-D tensors of any shapes.
        **kwargs: Passed to :func:`newton_schulz`.
    """
    out: list[Tensor | None] = [None] * len(matrices)
    by_shape: dict[tuple[tuple[int, ...], torch.device, torch.dtype], list[int]] = {}
    for i, m in enumerate(matrices):
        if m.dim() != 2:
            raise ValueError(f"newton_schulz_many takes 2-D matrices, got shape {tuple(m.shape)} at index {i}.")
        by_shape.setdefault((tuple(m.shape), m.device, m.dtype), []).append(i)
    for indices in by_shape.values():
        result = newton_schulz(torch.stack([matrices[i] for i in indices]), **kwargs)  # type: ignore[arg-type]
        for i, r in zip(indices, result.unbind(0)):
            out[i] = r
    return out  # type: ignore[return-value]
