"""Advice that must not lead into the next error (issue: existing projects, item 4).

* The refusal of ``nn.MultiheadAttention`` names the condition of each way out (Opacus'
  ``DPMultiheadAttention``: no causal mask; ``grad_sample_mode="functorch"``: no attention
  dropout), and those conditions are checked against Opacus and torch.func themselves.
* ``poisson_sampling=False`` with a user's ``batch_sampler`` takes the batch size from it.
* A model that carries state between batches (an LSTM's hidden state) is named as such.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, TensorDataset

from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, params_of
from tests.reference import per_example_grads

D, T, N = 8, 5, 32


class CausalDecoder(nn.Module):
    """A GPT-style block: ``nn.TransformerDecoder`` with a causal ``tgt_mask`` (as nn.Transformer tutorials do)."""

    def __init__(self, dropout: float, attention: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        layer = nn.TransformerDecoderLayer(D, 2, 16, dropout=dropout, batch_first=True)
        if attention is not None:  # the advice followed: Opacus' layer in place of nn.MultiheadAttention
            layer.self_attn = attention(D, 2, dropout=dropout, batch_first=True)
            layer.multihead_attn = attention(D, 2, dropout=dropout, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 1)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        return self.head(self.decoder(h, h, tgt_mask=mask).mean(1))


def _sequences() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, T, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


def _fit(net: nn.Module, **strategy: object) -> None:
    make_trainer(dp(noise_multiplier=1.0, **strategy), max_steps=2).fit(TinyModule(net), loader(_sequences(), 8))


def test_the_attention_refusal_names_the_condition_of_each_way_out() -> None:
    with pytest.raises(ValueError, match="MultiheadAttention") as refusal:
        _fit(CausalDecoder(dropout=0.1), grad_sample_mode="hooks")  # registered samplers only
    message = str(refusal.value)
    assert "DPMultiheadAttention has no causal mask" in message and "is_causal=False" in message
    assert "grad_sample_mode='functorch'" in message and "dropout must be 0" in message
    assert "yours have dropout=0.1" in message


def test_the_named_conditions_are_the_ones_opacus_and_torch_func_impose() -> None:
    """What the refusal says, checked against the libraries (a new Opacus with causal masks fails here)."""
    from opacus.layers import DPMultiheadAttention

    with pytest.raises((AssertionError, ValueError), match="causal mask|attn_mask"):
        _fit(CausalDecoder(dropout=0.0, attention=DPMultiheadAttention))
    with pytest.raises(RuntimeError, match="draws random numbers"):
        _fit(CausalDecoder(dropout=0.1), grad_sample_mode="functorch")
    _fit(CausalDecoder(dropout=0.0), grad_sample_mode="functorch")  # both conditions met: it trains


class Unsized(Sampler[list[int]]):
    """A user's batch sampler (length bucketing, say) that does not state its batch size."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self):
        yield from (list(range(i, min(i + self.size, self.n))) for i in range(0, self.n, self.size))

    def __len__(self) -> int:
        return -(-self.n // self.size)


class Buckets(Unsized):
    """The same sampler stating its batch size."""

    @property
    def batch_size(self) -> int:
        return self.size


@pytest.mark.parametrize(
    "make_sampler",
    [lambda n, b: BatchSampler(SequentialSampler(range(n)), b, False), Buckets],
    ids=["torch_batch_sampler", "own_batch_sampler"],
)
def test_a_batch_sampler_without_poisson_sampling_gives_the_batch_size(make_sampler) -> None:
    n, b, huge = 64, 16, 1e6
    data = make_dataset(n)
    module = TinyModule(lr=1.0)
    before = params_of(module)
    trainer = make_trainer(dp(max_grad_norm=huge, poisson_sampling=False), max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ε is infinite without Poisson sampling
        trainer.fit(module, DataLoader(data, batch_sampler=make_sampler(n, b)))
    assert trainer.strategy.sample_rate == b / n and trainer.strategy.expected_batch_size == b
    # σ = 0, nothing clipped, SGD lr 1: the update is minus the mean gradient of the first batch.
    (x, y), = module.batches
    reference = TinyModule()
    reference.net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    grads = per_example_grads(reference.net, torch.nn.functional.cross_entropy, x, y)
    for name, p in module.net.named_parameters():
        torch.testing.assert_close(before[f"net.{name}"] - p.detach(), grads[name].sum(0) / b)


def test_a_batch_sampler_without_a_batch_size_is_refused_naming_it() -> None:
    module = TinyModule()
    before = params_of(module)
    trainer = make_trainer(dp(noise_multiplier=1.0, poisson_sampling=False), max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"batch size.*Unsized.*batch_size attribute"):
            trainer.fit(module, DataLoader(make_dataset(64), batch_sampler=Unsized(64, 16)))
    assert all(torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())


class StatefulLSTM(TinyModule):
    """Keeps the LSTM's hidden state between batches, as truncated-BPTT language models do."""

    def __init__(self) -> None:
        from opacus.layers import DPLSTM

        super().__init__(net=nn.Linear(4, 3))
        self.lstm = DPLSTM(3, 4, batch_first=True)
        self.hidden: tuple[Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        out, hidden = self.lstm(x, self.hidden)
        self.hidden = (hidden[0].detach(), hidden[1].detach())
        return self.net(out[:, -1])


def _series(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, T, 3, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_state_carried_between_batches_is_named_when_the_batch_size_changes() -> None:
    # Batches of 16 then 8: the second batch meets the first one's 16-row hidden state.
    trainer = make_trainer(dp(poisson_sampling=False, verify_gradients="never"), max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"carries state from an earlier batch.*stateful models are not"):
            trainer.fit(StatefulLSTM(), DataLoader(_series(24), batch_size=16))


def test_state_carried_between_batches_is_refused_by_the_coupling_probe_at_the_first_step() -> None:
    module = StatefulLSTM()
    before = params_of(module)
    trainer = make_trainer(dp(noise_multiplier=1.0, seed=0), max_steps=2)
    with pytest.raises(RuntimeError, match=r"self\.hidden: stateful models are not supported"):
        trainer.fit(module, loader(_series(64), 16))
    assert trainer.strategy.steps == 0
    assert all(torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())
