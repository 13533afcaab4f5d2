"""AdaLN-Zero blocks: bounds hold exactly, bounds off is plain DiT (independent reference), zero-init is identity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from dplightning.models.adaln import (
    AdaLNFinalLayer,
    AdaLNZeroBlock,
    L2BallProjection,
    ModulationBounds,
    bound,
    modulation_chunks,
    project_l2_ball,
)

D, HEADS, B, L = 16, 4, 5, 7


def randomise_modulation(module: torch.nn.Module, std: float = 1.0, seed: int = 0) -> None:
    """Give the zero-initialised modulation Linears non-zero weights (as after training)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if "adaLN_modulation" in name or name.startswith("linear."):
            p.data = torch.randn(p.shape, generator=g) * std


# ------------------------------------------------------------------ the bound and the projection


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_bound_keeps_every_coordinate_inside_and_none_is_the_identity(mode: str) -> None:
    x = torch.tensor([-1e30, -1e6, -3.0, -0.5, 0.0, 0.5, 3.0, 1e6, 1e30])
    out = bound(x, 2.0, mode)
    assert out.abs().max() <= 2.0 and torch.isfinite(out).all()
    assert bound(x, None, mode) is x  # a branch, never inf * tanh(x / inf)
    expected = 2.0 * torch.tanh(x / 2.0) if mode == "soft" else x.clamp(-2.0, 2.0)
    assert torch.equal(out, expected)
    assert bound(torch.zeros(3), 2.0, mode).eq(0).all()  # 0 stays 0: zero-init survives


def test_projection_onto_the_l2_ball() -> None:
    c = torch.randn(6, D) * torch.tensor([1e-3, 1e-1, 1.0, 10.0, 1e6, 1e12]).unsqueeze(1)
    out = project_l2_ball(c, 4.0)
    norms = out.norm(dim=1)
    assert (norms <= 4.0 * (1 + 1e-6)).all()
    inside = c.norm(dim=1) <= 4.0
    assert torch.equal(out[inside], c[inside])  # points inside the ball are untouched
    assert torch.allclose(norms[~inside], torch.full_like(norms[~inside], 4.0), rtol=1e-6)
    assert torch.allclose(F.normalize(out, dim=1), F.normalize(c, dim=1))  # direction kept
    assert project_l2_ball(c, None) is c


# ------------------------------------------------------------------ bounds hold for extreme conditions


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_block_modulation_is_bounded_for_extreme_conditions(mode: str) -> None:
    torch.manual_seed(0)
    bounds = ModulationBounds(gamma_max=0.5, beta_max=1.0, alpha_max=2.0, mode=mode)
    block, final = AdaLNZeroBlock(D, HEADS, bounds=bounds), AdaLNFinalLayer(D, 3, bounds)
    randomise_modulation(block)
    randomise_modulation(final)
    c = torch.randn(B, D) * 1e6
    b1, g1, a1, b2, g2, a2 = block.modulation(c)
    shift, scale = final.modulation(c)
    for value, limit in [(b1, 1.0), (b2, 1.0), (shift, 1.0), (g1, 0.5), (g2, 0.5), (scale, 0.5), (a1, 2.0), (a2, 2.0)]:
        assert value.abs().max() <= limit
    raw = block.adaLN_modulation(c)
    assert raw.abs().max() > 1e3  # the bounds did the work, not small raw values
    assert torch.isfinite(block(torch.randn(B, L, D), c)).all()


def test_each_bound_switches_on_its_own() -> None:
    torch.manual_seed(0)
    block = AdaLNZeroBlock(D, HEADS, bounds=ModulationBounds(gamma_max=None, beta_max=None, alpha_max=0.1))
    randomise_modulation(block, std=10.0)
    b1, g1, a1, *_ = block.modulation(torch.randn(B, D))
    raw_b1, raw_g1, _ = block.adaLN_modulation(torch.randn(B, D)).chunk(6, dim=-1)[:3]
    assert a1.abs().max() <= 0.1 and g1.abs().max() > 1.0 and b1.abs().max() > 1.0


def test_bounds_reject_non_positive_values() -> None:
    with pytest.raises(ValueError, match="gamma_max"):
        ModulationBounds(gamma_max=0.0)
    with pytest.raises(ValueError, match="mode"):
        ModulationBounds(mode="tanh")  # type: ignore[arg-type]


# ------------------------------------------------------------------ bounds off is plain AdaLN-Zero


def reference_dit_block(block: AdaLNZeroBlock, x: Tensor, c: Tensor) -> Tensor:
    """DiT's block (facebookresearch/DiT models.py) written out with the block's weights only."""
    w = {n: p.detach() for n, p in block.named_parameters()}
    mod = F.linear(F.silu(c), w["adaLN_modulation.1.weight"], w["adaLN_modulation.1.bias"])
    shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=1)

    def attention(h: Tensor) -> Tensor:
        qkv = F.linear(h, w["attn.qkv.weight"], w["attn.qkv.bias"]).reshape(B, L, 3, HEADS, D // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // HEADS), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, L, D)
        return F.linear(out, w["attn.proj.weight"], w["attn.proj.bias"])

    def mlp(h: Tensor) -> Tensor:
        h = F.gelu(F.linear(h, w["mlp.0.weight"], w["mlp.0.bias"]), approximate="tanh")
        return F.linear(h, w["mlp.2.weight"], w["mlp.2.bias"])

    def ln(h: Tensor) -> Tensor:
        return F.layer_norm(h, (D,), eps=1e-6)

    x = x + gate1.unsqueeze(1) * attention(ln(x) * (1 + scale1.unsqueeze(1)) + shift1.unsqueeze(1))
    return x + gate2.unsqueeze(1) * mlp(ln(x) * (1 + scale2.unsqueeze(1)) + shift2.unsqueeze(1))


def test_block_without_bounds_equals_plain_dit_block() -> None:
    torch.manual_seed(1)
    block = AdaLNZeroBlock(D, HEADS)
    randomise_modulation(block, std=0.3)
    x, c = torch.randn(B, L, D), torch.randn(B, D)
    torch.testing.assert_close(block(x, c), reference_dit_block(block, x, c), rtol=1e-5, atol=1e-5)
    bounded = AdaLNZeroBlock(D, HEADS, bounds=ModulationBounds(0.05, 0.05, 0.05))
    bounded.load_state_dict(block.state_dict())
    assert not torch.allclose(bounded(x, c), reference_dit_block(block, x, c), atol=1e-3)  # the test can fail


def test_final_layer_without_bounds_equals_plain_dit() -> None:
    torch.manual_seed(2)
    final = AdaLNFinalLayer(D, 3)
    randomise_modulation(final, std=0.3)
    x, c = torch.randn(B, L, D), torch.randn(B, D)
    w = {n: p.detach() for n, p in final.named_parameters()}
    shift, scale = F.linear(F.silu(c), w["adaLN_modulation.1.weight"], w["adaLN_modulation.1.bias"]).chunk(2, dim=1)
    h = F.layer_norm(x, (D,), eps=1e-6) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
    torch.testing.assert_close(final(x, c), F.linear(h, w["linear.weight"], w["linear.bias"]))


# ------------------------------------------------------------------ zero-init


@pytest.mark.parametrize("bounds", [None, ModulationBounds(1.0, 1.0, 1.0), ModulationBounds(1.0, 1.0, 1.0, "hard")])
def test_zero_init_block_is_the_identity_with_zero_gates(bounds: ModulationBounds | None) -> None:
    block = AdaLNZeroBlock(D, HEADS, bounds=bounds)
    block.zero_init()
    x, c = torch.randn(B, L, D), torch.randn(B, D) * 1e3
    assert torch.equal(block(x, c), x)
    _, _, a1, _, _, a2 = block.modulation(c)
    assert a1.eq(0).all() and a2.eq(0).all()


def test_modulation_weight_gradient_is_bounded_by_c_max() -> None:
    """Per example, ∂L/∂W_mod = δ_mod ⊗ SiLU(c), so ‖∂L/∂W_mod‖ ≤ ‖δ_mod‖·‖c‖ ≤ ‖δ_mod‖·c_max."""
    torch.manual_seed(3)
    block = AdaLNZeroBlock(D, HEADS, bounds=ModulationBounds(1.0, 1.0, 1.0))
    randomise_modulation(block, std=0.3)
    c_max = math.sqrt(D)
    x, c = torch.randn(1, L, D), project_l2_ball(torch.randn(1, D) * 1e4, c_max)
    outputs: list[Tensor] = []
    block.adaLN_modulation[1].register_forward_hook(lambda _m, _i, out: outputs.append(out))
    block(x, c).pow(2).sum().backward(inputs=[block.adaLN_modulation[1].weight, *outputs])
    (raw,) = outputs
    weight_grad = block.adaLN_modulation[1].weight.grad
    torch.testing.assert_close(weight_grad, torch.outer(raw.grad[0], F.silu(c[0])))
    assert weight_grad.norm() <= raw.grad.norm() * c_max * (1 + 1e-6)


# ------------------------------------------------------------------ what bind statistics hook into


def test_the_projection_module_is_the_function_has_no_state_and_its_hook_sees_c_tilde() -> None:
    c = torch.randn(6, D) * torch.logspace(-2, 3, 6).unsqueeze(1)
    projection = L2BallProjection(4.0)
    seen: list[Tensor] = []
    projection.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    assert torch.equal(projection(c), project_l2_ball(c, 4.0))
    assert seen[0] is c  # the hook gets c̃ itself, before the projection
    assert L2BallProjection(None)(c) is c and not projection.state_dict()
    with pytest.raises(ValueError, match="c_max must be positive or None"):
        L2BallProjection(0.0)


@pytest.mark.parametrize("layer", [AdaLNZeroBlock(D, HEADS), AdaLNFinalLayer(D, 3)], ids=["block", "final"])
def test_modulation_kinds_name_the_chunks_in_dit_order(layer: AdaLNZeroBlock | AdaLNFinalLayer) -> None:
    """γ ↔ scale, β ↔ shift, α ↔ gate: each raw chunk, bounded by its own limit, is what ``modulation`` returns."""
    randomise_modulation(layer, std=2.0)
    layer.bounds = ModulationBounds(gamma_max=0.5, beta_max=1.5, alpha_max=3.0, mode="hard")
    c = torch.randn(B, D)
    raw = layer.adaLN_modulation(c)
    expected = [bound(chunk, layer.bounds.limit(kind), "hard") for kind, chunk in
                modulation_chunks(raw, layer.MODULATION_KINDS)]  # fmt: skip
    for got, want in zip(layer.modulation(c), expected, strict=True):
        assert torch.equal(got, want)
    assert layer.bounds.limit("gamma") == 0.5 and layer.bounds.limit("alpha") == 3.0
