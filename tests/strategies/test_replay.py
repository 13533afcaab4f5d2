"""clip_replay: flat clipping in two backward passes equals one pass, frees each layer, and refuses a differing replay.

The single-process and two-process invariants (tests/invariants) run with clip_replay against torch.func;
here: the graph shapes where a parameter cannot be streamed (shared, a call cut from the graph), units of
several rows, accumulation, optimizer plans, and the refusals.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from dplightning.privacy.grad_sample.grads import held_bytes
from dplightning.strategies import replay as replay_module
from dplightning.strategies.verification import VERIFIED_STEPS
from examples.dp_plan_optimizer import ProjectedSGD
from tests.helpers import ManualModule, TinyModule, dp, loader, make_dataset, make_trainer, params_of

N, BATCH = 48, 12


class _Tied(nn.Module):
    """A weight shared by two layers (its norm has cross terms) and a layer called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.mid = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)
        self.back = nn.Linear(5, 5)
        self.back.weight = self.mid.weight

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h)) + torch.tanh(self.mid(h * 0.5))  # one layer, two calls
        self.mid(h.detach())  # a call the backward pass never reaches: the layer is never done
        return self.out(torch.tanh(self.back(h)))


class _Units(TinyModule):
    """Two views of each example in one forward; one privacy unit = its two rows."""

    dp_rows_per_unit = 2

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.record(x, y)
        views = torch.stack([x, x.flip(1)], 1).flatten(0, 1)
        per_row = F.cross_entropy(self(views), y.repeat_interleave(2), reduction="none")
        return per_row.view(-1, 2).mean(1).sum() / max(len(y), 1)


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runs: list[int] = []
    original = replay_module.ClipReplay.run

    def run(self: replay_module.ClipReplay, *args: Any, **kwargs: Any) -> Any:
        runs.append(len(self._sq))  # parameters whose norms were streamed
        return original(self, *args, **kwargs)

    monkeypatch.setattr(replay_module.ClipReplay, "run", run)
    return runs


CASES = {
    "tied-and-twice": (lambda: TinyModule(net=_Tied(), lr=0.5), {}, {}),
    "units-of-two-rows": (lambda: _Units(lr=0.5), {}, {}),
    "accumulation": (lambda: TinyModule(lr=0.5), {}, {"accumulate_grad_batches": 2}),
    "per_matrix": (lambda: TinyModule(lr=0.5), {"clipping": "per_matrix"}, {}),
    "optimizer-plan": (lambda: TinyModule(optimizer=lambda ps: ProjectedSGD(ps, lr=0.5, rank=2)), {}, {}),
}


@pytest.mark.parametrize("engine", ["book_keeping", "instantiate"])
@pytest.mark.parametrize("case", list(CASES))
def test_replay_takes_the_same_steps_as_one_pass(monkeypatch: pytest.MonkeyPatch, case: str, engine: str) -> None:
    make, strategy_kwargs, trainer_kwargs = CASES[case]

    def fit(replay: bool) -> dict[str, Tensor]:
        torch.manual_seed(0)
        module = make()
        strategy = dp(noise_multiplier=0.5, max_grad_norm=0.05, seed=3, clipping_engine=engine,
                      clip_replay=replay, verify_gradients="never", **strategy_kwargs)  # fmt: skip
        make_trainer(strategy, max_steps=3, **trainer_kwargs).fit(module, loader(make_dataset(N), BATCH))
        return params_of(module)

    one_pass = fit(replay=False)
    runs = _count_runs(monkeypatch)
    replayed = fit(replay=True)
    assert len(runs) == 3 * trainer_kwargs.get("accumulate_grad_batches", 1)  # every backward pass replayed
    assert all(streamed > 0 for streamed in runs)
    for name in one_pass:
        torch.testing.assert_close(replayed[name], one_pass[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_first_pass_keeps_norms_only(monkeypatch: pytest.MonkeyPatch) -> None:
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    held: list[int] = []
    original = replay_module.ClipReplay.layer_done

    def layer_done(self: replay_module.ClipReplay, layer: nn.Module) -> None:
        original(self, layer)
        held.append(held_bytes(g for parts in self._hooks._grads.values() for g in parts))

    monkeypatch.setattr(replay_module.ClipReplay, "layer_done", layer_done)
    module = TinyModule(net=net)
    make_trainer(dp(clip_replay=True, verify_gradients="never", clipping_engine="book_keeping")).fit(
        module, loader(make_dataset(N), BATCH)
    )
    assert len(held) == 3  # every layer was done, and nothing of any layer was left held after it
    assert max(held) == 0


def test_verified_steps_hold_and_the_rest_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _count_runs(monkeypatch)
    module = TinyModule()
    make_trainer(dp(clip_replay=True), max_steps=4).fit(module, loader(make_dataset(N), BATCH))
    assert len(runs) == 4 - VERIFIED_STEPS


class _Jitter(torch.autograd.Function):
    """Identity forward; a backward that differs from one pass to the next (a nondeterministic kernel)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * (1 + 1e-6 * torch.rand_like(grad))


class _JitterNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(_Jitter.apply(torch.tanh(self.a(x))))


def test_a_replay_that_differs_is_refused_before_any_update() -> None:
    module = TinyModule(net=_JitterNet())
    before = params_of(module)
    trainer = make_trainer(dp(clip_replay=True, verify_gradients="never"))
    with pytest.raises(RuntimeError, match="replayed backward pass .* differed"):
        trainer.fit(module, loader(make_dataset(N), BATCH))
    for name, value in params_of(module).items():
        assert torch.equal(value, before[name]), name


class _DropsRetainGraph(TinyModule):
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()


def test_a_backward_override_that_frees_the_graph_is_refused_clearly() -> None:
    module = _DropsRetainGraph()
    before = params_of(module)
    trainer = make_trainer(dp(clip_replay=True, verify_gradients="never"))
    with pytest.raises(RuntimeError, match="LightningModule.backward must pass its arguments"):
        trainer.fit(module, loader(make_dataset(N), BATCH))
    assert all(torch.equal(v, before[n]) for n, v in params_of(module).items())


def test_manual_optimization_is_refused() -> None:
    with pytest.raises(ValueError, match="clip_replay=True replays the backward pass that Lightning runs"):
        make_trainer(dp(clip_replay=True)).fit(ManualModule(), loader(make_dataset(N), BATCH))


def test_a_gpu_without_deterministic_algorithms_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = dp(clip_replay=True)
    trainer = make_trainer(strategy)
    strategy.connect(TinyModule())
    monkeypatch.setattr(type(strategy), "root_device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    with pytest.warns(UserWarning, match="deterministic=True"):
        strategy._check_clip_replay(trainer)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._check_clip_replay(trainer)


def test_replay_needs_a_clip_group_that_spans_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _count_runs(monkeypatch)
    module = TinyModule()
    make_trainer(dp(clip_replay=True, verify_gradients="never", clipping="per_layer")).fit(
        module, DataLoader(make_dataset(N), batch_size=BATCH)
    )
    assert runs == []  # per-layer groups are clipped as each layer is done: nothing to replay
