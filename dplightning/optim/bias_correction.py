"""DP-MuonBC: remove the leading DP-noise bias of Newton–Schulz with antithetic public probes.

NS is nonlinear, so with U = Ū + N (N isotropic Gaussian of per-coordinate variance τ²,
known from the release's noise std) E[f(U)] = f(Ū) + (τ²/2)·Δf(Ū) + O(τ⁴): a
heat-smoothing bias. The probe average F(U) = ½[f(U + ρZ) + f(U − ρZ)] with fresh public
Z ~ N(0, I) has mean h(τ² + ρ²) where E f(U) = h(τ²), so Richardson extrapolation to
variance 0, O = (1 + λ)·f(U) − λ·F(U) with λ = τ²/ρ², cancels the O(τ²) term
(``dp_muon.md`` §3). Z does not depend on the data, so this is post-processing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dplightning.optim.newton_schulz import default_ns_dtype, newton_schulz

MomentumForm = Literal["nesterov", "ema", "heavyball"]
MOMENTUM_FORMS: dict[str, str] = {
    "nesterov": "M ← βM + (1−β)g; U = (1−β)g + βM (Muon's default)",
    "ema": "M ← βM + (1−β)g; U = M",
    "heavyball": "M ← βM + g; U = M (the DP-Muon paper's form)",
}


def momentum_noise_variance(
    form: MomentumForm, beta: float, buffer_var: float, noise_var: float
) -> tuple[float, float]:
    """One momentum step's effect on the DP-noise variance per coordinate.

    Exact for a noise std that changes between steps; for a constant one it equals the
    closed forms of :func:`closed_form_input_variance`.

    Args:
        form: See :data:`MOMENTUM_FORMS`.
        beta: Momentum β.
        buffer_var: Noise variance in the buffer M before the step (0 at the start).
        noise_var: s², the noise variance per coordinate of this step's released mean.

    Returns:
        ``(buffer variance after the step, variance τ² in the NS input U)``.
    """
    if form == "heavyball":
        var = beta**2 * buffer_var + noise_var
        return var, var
    var = beta**2 * buffer_var + (1 - beta) ** 2 * noise_var
    if form == "ema":
        return var, var
    # U = (1−β)g + β(βM_prev + (1−β)g) = (1−β²)g + β²M_prev, the noise of g independent of M_prev's.
    return var, (1 - beta**2) ** 2 * noise_var + beta**4 * buffer_var


def closed_form_input_variance(form: MomentumForm, beta: float, s: float, t: int) -> float:
    """τ_t² of the NS input after t ≥ 1 momentum steps with constant noise std s (``dp_muon.md`` §3.5)."""
    geometric = (1 - beta ** (2 * t)) / (1 - beta**2)
    if form == "heavyball":
        return s**2 * geometric
    if form == "ema":
        return s**2 * (1 - beta) ** 2 * geometric
    previous = (1 - beta ** (2 * (t - 1))) / (1 - beta**2)
    return s**2 * ((1 - beta**2) ** 2 + (1 - beta) ** 2 * beta**4 * previous)


@dataclass(frozen=True)
class Orthogonalized:
    """The orthogonalised matrices of one step, and the guard's public diagnostics.

    Attributes:
        outputs: One matrix per input, the input's shape (fp32).
        noise_ratios: r̂ = τ·√(mn)/‖U‖_F per matrix (0 where τ = 0); public (U is private already).
        corrected: Whether the bias correction was applied to each matrix.
    """

    outputs: list[Tensor]
    noise_ratios: list[float]
    corrected: list[bool]


def orthogonalize(
    matrices: Sequence[Tensor],
    taus: Sequence[float],
    bias_correction: bool = False,
    generator: torch.Generator | None = None,
    probe_scale: float = 1.0,
    probe_pairs: int = 1,
    max_noise_ratio: float | None = 0.5,
    ns_dtype: torch.dtype | None = None,
    bc_dtype: torch.dtype = torch.float32,
    **ns_kwargs: object,
) -> Orthogonalized:
    """NS of every matrix, with DP-MuonBC where asked and the guard allows; batched per shape.

    Args:
        matrices: 2-D NS inputs U.
        taus: τ per matrix, the std per coordinate of the DP noise in U.
        bias_correction: Apply DP-MuonBC.
        generator: Source of the probes Z (public: seeded, independent of the data).
        probe_scale: ρ/τ (λ = 1/probe_scale²).
        probe_pairs: Antithetic pairs averaged per matrix.
        max_noise_ratio: The guard r_max: plain NS where r̂ > r_max (``None``: never skip).
        ns_dtype: Precision of plain NS (default :func:`default_ns_dtype`); the three calls of a
            corrected matrix run in ``bc_dtype``.
        bc_dtype: Precision of the corrected matrices' NS calls: fp32 by default, since bf16
            rounding swamps the O(τ²) correction (``benchmarks/muon_bias_validation.py``).
        **ns_kwargs: Passed to :func:`~dplightning.optim.newton_schulz.newton_schulz`.
    """
    if probe_scale <= 0 or probe_pairs < 1:
        raise ValueError(f"probe_scale must be > 0 and probe_pairs >= 1, got {probe_scale} and {probe_pairs}.")
    if len(matrices) != len(taus):
        raise ValueError(f"Got {len(matrices)} matrices but {len(taus)} noise stds.")
    ratios: list[float] = []
    corrected: list[bool] = []
    # One host sync for all the norms (the guard is a host-side decision).
    norms = torch.stack([torch.linalg.matrix_norm(U.float()) for U in matrices]).tolist() if matrices else []
    for U, tau, norm in zip(matrices, taus, norms):
        ratio = tau * math.sqrt(U.numel()) / norm if tau > 0 and norm > 0 else 0.0
        ratios.append(ratio)
        # τ = 0 (or U = 0) has nothing to correct, and λ = τ²/ρ² would be 0/0.
        corrected.append(bias_correction and ratio > 0 and (max_noise_ratio is None or ratio <= max_noise_ratio))
    outputs: list[Tensor | None] = [None] * len(matrices)
    groups: dict[tuple[tuple[int, ...], torch.device, bool], list[int]] = {}
    for i, U in enumerate(matrices):
        groups.setdefault((tuple(U.shape), U.device, corrected[i]), []).append(i)
    for (_, device, bc), indices in groups.items():
        U = torch.stack([matrices[i].float() for i in indices])
        if not bc:
            result = newton_schulz(U, dtype=ns_dtype or default_ns_dtype(device), **ns_kwargs).float()  # type: ignore[arg-type]
        else:
            taus_here = [taus[i] for i in indices]
            result = _corrected(U, taus_here, generator, probe_scale, probe_pairs, bc_dtype, ns_kwargs)
        for i, r in zip(indices, result.unbind(0)):
            outputs[i] = r
    return Orthogonalized(outputs, ratios, corrected)  # type: ignore[arg-type]


def _corrected(
    U: Tensor,
    taus: list[float],
    generator: torch.Generator | None,
    probe_scale: float,
    pairs: int,
    dtype: torch.dtype,
    ns_kwargs: dict[str, object],
) -> Tensor:
    k = U.shape[0]
    Z = torch.randn((pairs, *U.shape), generator=generator, device=U.device, dtype=torch.float32)
    rho = (probe_scale * torch.tensor(taus, device=U.device, dtype=torch.float32)).view(1, k, 1, 1)
    # One batched call for f(U) and every f(U ± ρZ).
    stacked = torch.cat([U, (U + rho * Z).flatten(0, 1), (U - rho * Z).flatten(0, 1)])
    f = newton_schulz(stacked, dtype=dtype, **ns_kwargs).float()  # type: ignore[arg-type]
    plain, plus, minus = f[:k], f[k : k + pairs * k], f[k + pairs * k :]
    probe = 0.5 * (plus + minus).view(pairs, *U.shape).mean(0)
    lam = 1.0 / probe_scale**2
    return (1 + lam) * plain - lam * probe
