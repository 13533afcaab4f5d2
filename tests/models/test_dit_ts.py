"""TimeSeriesDiT: zero-init output, bounded condition, and lighter conditioning-path gradient tails than vanilla."""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap

from dplightning.models import TimeSeriesDiT
from dplightning.models.dit_ts import CONDITIONING_PATTERNS
from dplightning.tasks.timeseries_diffusion import forecast_mask, masked_mse_per_example

K, L, D = 3, 12, 16


def tiny(**options: Any) -> TimeSeriesDiT:
    return TimeSeriesDiT(num_features=K, hidden=D, depth=2, heads=2, mlp_ratio=2.0, position_dim=8, **options)


AWARE = dict(c_max=math.sqrt(D), gamma_max=1.0, beta_max=1.0, alpha_max=1.0)


def inputs(n: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, L, K, generator=g)
    cond = forecast_mask(torch.ones_like(x), 4)
    return (1 - cond) * torch.randn(n, L, K, generator=g), cond * x, cond, torch.randint(0, 50, (n,), generator=g)


def test_fresh_model_outputs_zero_for_any_condition() -> None:
    torch.manual_seed(0)
    for model in (tiny(), tiny(**AWARE)):
        noisy, observed, cond, t = inputs(4)
        assert model(noisy, observed * 1e6, cond, t).eq(0).all()


def test_condition_is_projected_for_extreme_contexts_and_untouched_without_c_max() -> None:
    torch.manual_seed(0)
    aware, vanilla = tiny(**AWARE), tiny()
    vanilla.load_state_dict(aware.state_dict())
    _, observed, cond, t = inputs(8)
    observed = observed * torch.logspace(0, 6, 8).view(-1, 1, 1)
    c_aware, c_raw = aware.condition(t, observed, cond), vanilla.condition(t, observed, cond)
    assert (c_aware.norm(dim=1) <= math.sqrt(D) * (1 + 1e-6)).all()
    assert c_raw.norm(dim=1).max() > 1e3 * math.sqrt(D)
    raw = vanilla.t_embedder(t) + vanilla.ctx_encoder(observed, cond)
    assert torch.equal(c_raw, raw)


def test_the_projection_is_a_stateless_module_the_condition_calls() -> None:
    """The ball is a module (a forward hook can count where it binds) that adds nothing to the state_dict."""
    aware = tiny(**AWARE)
    assert aware.c_max == math.sqrt(D) and aware.projection.c_max == aware.c_max and tiny().c_max is None
    assert not any(key.startswith("projection") for key in aware.state_dict())
    _, observed, cond, t = inputs(4)
    seen: list[Tensor] = []
    aware.projection.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    aware.condition(t, observed, cond)
    torch.testing.assert_close(seen[0], aware.t_embedder(t) + aware.ctx_encoder(observed, cond))


def test_conditioning_patterns_name_the_conditioning_path() -> None:
    names = [n for n, _ in tiny().named_parameters()]
    cond = [n for n in names if any(fnmatch.fnmatch(n, p) for p in CONDITIONING_PATTERNS)]
    assert all(n.startswith(("t_embedder.", "ctx_encoder.")) or "adaLN_modulation" in n for n in cond)
    assert {"t_embedder.mlp.0.weight", "ctx_encoder.token.weight", "final_layer.adaLN_modulation.1.weight"} <= set(cond)
    assert "blocks.0.attn.qkv.weight" not in cond and "x_embedder.weight" not in cond


def conditioning_grad_norms(model: TimeSeriesDiT, batch: tuple[Tensor, ...], eps: Tensor) -> np.ndarray:
    """Per-example ‖∂loss_i/∂θ_cond‖ by ``vmap(grad(...))`` on each example alone."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    cond_names = [n for n in params if any(fnmatch.fnmatch(n, p) for p in CONDITIONING_PATTERNS)]

    def loss(p: dict[str, Tensor], noisy: Tensor, observed: Tensor, cond: Tensor, t: Tensor, e: Tensor) -> Tensor:
        args = [a.unsqueeze(0) for a in (noisy, observed, cond, t)]
        out = functional_call(model, p, tuple(args))
        return masked_mse_per_example(e.unsqueeze(0), out, 1 - args[2]).sum()

    grads = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0, 0))(params, *batch, eps)
    return torch.stack([grads[n].flatten(1).pow(2).sum(1) for n in cond_names]).sum(0).sqrt().numpy()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap falls back to a loop for CPU attention
def test_extreme_contexts_give_lighter_conditioning_gradient_tails_with_bounds() -> None:
    """2 of 64 windows have their context scaled x100 (spec acceptance 9): DP-aware cuts max and p99."""
    torch.manual_seed(0)
    vanilla = tiny()
    for name, p in vanilla.named_parameters():  # a "trained" state: modulation and output no longer zero
        if "adaLN_modulation" in name or name.startswith("final_layer.linear"):
            p.data = torch.randn_like(p) * 0.2
    aware = tiny(**AWARE)
    aware.load_state_dict(vanilla.state_dict())
    noisy, observed, cond, t = inputs(64, seed=1)
    observed[:2] *= 100.0
    eps = torch.randn(64, L, K, generator=torch.Generator().manual_seed(2))
    norms_v = conditioning_grad_norms(vanilla, (noisy, observed, cond, t), eps)
    norms_a = conditioning_grad_norms(aware, (noisy, observed, cond, t), eps)
    assert norms_v[:2].min() > 10 * np.median(norms_v)  # the injected contexts produce the tail in vanilla
    assert norms_a.max() < norms_v.max() and np.quantile(norms_a, 0.99) < np.quantile(norms_v, 0.99)
    assert norms_a.max() / np.median(norms_a) < norms_v.max() / np.median(norms_v)


def test_patch_tokens_keep_zero_init_bounds_and_the_window_shape() -> None:
    torch.manual_seed(0)
    model = TimeSeriesDiT(num_features=K, hidden=D, depth=1, heads=2, position_dim=8, patch_size=4, **AWARE)
    noisy, observed, cond, t = inputs(3)
    assert model(noisy, observed, cond, t).eq(0).all()
    for p in model.parameters():
        p.data += 0.1 * torch.randn_like(p)
    out = model(noisy, observed, cond, t)
    assert out.shape == (3, L, K) and out.abs().sum() > 0
    shifted = noisy.clone()
    shifted[:, -1] += 1.0  # the last time step lies in the last patch only: earlier tokens see it through attention
    assert not torch.equal(model(shifted, observed, cond, t)[:, -4:], out[:, -4:])
    with pytest.raises(ValueError, match="multiple of patch_size"):
        model(noisy[:, :10], observed[:, :10], cond[:, :10], t)


# ------------------------------------------------------------------ layout options: context path, projection, encoder

LAYOUTS = [
    dict(context_path="tokens_and_c", project="t_emb+ctx", context_encoder="mean"),  # the spec's (default)
    dict(context_path="c_only", project="t_emb+ctx", context_encoder="mean"),
    dict(context_path="c_only", project="ctx", context_encoder="flatten", window=L),
    dict(context_path="tokens_and_c", project="ctx", context_encoder="flatten", window=L),
]


def randomised(model: TimeSeriesDiT, seed: int = 0, std: float = 0.1) -> TimeSeriesDiT:
    """Move every weight off its (partly zero) init so that outputs depend on all inputs, as after training."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data += std * torch.randn(p.shape, generator=g)
    return model


@pytest.mark.parametrize("options", LAYOUTS, ids=lambda o: "-".join(str(v) for v in o.values()))
@pytest.mark.parametrize("bounds", [{}, AWARE], ids=["vanilla", "aware"])
def test_every_layout_has_the_window_shape_zero_init_and_per_example_outputs(options: dict, bounds: dict) -> None:
    torch.manual_seed(0)
    model = tiny(**bounds, **options)
    noisy, observed, cond, t = inputs(5)
    out = model(noisy, observed * 1e6, cond, t)
    assert out.shape == (5, L, K) and out.eq(0).all()  # zero-init: output 0 for any condition
    assert all(
        g.eq(0).all() for block in model.blocks for g in block.modulation(model.condition(t, observed, cond))[2::3]
    )
    randomised(model)
    out = model(noisy, observed, cond, t)
    assert out.abs().sum() > 0
    torch.testing.assert_close(model(noisy[:1], observed[:1], cond[:1], t[:1]), out[:1])  # no mixing across examples


def test_the_default_layout_is_the_specs() -> None:
    model = tiny()
    assert (model.context_path, model.project) == ("tokens_and_c", "t_emb+ctx")
    assert type(model.ctx_encoder).__name__ == "ContextEncoder"
    assert model.x_embedder.in_features == 3 * K + 8


def test_c_only_tokens_never_see_the_observed_values_but_the_output_does() -> None:
    torch.manual_seed(0)
    noisy, observed, cond, t = inputs(4)
    perturbed = observed + cond * torch.randn_like(observed) * 5.0  # new context values, same mask and targets
    c_only = randomised(tiny(context_path="c_only", context_encoder="flatten", window=L))
    assert c_only.x_embedder.in_features == 2 * K + 8
    torch.testing.assert_close(
        c_only.token_inputs(noisy, perturbed, cond), c_only.token_inputs(noisy, observed, cond), rtol=0, atol=0
    )
    assert not torch.allclose(c_only(noisy, perturbed, cond, t), c_only(noisy, observed, cond, t))  # through c
    two_paths = randomised(tiny())
    assert not torch.equal(
        two_paths.token_inputs(noisy, perturbed, cond), two_paths.token_inputs(noisy, observed, cond)
    )
    # c_only tokens still carry the noisy targets and the mask
    assert not torch.equal(c_only.token_inputs(noisy + 1, observed, cond), c_only.token_inputs(noisy, observed, cond))
    assert not torch.equal(c_only.token_inputs(noisy, observed, 1 - cond), c_only.token_inputs(noisy, observed, cond))


@pytest.mark.parametrize("context_path", ["tokens_and_c", "c_only"])
def test_projection_option_bounds_the_right_vector(context_path: str) -> None:
    torch.manual_seed(0)
    c_max = math.sqrt(D)
    both = randomised(tiny(c_max=c_max, context_path=context_path))
    ctx_only = tiny(c_max=c_max, context_path=context_path, project="ctx")
    ctx_only.load_state_dict(both.state_dict())
    for layer in (both.t_embedder.mlp[2], ctx_only.t_embedder.mlp[2]):
        layer.weight.data *= 200.0  # a large, data-independent t_emb, as after training (‖t_emb‖ > c_max)
    _, observed, cond, t = inputs(8)
    observed = observed * torch.logspace(-2, 6, 8).view(-1, 1, 1)
    t_emb, ctx = both.t_embedder(t), both.ctx_encoder(observed, cond)
    assert t_emb.norm(dim=1).min() > c_max and ctx.norm(dim=1).max() > 1e3 * c_max
    c_both, c_ctx = both.condition(t, observed, cond), ctx_only.condition(t, observed, cond)
    assert (c_both.norm(dim=1) <= c_max * (1 + 1e-5)).all()  # Π(t_emb + ctx)
    assert ((c_ctx - t_emb).norm(dim=1) <= c_max * (1 + 1e-5)).all()  # t_emb + Π(ctx)
    assert c_ctx.norm(dim=1).max() > 2 * c_max  # t_emb itself is left alone
    inside = ctx.norm(dim=1) < c_max
    assert inside.any()
    torch.testing.assert_close(c_ctx[inside], (t_emb + ctx)[inside])  # small contexts pass unchanged


def test_flatten_encoder_sees_where_the_values_are_and_the_mean_does_not() -> None:
    torch.manual_seed(0)
    _, observed, cond, _ = inputs(2)
    observed, cond = observed[:, :8], cond[:, :8]  # the context rows only: all observed
    reversed_time = observed.flip(1)
    mean = tiny().ctx_encoder
    flat = tiny(context_encoder="flatten", window=8).ctx_encoder
    torch.testing.assert_close(mean(reversed_time, cond), mean(observed, cond))  # a mean over time: order lost
    assert not torch.allclose(flat(reversed_time, cond), flat(observed, cond))


def test_layout_options_are_validated_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="context_path must be one of 'tokens_and_c', 'c_only'; got 'tokens'"):
        tiny(context_path="tokens")
    with pytest.raises(ValueError, match="project must be one of 't_emb\\+ctx', 'ctx'; got 't_emb'"):
        tiny(project="t_emb")
    with pytest.raises(ValueError, match="context_encoder must be one of 'mean', 'flatten'"):
        tiny(context_encoder="attention")
    with pytest.raises(ValueError, match="needs the window length"):
        tiny(context_encoder="flatten")
    model = tiny(context_encoder="flatten", window=L)
    noisy, observed, cond, t = inputs(2)
    with pytest.raises(ValueError, match="built for windows of 12, got 8"):
        model(noisy[:, :8], observed[:, :8], cond[:, :8], t)
