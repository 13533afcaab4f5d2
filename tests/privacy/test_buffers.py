"""Buffer writes during a training step are refused, naming the module and buffer; declared ones are allowed."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dplightning.privacy.buffers import BufferWatch
from tests.helpers import ManualModule, TinyModule, dp, loader, make_dataset, make_trainer, params_of


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs, the way a custom normalisation layer would."""

    def __init__(self, features: int, write: str = "in_place") -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.write = write

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.write == "in_place":
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        elif self.training and self.write == "assign":
            self.mean = x.detach().mean(0)
        elif self.training and self.write == "count":
            self.calls += 1  # data-independent
        return x - self.mean


def _module(write: str, manual: bool = False) -> TinyModule:
    module = ManualModule() if manual else TinyModule()
    module.net = nn.Sequential(RunningMean(6, write), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    return module


def _fit(module: TinyModule, steps: int = 2) -> None:
    make_trainer(dp(), max_steps=steps).fit(module, loader(make_dataset(64), 16))


@pytest.mark.parametrize("write", ["in_place", "assign"])
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_buffer_written_in_training_step_is_refused_before_any_update(write: str, manual: bool) -> None:
    module = _module(write, manual)
    before = params_of(module)
    with pytest.raises(RuntimeError, match=r"'net\.0' \(RunningMean\) buffer 'mean'.*dp_public_buffers"):
        _fit(module)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_a_buffer_declared_public_may_be_written() -> None:
    module = _module("count")
    module.dp_public_buffers = {"net.0.calls"}
    _fit(module, steps=3)
    assert module.net[0].calls > 0


def test_declaring_an_unknown_buffer_is_an_error() -> None:
    module = _module("in_place")
    module.dp_public_buffers = {"net.0.men"}
    with pytest.raises(ValueError, match=r"dp_public_buffers names \['net\.0\.men'\]"):
        _fit(module)


def test_reading_is_not_a_write_and_a_write_between_steps_is_seen_at_the_next() -> None:
    layer = RunningMean(3, write="none")
    watch = BufferWatch(layer)
    watch.snapshot()
    layer(torch.randn(4, 3)).sum()
    watch.check("a test")
    layer.mean.add_(1.0)  # e.g. in on_train_batch_end, from the batch just seen
    with pytest.raises(RuntimeError, match=r"between two training steps.*buffer 'mean'"):
        watch.snapshot()


def test_a_public_buffer_may_be_written_between_steps() -> None:
    layer = RunningMean(3, write="none")
    watch = BufferWatch(layer, public={"mean"})
    watch.snapshot()
    watch.check("a test")
    layer.mean.add_(1.0)  # e.g. an EMA of the released weights: post-processing, declared public
    watch.snapshot()
    watch.check("a test")


class _DataWrite(nn.Module):
    """Writes a batch statistic through ``.data``, which does not bump the version counter."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.mean.data.copy_(x.detach().mean(0))
        return x


class _FrozenMean(nn.Module):
    """A frozen parameter used as a running mean (in state_dict, never noised)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(features), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


class _EndOfBatchMean(TinyModule):
    """Updates a buffer from the batch it just trained on, in on_train_batch_end."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(6))

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:  # type: ignore[no-untyped-def]
        self.seen += batch[0].mean(0)


@pytest.mark.parametrize("case", ["data_write", "frozen_parameter", "on_train_batch_end"])
def test_state_written_past_the_version_counter_or_the_step_is_refused(case: str) -> None:
    """The three writes of finding 40.5: each moved a saved value linearly with a canary, without noise."""
    if case == "on_train_batch_end":
        module: TinyModule = _EndOfBatchMean()
        match = r"between two training steps.*buffer 'seen'"
    else:
        module = TinyModule()
        first = _DataWrite(6) if case == "data_write" else _FrozenMean(6)
        module.net = nn.Sequential(first, nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        match = r"'net\.0' \((_DataWrite|_FrozenMean)\) (buffer|parameter) 'mean'"
    with pytest.raises(RuntimeError, match=match):
        _fit(module, steps=3)


def test_an_inference_tensor_buffer_is_watched_by_identity() -> None:
    with torch.inference_mode():
        layer = RunningMean(3, write="none")
    watch = BufferWatch(layer)
    watch.snapshot()
    watch.check("a test")
    layer.mean = torch.ones(3)
    with pytest.raises(RuntimeError, match="buffer 'mean'"):
        watch.check("a test")
