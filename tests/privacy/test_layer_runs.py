"""First layers followed by an in-place op, through a real Trainer, step after step.

The strategy verifies its first steps against autograd, then turns ``requires_grad`` off
on the privatized parameters (the engines need only the layers' inputs and output
gradients). A first layer followed by an in-place op (``Conv2d -> ReLU(inplace=True)``,
VGG-style) used to die right there; a convolution with ``padding_mode``
reflect/replicate/circular was clipped as if padded with zeros; and an in-place op on a
layer output that is a view (``nn.Linear`` on ``[n, T, d]``) hid the output's gradient from
the hooks (now hooked on the layer's matmul node, inner layers included). Every step of a
σ = 0 run must equal the clipped mean of per-example gradients taken by torch.func.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from dplightning.privacy.grad_sample import available_engines
from tests.helpers import TinyModule, dp, loader, make_trainer, params_of
from tests.reference import clipped_sum, per_example_grads

N, BATCH, STEPS, C = 48, 12, 4, 0.5


class TokenMean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


NETS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    **{
        f"conv2d-{mode}": (
            lambda mode=mode: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, padding_mode=mode), nn.ReLU(inplace=True),
                                            nn.Flatten(), nn.Linear(4 * 36, 3)),
            (2, 6, 6),
        )
        for mode in ("zeros", "reflect", "circular")
    },
    "conv1d-replicate": (
        lambda: nn.Sequential(nn.Conv1d(2, 4, 3, padding=1, padding_mode="replicate"), nn.ReLU(inplace=True),
                              nn.Flatten(), nn.Linear(4 * 6, 3)),
        (2, 6),
    ),
    "tokens-linear": (  # nn.Linear on [n, T, d] returns a view of its [n·T, d] result
        lambda: nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), TokenMean(), nn.Linear(6, 3)),
        (4, 5),
    ),
    # An inner one (its output requires gradient in every step): hooked on its matmul's node, where the
    # in-place ReLU reroutes the view's gradient through the base.
    "tokens-linear-inner": (
        lambda: nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(inplace=True), TokenMean(),
                              nn.Linear(6, 3)),
        (4, 5),
    ),
}  # fmt: skip


def _net(name: str) -> nn.Module:
    torch.manual_seed(0)
    return NETS[name][0]()


def _data(name: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, *NETS[name][1], generator=g), torch.randint(0, 3, (N,), generator=g))


@pytest.mark.parametrize("replay", [False, True], ids=["one-pass", "clip_replay"])
@pytest.mark.parametrize("engine", available_engines())
@pytest.mark.parametrize("name", list(NETS))
def test_an_inplace_op_after_the_first_layer_trains_as_the_clipped_mean(name: str, engine: str, replay: bool) -> None:
    module = TinyModule(net=_net(name))  # lr = 1: each update is the released gradient
    start = params_of(module)
    trainer = make_trainer(dp(max_grad_norm=C, clipping_engine=engine, clip_replay=replay), max_steps=STEPS)
    trainer.fit(module, loader(_data(name), BATCH))
    assert trainer.strategy.steps == STEPS and len(module.batches) == STEPS

    reference = _net(name)
    reference.load_state_dict({k.removeprefix("net."): v for k, v in start.items()})
    for x, y in module.batches:
        step = clipped_sum(per_example_grads(reference, F.cross_entropy, x, y), C)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p -= step[n] / BATCH  # the public expected batch size q·N
    for n, p in module.net.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), reference.get_parameter(n).detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")  # fmt: skip
