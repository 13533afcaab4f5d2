"""Every clipping engine gives the clipped sum of torch.func per-example gradients, on every layer type.

The hooks and the mechanism are used without a Trainer: one forward and backward of a
summed per-example loss, then the privatizer's clipped sum (σ = 0, divided by B = 1).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

from dplightning.privacy.clipping import make_clip_groups
from dplightning.privacy.grad_sample import (
    Dense,
    Factored,
    PerExampleGrad,
    PerExampleHooks,
    Summed,
    available_engines,
    engines,
    grads,
    make_engine,
)
from dplightning.privacy.mechanism import GradientPrivatizer
from tests.reference import per_example_grads

N, CLASSES = 6, 3
ENGINES = available_engines()


class TokenMean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


class Flatten(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(1)


class Tied(nn.Module):
    """An embedding tied to a linear head (GPT-2's weight tying): one parameter, two kinds of layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=0)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.embed(ids))).mean(1))[:, :CLASSES]


class Twice(nn.Module):
    """One layer called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.head = nn.Linear(12, 12), nn.Linear(12, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))).mean(1))


def _lora() -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    base = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), TokenMean(), nn.Linear(6, CLASSES))
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["0", "3"]), base)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    for m in model.modules():  # random B, so the adapters' gradients are not trivially zero
        if isinstance(m, nn.Linear) and m.out_features != 2 and m.weight.requires_grad:
            nn.init.normal_(m.weight)
    return model


class ViT(nn.Module):
    """Hugging Face's ViT (its embeddings own the [CLS] token and position embeddings directly)."""

    def __init__(self) -> None:
        from transformers import ViTConfig, ViTForImageClassification

        super().__init__()
        config = ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32, num_labels=CLASSES, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)  # fmt: skip
        self.vit = ViTForImageClassification(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.vit(pixel_values=x).logits


def _ids(t: int, vocab: int = 16) -> Tensor:
    ids = torch.randint(1, vocab, (N, t), generator=torch.Generator().manual_seed(t))
    ids[: N // 2, t // 2 :] = 0  # padded positions (padding_idx 0)
    return ids


def _x(*shape: int) -> Tensor:
    return torch.randn(N, *shape, generator=torch.Generator().manual_seed(sum(shape)))


def _seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


# Sizes are such that the ghost norm pays (2T² < a·b) for most weights, except where T = 64.
CASES = {
    "linear-2d": lambda: (_seq(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, CLASSES)), _x(5)),
    **{
        f"linear-3d-T{t}": (
            lambda t=t: (_seq(nn.Linear(16, 12), nn.Tanh(), TokenMean(), nn.Linear(12, CLASSES)), _x(t, 16))
        )
        for t in (1, 7, 64)
    },
    "conv1d": lambda: (_seq(nn.Conv1d(2, 4, 3, padding=1, stride=2), Flatten(), nn.Linear(12, CLASSES)), _x(2, 5)),
    "conv2d": lambda: (
        _seq(nn.Conv2d(2, 3, 3, dilation=2, padding="valid"), nn.Tanh(), Flatten(), nn.Linear(12, CLASSES)),
        _x(2, 6, 6),
    ),
    "embedding-padded": lambda: (_seq(nn.Embedding(16, 8, padding_idx=0), TokenMean(), nn.Linear(8, CLASSES)), _ids(5)),
    "hf-conv1d": lambda: (_seq(Conv1D(12, 16), nn.Tanh(), TokenMean(), Conv1D(CLASSES, 12)), _x(7, 16)),
    "layernorm": lambda: (_seq(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, CLASSES)), _x(5)),
    "groupnorm": lambda: (_seq(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), Flatten(), nn.Linear(64, CLASSES)), _x(2, 6, 6)),
    "rmsnorm": lambda: (_seq(nn.Linear(5, 6), nn.RMSNorm(6), TokenMean(), nn.Linear(6, CLASSES)), _x(4, 5)),
    "tied-embedding-head": lambda: (Tied(), _ids(6)),
    "layer-called-twice": lambda: (Twice(), _x(3, 12)),
    "peft-lora": lambda: (_lora(), _x(4, 5)),
    "hf-vit": lambda: (ViT(), _x(1, 8, 8)),
}


def _build(case: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model, x = CASES[case]()
    return model, x, torch.arange(N) % CLASSES


def _clipped_sum(model: nn.Module, x: Tensor, y: Tensor, engine: str, clipping: str, c: float) -> dict[str, Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hooks = PerExampleHooks(model, [p for _, p in named], engine=engine)
    try:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        grads = hooks.pop()
    finally:
        hooks.close()
    privatizer = GradientPrivatizer(make_clip_groups(clipping, named, c))
    privatizer.accumulate(grads)
    privatizer.release(None, 0.0, expected_batch_size=1.0)
    return {n: privatizer.slot(p).clone() for n, p in named}


def _reference(model: nn.Module, x: Tensor, y: Tensor, clipping: str, c: float) -> dict[str, Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = per_example_grads(model, F.cross_entropy, x, y)
    groups = make_clip_groups(clipping, named, c)
    names = {p: n for n, p in named}
    out: dict[str, Tensor] = {}
    for g in groups:
        members = [names[p] for p in g.params]
        norms = torch.stack([grads[n].flatten(1).square().sum(1) for n in members]).sum(0).sqrt()
        factors = (g.max_norm / (norms + 1e-6)).clamp(max=1.0)
        out.update({n: torch.einsum("i,i...->...", factors, grads[n]) for n in members})
    return out


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "per_matrix"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_engine_gives_the_clipped_sum_of_instantiated_gradients(case: str, clipping: str) -> None:
    model, x, y = _build(case)
    c = 0.05  # small enough that most examples are clipped
    reference = _reference(model, x, y, clipping, c)
    instantiated = _clipped_sum(model, x, y, "instantiate", clipping, c)
    for name, value in reference.items():
        torch.testing.assert_close(instantiated[name], value, rtol=1e-5, atol=1e-7, msg=f"instantiate: {name}")
    for engine in ENGINES:
        got = _clipped_sum(model, x, y, engine, clipping, c)
        for name, value in instantiated.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=f"{engine}: {name}")


def test_padded_positions_contribute_nothing() -> None:
    model, ids, y = _build("embedding-padded")
    grads = {}
    for engine in ENGINES:
        hooks = PerExampleHooks(model, list(model.parameters()), engine=engine)
        F.cross_entropy(model(ids), y, reduction="sum").backward()
        grads[engine] = hooks.pop()[model[0].weight].instantiate()
        hooks.close()
        assert grads[engine][:, 0].abs().max() == 0  # the padding row, as autograd leaves it
    for engine in ENGINES:
        torch.testing.assert_close(grads[engine], grads["instantiate"])


def _factors(indexed: bool, t: int, a: int = 9, b: int = 5, seed: int = 0) -> Factored:
    g = torch.Generator().manual_seed(seed)
    left = torch.randint(0, a, (N, t), generator=g) if indexed else torch.randn(N, t, a, generator=g)
    return Factored(left, torch.randn(N, t, b, generator=g), a, torch.Size((a, b)))


@pytest.mark.parametrize("t", [1, 2, 7])
@pytest.mark.parametrize("indexed", [False, True])
def test_ghost_norms_equal_formed_norms(indexed: bool, t: int) -> None:
    g = _factors(indexed, t, a=40, b=30)  # 2T² < a·b: the ghost norm
    assert g.ghost_is_cheaper()
    formed = Dense(g.instantiate()).sq_norms()
    torch.testing.assert_close(g.sq_norms(), formed, rtol=1e-6, atol=0)


def test_ghost_norms_of_mixed_kinds_include_the_cross_terms() -> None:
    parts = [_factors(True, 3, a=40, b=30, seed=1), _factors(False, 4, a=40, b=30, seed=2)]
    summed = Summed(parts)
    formed = Dense(parts[0].instantiate() + parts[1].instantiate()).sq_norms()
    torch.testing.assert_close(summed.sq_norms(), formed, rtol=1e-6, atol=0)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor any operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("engine", ["book_keeping", "instantiate"])
def test_book_keeping_allocates_no_per_example_weight_gradient(engine: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 8))
    x, y = torch.randn(N, 32), torch.arange(N) % 8
    named = list(model.named_parameters())
    hooks = PerExampleHooks(model, [p for _, p in named], engine=engine)
    privatizer = GradientPrivatizer(make_clip_groups("flat", named, 1.0))
    with _Shapes() as trace:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        privatizer.accumulate(hooks.pop())
    hooks.close()
    per_example = {(N, *m.weight.shape) for m in model if isinstance(m, nn.Linear)}
    formed = per_example & trace.shapes
    if engine == "book_keeping":  # T = 1: every weight takes the ghost norm
        assert not formed
    else:  # the trace does see them when they are formed
        assert formed == per_example


def test_rows_of_one_unit_add_up_before_the_norm() -> None:
    g = _factors(False, 2, seed=3)
    units = g.units(3)
    assert units.rows == N // 3
    expected = g.instantiate().view(N // 3, 3, *g.shape).sum(1)
    torch.testing.assert_close(units.instantiate(), expected)
    torch.testing.assert_close(units.sq_norms(), Dense(expected).sq_norms(), rtol=1e-6, atol=0)


def test_per_matrix_groups_every_weight_matrix_and_keeps_the_joint_sensitivity() -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    groups = make_clip_groups("per_matrix", list(model.named_parameters()), 2.0)
    assert [g.name for g in groups] == ["0.weight", "2.weight", "non-matrix"]
    assert len(groups[-1].params) == 4  # two biases and the LayerNorm affine
    assert math.isclose(math.sqrt(sum(g.max_norm**2 for g in groups)), 2.0)


# ---------------------------------------------------------------- one rule, one classification (issue 26, item 4)


class _OwnForward(nn.Linear):
    """A Linear subclass with its own forward: it may compute anything, so its gradient is formed."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2


def _weight_grad(model: nn.Module, layer: nn.Module, x: Tensor, engine: str) -> PerExampleGrad:
    hooks = PerExampleHooks(model, list(model.parameters()), engine=engine, functorch_fallback=True)
    try:
        model(x).square().sum().backward()
        return hooks.pop()[layer.weight]
    finally:
        hooks.close()


@pytest.mark.parametrize("elements", range(0, 300))
def test_ghost_norm_limit_is_the_largest_t_the_rule_allows(elements: int) -> None:
    limit = engines.ghost_norm_limit(elements)
    assert not engines.ghost_norm_pays(limit + 1, elements)
    assert engines.ghost_norm_pays(limit, elements) or elements == 0


@pytest.mark.parametrize("tokens", range(1, 12))
@pytest.mark.parametrize("shape", [(4, 8), (3, 11), (9, 9), (1, 50)])
def test_factored_gradients_take_the_ghost_norm_by_the_engines_rule(shape: tuple[int, int], tokens: int) -> None:
    g = _factors(False, tokens, a=shape[0], b=shape[1])
    assert g.ghost_is_cheaper() == engines.ghost_norm_pays(tokens, math.prod(shape))


def test_the_engines_rule_is_the_one_the_gradients_take_their_norms_by() -> None:
    assert engines.ghost_norm_pays is grads.ghost_norm_pays


@pytest.mark.parametrize("pays", [False, True])
def test_factored_and_summed_gradients_ask_the_rule_for_their_norms(
    pays: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = _factors(False, 2, a=40, b=30), _factors(False, 3, a=40, b=30, seed=1)
    cases = {"factored": (one, 2), "summed": (Summed([one, two]), 2 + 3)}  # summed calls: T adds up
    expected = {name: g.sq_norms() for name, (g, _) in cases.items()}
    asked: list[tuple[int, int]] = []
    ghost: list[bool] = []
    pair_inner = grads._pair_inner
    monkeypatch.setattr(grads, "ghost_norm_pays", lambda t, e: asked.append((t, e)) or pays)
    monkeypatch.setattr(grads, "_pair_inner", lambda a, b: ghost.append(True) or pair_inner(a, b))
    for name, (g, tokens) in cases.items():
        asked.clear()
        ghost.clear()
        torch.testing.assert_close(g.sq_norms(), expected[name], rtol=1e-5, atol=1e-5)  # either way, the same norm
        assert asked == [(tokens, 40 * 30)], name
        assert bool(ghost) == pays, name  # the Grams exactly where the rule says


def _layer(kind: str, a: int, b: int) -> nn.Module:
    return {
        "linear": lambda: nn.Linear(a, b),
        "hf-conv1d": lambda: Conv1D(b, a),
        "own-forward": lambda: _OwnForward(a, b),
    }[kind]()


@pytest.mark.parametrize("kind", ["linear", "hf-conv1d", "own-forward"])
@pytest.mark.parametrize(("a", "b"), [(4, 8), (3, 11), (16, 2)])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 6])
def test_each_engine_factors_a_call_exactly_where_its_rule_says(kind: str, a: int, b: int, tokens: int) -> None:
    torch.manual_seed(0)
    layer = _layer(kind, a, b)
    x = torch.randn(N, tokens, a)
    found = engines.classify(layer)
    assert found.kind == "linear" and (found.in_width, found.out_width) == (a, b)
    for engine in ENGINES:
        got = _weight_grad(nn.Sequential(layer), layer, x, engine)
        expected = found.factorisation is not None and engines.keeps_factors(engine, tokens, a * b)
        assert isinstance(got, Factored) == expected, engine
    assert engines.keeps_factors("auto", tokens, a * b) == engines.ghost_norm_pays(tokens, a * b)
    assert engines.keeps_factors("book_keeping", tokens, a * b) and not engines.keeps_factors("instantiate", 1, a * b)


def test_the_engine_table_states_the_limit_of_the_rule() -> None:
    layer = nn.Linear(3, 11)  # 33 entries: 2·4² = 32 < 33, so T = 4 still takes the ghost norm
    assert engines.ghost_norm_limit(33) == 4
    assert make_engine("auto").describe(layer) == "book_keeping for T <= 4, else instantiate"
    assert make_engine("book_keeping").describe(layer) == "book_keeping (ghost norm for T <= 4)"


CLASSIFIED = [
    (lambda: nn.Linear(5, 3), "linear", (5, 3), "linear", True),
    (lambda: _OwnForward(5, 3), "linear", (5, 3), None, False),
    (lambda: Conv1D(3, 5), "linear", (5, 3), "hf_conv1d", True),
    (lambda: nn.Embedding(10, 4), "embedding", (0, 4), "embedding", False),
    (lambda: nn.Conv2d(2, 4, 3), "conv", (18, 4), "conv", False),
    (lambda: nn.Conv1d(4, 4, 3, groups=2), "conv", (0, 0), None, False),
    (lambda: nn.LayerNorm(6), "norm", (6, 6), None, False),
    (lambda: nn.RMSNorm(6), "norm", (6, 6), None, False),
    (lambda: nn.EmbeddingBag(10, 4), "other", (0, 0), None, False),
]


@pytest.mark.parametrize(("build", "kind", "widths", "name", "matrix"), CLASSIFIED)
def test_one_classification_of_every_layer(build, kind: str, widths: tuple[int, int], name: str | None, matrix: bool):  # type: ignore[no-untyped-def]
    layer = build()
    found = engines.classify(layer)
    assert (found.kind, (found.in_width, found.out_width)) == (kind, widths)
    assert (found.factorisation.name if found.factorisation else None) == name
    assert engines.factors_matrix(layer) == matrix
    assert (engines.factored_kind(layer) is not None) == (name is not None)


class InOut(nn.Module):
    """A matrix layer stored [in, out] under a name no built-in factorisation knows."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(a, b) / math.sqrt(a))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight


def _in_out_factors(layer: InOut, call: Any, grad: Tensor) -> tuple[Factored, None]:
    a = call.args[0].reshape(grad.shape[0], -1, layer.weight.shape[0])
    d = grad.reshape(grad.shape[0], -1, grad.shape[-1])
    return Factored(a.to(d.dtype), d, layer.weight.shape[0], layer.weight.shape), None


IN_OUT = engines.Factorisation(
    "in_out",
    "linear",
    lambda m: isinstance(m, InOut),
    _in_out_factors,
    lambda grad: math.prod(grad.shape[1:-1]),
    lambda m: tuple(m.weight.shape),
    matrix=True,
)


@pytest.fixture
def in_out_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "_FACTORISATIONS", dict(engines._FACTORISATIONS))
    engines.register_factorisation(IN_OUT)


def test_a_layer_without_a_factorisation_is_refused_under_hooks() -> None:
    model = nn.Sequential(InOut(6, 4))
    with pytest.raises(ValueError, match="InOut"):
        PerExampleHooks(model, list(model.parameters()), engine="book_keeping")


def test_a_registered_factorisation_is_kept_factored_and_gives_the_true_gradients(in_out_registered: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(InOut(6, 4), TokenMean(), nn.Linear(4, CLASSES))
    x, y = _x(2, 6), torch.arange(N) % CLASSES
    assert engines.classify(model[0]) == engines.LayerKind("linear", 6, 4, IN_OUT)
    assert engines.factors_matrix(model[0])
    reference = per_example_grads(model, F.cross_entropy, x, y)["0.weight"]
    hooks = PerExampleHooks(model, list(model.parameters()), engine="book_keeping")
    try:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        got = hooks.pop()[model[0].weight]
    finally:
        hooks.close()
    assert isinstance(got, Factored)
    torch.testing.assert_close(got.instantiate(), reference, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="in_out"):
        engines.register_factorisation(IN_OUT)
