"""Newton–Schulz orthogonalisation (Muon's NS5), batched over matrices of the same shape.

A quintic iteration X ← aX + (b·XXᵀ + c·(XXᵀ)²)X acts on each singular value s of X as
p(s) = a·s + b·s³ + c·s⁵ and leaves the singular vectors alone, so after the input is
scaled to spectral norm ≤ 1 a few steps push every singular value towards 1. Muon's
coefficients (3.4445, −4.7750, 2.0315) maximise the slope at 0; five steps map singular
values in [0.01, 1] into about [0.68, 1.13] (not exactly 1: the output is U S′ Vᵀ with S′ ≈ 1).
Written by hand because neither torch nor its ecosystem ships it (reference: KellerJordan/Muon).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

NS5_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Muon's quintic coefficients (a, b, c)."""

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
    coefficients: Sequence[float] = NS5_COEFFICIENTS,
    normalization: Normalization = "frobenius",
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Orthogonalise the last two dimensions of ``G`` (``[..., m, n]``, batched over the leading ones).

    Args:
        G: The matrices; a tall one (m > n) is transposed so that the iteration works on the
            smaller Gram matrix, and transposed back.
        steps: Iterations.
        coefficients: ``(a, b, c)`` of the step; ``(1.5, -0.5, 0)`` is the cubic Newton–Schulz.
        normalization: See :data:`NORMALIZATIONS`.
        dtype: Working precision; default :func:`default_ns_dtype`.

    Returns:
        A tensor of ``G``'s shape and dtype.
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs matrices [..., m, n], got shape {tuple(G.shape)}.")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"Unknown normalization {normalization!r}; choose one of {sorted(NORMALIZATIONS)}.")
    a, b, c = coefficients
    X = G.to(dtype or default_ns_dtype(G.device))
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    norm = torch.linalg.matrix_norm(X.float(), keepdim=True).to(X.dtype)
    X = X / (norm + 1e-7) if normalization == "frobenius" else X / norm.clamp(min=1.0)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


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
