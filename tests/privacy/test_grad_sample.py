"""Per-example gradients from the hooks, with every clipping engine, equal a torch.func reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from dplightning.privacy.grad_sample import GRAD_SAMPLE_MODES, PerExampleHooks, available_engines
from tests.helpers import Scale
from tests.reference import per_example_grads


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


class TokenMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def _cases() -> dict[str, tuple[nn.Module, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    n = 7
    return {
        "linear": (nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), torch.randn(n, 5, generator=g), 3),
        "conv2d": (
            nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), Pool(), nn.Linear(3 * 4 * 4, 3)),
            torch.randn(n, 2, 6, 6, generator=g),
            3,
        ),
        "embedding": (
            nn.Sequential(nn.Embedding(11, 4), TokenMean(), nn.Linear(4, 3)),
            torch.randint(0, 11, (n, 5), generator=g),
            3,
        ),
        "layernorm": (
            nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3)),
            torch.randn(n, 5, generator=g),
            3,
        ),
        "groupnorm": (
            nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), Pool(), nn.Linear(4 * 16, 3)),
            torch.randn(n, 2, 6, 6, generator=g),
            3,
        ),
        "hf_conv1d": (
            nn.Sequential(Conv1D(6, 5), nn.Tanh(), TokenMean(), Conv1D(3, 6)),
            torch.randn(n, 4, 5, generator=g),
            3,
        ),
    }


ENGINES = available_engines()


def _hooks(model: nn.Module, mode: str = "hooks", engine: str = "auto") -> PerExampleHooks:
    params = [p for p in model.parameters() if p.requires_grad]
    return PerExampleHooks(model, params, engine=engine, functorch_fallback=mode == "functorch")


def _backend_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str = "hooks", reduction: str = "mean", engine="auto"
):
    hooks = _hooks(model, mode, engine)
    try:
        F.cross_entropy(model(x), y, reduction=reduction).backward()
        grads = hooks.pop()
    finally:
        hooks.close()
    names = {p: n for n, p in model.named_parameters()}
    rows = len(x) if reduction == "mean" else 1  # the hooks give the backpropagated loss's per-row gradients
    return {names[p]: g.instantiate() * rows for p, g in grads.items()}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("batch", [1, 7])
def test_hooks_match_torch_func(case: str, batch: int, engine: str) -> None:
    model, x, classes = _cases()[case]
    x = x[:batch]
    y = torch.arange(batch) % classes
    expected = per_example_grads(model, F.cross_entropy, x, y)
    got = _backend_grads(model, x, y, engine=engine)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")


def test_sum_reduction_gives_the_same_per_example_gradients() -> None:
    model, x, _ = _cases()["linear"]
    y = torch.arange(len(x)) % 3
    mean = _backend_grads(model, x, y, reduction="mean")
    summed = _backend_grads(model, x, y, reduction="sum")
    for name in mean:
        torch.testing.assert_close(mean[name], summed[name])


def test_empty_batch_gives_zero_rows() -> None:
    model, x, _ = _cases()["conv2d"]
    got = _backend_grads(model, x[:0], torch.zeros(0, dtype=torch.long), reduction="sum")
    assert all(g.shape[0] == 0 for g in got.values())


def test_frozen_parameters_get_no_grad_sample() -> None:
    model, x, _ = _cases()["linear"]
    model[0].weight.requires_grad_(False)
    got = _backend_grads(model, x, torch.arange(len(x)) % 3)
    assert "0.weight" not in got and "0.bias" in got


def test_unsupported_module_is_named_and_functorch_handles_it() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Scale(), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"1 \(Scale\)"):
        _hooks(model)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    expected = per_example_grads(model, F.cross_entropy, x, y)
    got = _backend_grads(model, x, y, mode="functorch")
    torch.testing.assert_close(got["1.w"], expected["1.w"])


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(3), nn.InstanceNorm1d(3, track_running_stats=True)])
def test_mixing_modules_are_rejected_with_their_names(norm: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(3, 3), norm, nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"\['1'\].*GroupNorm"):
        _hooks(model)


def test_close_removes_every_hook_and_attribute() -> None:
    model, x, _ = _cases()["hf_conv1d"]
    _backend_grads(model, x, torch.arange(len(x)) % 3)
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks
        assert not hasattr(m, "activations") and not hasattr(m, "autograd_grad_sample_hooks")
    for p in model.parameters():
        assert not hasattr(p, "grad_sample") and not hasattr(p, "_forward_counter")


def test_registry_lists_both_modes_and_the_engines() -> None:
    assert {"hooks", "functorch"} <= set(GRAD_SAMPLE_MODES)
    assert {"auto", "book_keeping", "instantiate"} <= set(ENGINES)


def test_recurrent_layer_called_once_per_time_step() -> None:
    from opacus.layers import DPLSTM

    class LastState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = DPLSTM(3, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(x)[0][:, -1])

    torch.manual_seed(0)
    model, x, y = LastState(), torch.randn(5, 6, 3), torch.tensor([0, 1, 1, 0, 1])
    expected = per_example_grads(model, F.cross_entropy, x, y)
    got = _backend_grads(model, x, y)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("engine", ENGINES)
def test_tied_parameters_add_their_contributions(engine: str) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.embed.weight  # GPT-2's weight tying

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(x).mean(1))

    torch.manual_seed(0)
    model, x, y = Tied(), torch.randint(0, 7, (4, 3)), torch.tensor([1, 2, 3, 4])
    expected = per_example_grads(model, F.cross_entropy, x, y)
    got = _backend_grads(model, x, y, engine=engine)
    torch.testing.assert_close(got["embed.weight"], expected["embed.weight"], rtol=1e-5, atol=1e-6)


def test_forward_without_backward_is_forgotten() -> None:
    model, x, _ = _cases()["linear"]
    y = torch.arange(len(x)) % 3
    hooks = _hooks(model)
    try:
        model(x[:2])  # a forward whose output is never differentiated
        hooks.pop()
        F.cross_entropy(model(x), y).backward()
        got = hooks.pop()
    finally:
        hooks.close()
    expected = per_example_grads(model, F.cross_entropy, x, y)
    names = {p: n for n, p in model.named_parameters()}
    for p, g in got.items():
        torch.testing.assert_close(g.instantiate() * len(x), expected[names[p]], rtol=1e-5, atol=1e-6)


class KeywordBag(nn.Module):
    """An EmbeddingBag given its ids and offsets by keyword: no positional tensor reaches its hook."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, mode="sum")

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(input=ids, offsets=offsets)


def test_a_bag_count_unlike_the_batch_is_explained_when_the_inputs_come_by_keyword() -> None:
    model = KeywordBag()
    hooks = PerExampleHooks(model, list(model.parameters()))
    ids, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 4])  # 3 bags in a batch of 4 examples
    try:
        with hooks.capture(rows=4), pytest.raises(RuntimeError, match=r"input of 3 rows .* the training batch has 4"):
            model(ids=ids, offsets=offsets)
    finally:
        hooks.close()


class TwiceOnePlace(nn.Module):
    """Uses its input twice, the second time modified in place (the view's gradient rerouted through its base)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x + x.relu_()


class OwnLinear(nn.Linear):
    """A subclass with its own forward (the torch.func fallback's): the hooks cannot know what else it does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layer", [nn.Linear, OwnLinear, Conv1D])
def test_a_view_output_used_twice_and_modified_in_place_gives_torch_funcs_gradients(engine: str, layer: type) -> None:
    torch.manual_seed(0)
    inner = layer(6, 6)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), inner, TwiceOnePlace(), TokenMean(), nn.Linear(6, 3))
    x, y = torch.randn(7, 4, 5), torch.arange(7) % 3
    expected = per_example_grads(model, F.cross_entropy, x, y)
    got = _backend_grads(model, x, y, mode="functorch" if layer is OwnLinear else "hooks", engine=engine)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_stock_linear_on_tokens_hands_on_its_own_output_and_a_subclass_a_copy() -> None:
    """The stock forward's view is hooked on its matmul's node (no copy); a subclass' output is copied."""
    x = torch.randn(3, 4, 5, requires_grad=True)
    for layer, copied in ((nn.Linear(5, 6), False), (Conv1D(6, 5), False), (OwnLinear(5, 6), True)):
        model = nn.Sequential(layer)
        hooks = _hooks(model, mode="functorch" if copied else "hooks")
        try:
            with hooks.capture(3):
                out = model(x)
            assert out._is_view() is not copied, type(layer).__name__
            out.sum().backward()
            assert set(hooks.pop()) == set(layer.parameters())
        finally:
            hooks.close()


def test_a_replayed_call_that_no_gradient_reached_in_either_pass_is_no_mismatch() -> None:
    from dplightning.privacy.grad_sample.samplers import LayerCall

    model = nn.Sequential(nn.Linear(3, 2))
    hooks, call = _hooks(model), LayerCall(args=(torch.zeros(2, 3),))
    try:
        hooks._check_replay(call, [None])  # the first pass fingerprints nothing
        hooks.sink = lambda p, g: None
        hooks._check_replay(call, [None])
        assert hooks._replay_differs is None
        hooks._check_replay(call, [torch.ones(2, 2)])  # met again, with no first-pass fingerprint left: a mismatch
        assert bool(hooks._replay_differs)
    finally:
        hooks.close()
