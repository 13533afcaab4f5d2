"""Newton–Schulz: singular values in the band NS5 reaches, against an SVD reference in fp64."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dplightning.optim.newton_schulz import (
    NS5_COEFFICIENTS,
    NS_PRESETS,
    newton_schulz,
    newton_schulz_many,
    ns_coefficients,
    taylor_coefficients,
)


def scalar_map(s: Tensor, steps: int = 5) -> Tensor:
    """What NS does to one singular value: s ↦ a·s + b·s³ + c·s⁵, ``steps`` times."""
    a, b, c = NS5_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def svd_reference(G: Tensor) -> Tensor:
    """U φ(S/‖G‖_F) Vᵀ in fp64: NS acts on the singular values only."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ torch.diag_embed(scalar_map(S / S.square().sum(-1, keepdim=True).sqrt())) @ Vh


def band(lo: float) -> tuple[float, float]:
    """The range of the scalar map over singular values in [lo, 1] (a fine grid)."""
    out = scalar_map(torch.logspace(torch.log10(torch.tensor(lo)).item(), 0, 20001, dtype=torch.float64))
    return out.min().item(), out.max().item()


def ill_conditioned(m: int, n: int, condition: float, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=g, dtype=torch.float64))
    return (U * torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), min(m, n), dtype=torch.float64)) @ V.T


def test_the_band_of_five_steps() -> None:
    # The band stated in dp_muon.md: [0.01, 1] -> about [0.68, 1.13]; [1e-3, 1] -> about [0.47, 1.20].
    lo, hi = band(1e-2)
    assert 0.67 < lo < 0.69 and 1.12 < hi < 1.14
    lo, hi = band(1e-3)
    assert 0.46 < lo < 0.48 and 1.19 < hi < 1.21


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)], ids=["wide", "tall"])
def test_random_input_lands_in_the_band(shape: tuple[int, int]) -> None:
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(G, dtype=torch.float32)
    assert out.shape == G.shape and out.dtype == G.dtype
    s_in = torch.linalg.svdvals(G.double() / torch.linalg.matrix_norm(G.double()))
    assert s_in.min() > 1e-2  # a Gaussian matrix is well conditioned: inputs in [0.01, 1] ...
    s = torch.linalg.svdvals(out.double())
    lo, hi = band(1e-2)
    assert s.min() > lo - 1e-3 and s.max() < hi + 1e-3  # ... so outputs in the [0.68, 1.13] band
    torch.testing.assert_close(out.double(), svd_reference(G), rtol=0, atol=2e-4)


@pytest.mark.parametrize("transpose", [False, True], ids=["wide", "tall"])
def test_ill_conditioned_input_follows_the_scalar_map(transpose: bool) -> None:
    G = ill_conditioned(48, 96, condition=1e3, seed=1)
    G = G.T if transpose else G
    out = newton_schulz(G.float(), dtype=torch.float32)
    torch.testing.assert_close(out.double(), svd_reference(G), rtol=0, atol=2e-4)
    s_in = torch.linalg.svdvals(G / torch.linalg.matrix_norm(G))
    s_out = torch.linalg.svdvals(out.double())
    reached = s_in >= 1e-3  # inputs >= 1e-3 reach [0.47, 1.20]; smaller ones stay below (a^5 ≈ 485 at most)
    assert reached.sum() > 0 and (~reached).sum() > 0
    lo, hi = band(1e-3)
    kept = s_out[: int(reached.sum())]  # both sorted descending, and the map is monotone where it matters
    assert kept.min() > lo - 1e-3 and kept.max() < hi + 1e-3


def test_tall_is_the_transpose_of_wide_and_batches_equal_single_calls() -> None:
    g = torch.Generator().manual_seed(2)
    G = torch.randn(3, 32, 80, generator=g)
    batched = newton_schulz(G, dtype=torch.float32)
    for k in range(3):
        torch.testing.assert_close(batched[k], newton_schulz(G[k], dtype=torch.float32), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(newton_schulz(G[k].T, dtype=torch.float32), batched[k].T, rtol=1e-5, atol=1e-6)
    mixed = [G[0], torch.randn(80, 32, generator=g), G[1], torch.randn(16, 16, generator=g)]
    for m, out in zip(mixed, newton_schulz_many(mixed, dtype=torch.float32)):
        torch.testing.assert_close(out, newton_schulz(m, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_bf16_stays_in_the_band_widened_by_its_rounding() -> None:
    # bf16 (the GPU default) has a relative step of 2^-8: measured 0.677-1.148 at 256x512 (fp32: 0.682-1.134).
    G = torch.randn(128, 256, generator=torch.Generator().manual_seed(3))
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.bfloat16).double())
    assert s.min() > 0.65 and s.max() < 1.17


def test_max1_normalization_leaves_small_inputs_unscaled() -> None:
    G = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    small = 1e-5 * G / torch.linalg.matrix_norm(G)
    # With ‖X‖_F = 1e-5 < 1 nothing is rescaled, so five steps multiply the input by about a^5.
    out = newton_schulz(small, normalization="max1", dtype=torch.float64)
    torch.testing.assert_close(out, small * NS5_COEFFICIENTS[0] ** 5, rtol=2e-3, atol=0)
    with pytest.raises(ValueError, match="normalization"):
        newton_schulz(G, normalization="spectral")  # type: ignore[arg-type]


def test_taylor_presets_are_the_papers_polynomials() -> None:
    # The paper's p_κ: κ = 1 is the cubic (1.5, -0.5), κ = 2 is (15/8, -10/8, 3/8).
    torch.testing.assert_close(torch.tensor(NS_PRESETS["taylor1"]), torch.tensor([1.5, -0.5]))
    torch.testing.assert_close(torch.tensor(NS_PRESETS["taylor2"]), torch.tensor([15 / 8, -10 / 8, 3 / 8]))
    # p_κ is the Taylor polynomial of λ^(-1/2) at 1: its error there shrinks like (1 - λ)^(κ+1).
    lam = torch.tensor([0.9, 0.95], dtype=torch.float64)
    for kappa in (1, 2, 3, 4):
        p = sum(c * lam**j for j, c in enumerate(taylor_coefficients(kappa)))
        error = (p - lam.rsqrt()).abs()
        ratio = (error[0] / error[1]).item()
        assert ratio == pytest.approx(2 ** (kappa + 1), rel=0.15), (kappa, ratio)
    with pytest.raises(ValueError, match="degree"):
        taylor_coefficients(0)


@pytest.mark.parametrize("preset", ["taylor1", "taylor2", "taylor3"])
def test_a_preset_acts_on_singular_values_by_its_scalar_map(preset: str) -> None:
    coefficients = NS_PRESETS[preset]
    G = ill_conditioned(24, 40, 100.0, seed=5)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    s = S / S.square().sum().sqrt().clamp(min=1.0)  # max1: no epsilon in the divisor
    for _ in range(4):
        s = s * sum(c * s ** (2 * j) for j, c in enumerate(coefficients))
    expected = U @ torch.diag(s) @ Vh
    out = newton_schulz(G, steps=4, coefficients=preset, normalization="max1", dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)  # the norm is taken in fp32
    # An explicit sequence of the same numbers is the same step.
    same = newton_schulz(G, steps=4, coefficients=coefficients, normalization="max1", dtype=torch.float64)
    torch.testing.assert_close(same, out)


def test_taylor_forms_stay_near_linear_on_small_inputs_where_muons_quintic_does_not() -> None:
    # Why the form matters under DP: max1 keeps a small (noise-level) input small; the Taylor step's
    # slope at 0 is c₀ (1.875 for κ = 2), Muon's 3.4445, so five steps amplify by 23× against 485×.
    G = 1e-5 * torch.randn(16, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for preset, slope in (("taylor2", 1.875), ("muon", NS5_COEFFICIENTS[0])):
        out = newton_schulz(G, coefficients=preset, normalization="max1", dtype=torch.float64)
        linear = G * slope**5
        assert (torch.linalg.matrix_norm(out - linear) / torch.linalg.matrix_norm(linear)).item() < 1e-3, preset


def test_bad_coefficients_are_refused() -> None:
    G = torch.randn(4, 6)
    with pytest.raises(ValueError, match="preset"):
        newton_schulz(G, coefficients="cubic")
    with pytest.raises(ValueError, match="finite"):
        newton_schulz(G, coefficients=(1.5, float("nan")))
    with pytest.raises(ValueError, match="finite"):
        ns_coefficients(())
