"""An epoch or fit that ends early (``on_train_batch_start`` -> -1) never leaks a partial step into the next one.

Lightning ends an epoch when ``on_train_batch_start`` returns -1, also in the middle of an
accumulation; the micro-batches already clipped must not be added to the next epoch's release
(privacy round 4, part 2, finding N1: the release moved by 2 C). References: torch.func.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dplightning.privacy.grad_sample import available_engines
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import clipped_sum, per_example_grads

N = 8


class _CutFirstEpoch(TinyModule):
    """Ends epoch 0 before its micro-batch ``cut`` (Lightning's "skip the rest of this epoch")."""

    def __init__(self, cut: int) -> None:
        super().__init__(lr=1.0)
        self.cut = cut
        self.starts: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if self.current_epoch == 0 and batch_idx == self.cut:
            return -1
        self.starts.append(params_of(self))
        return None


@pytest.mark.parametrize("engine", available_engines())
@pytest.mark.parametrize("replay", [False, True])
def test_a_cut_accumulation_is_dropped_not_added_to_the_next_release(engine: str, replay: bool) -> None:
    torch.manual_seed(0)
    module = _CutFirstEpoch(cut=1)
    before = params_of(module)
    # q = 1: every example is in every step's batch, so a leaked micro-batch counts its examples twice.
    extra: dict[str, Any] = dict(clip_replay=True, verify_gradients="never") if replay else {}
    strategy = dp(max_grad_norm=0.3, seed=3, clipping_engine=engine, **extra)
    trainer = make_trainer(strategy, max_epochs=2, max_steps=-1, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="ended in the middle of an accumulation"):
        trainer.fit(module, loader(make_dataset(N), N))
    assert trainer.strategy.dp_state.steps == 1 and trainer.global_step == 1
    released = module.batches[1:]  # epoch 0's micro-batch was never released
    assert len(released) == 2
    x = torch.cat([b[0] for b in released])
    y = torch.cat([b[1] for b in released])
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    want = clipped_sum(per_example_grads(net, F.cross_entropy, x, y), 0.3)
    after = params_of(module)
    for name, value in before.items():
        torch.testing.assert_close(value - after[name], want[name.removeprefix("net.")] / N, rtol=1e-5, atol=1e-7)
