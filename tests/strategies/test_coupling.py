"""The coupling probe: a loss or model that makes one example's gradient depend on others is refused.

Each refused case trained silently before the probe existed (per-example gradients still sum to
autograd's gradient, so the gradient verification passed). Each accepted case draws random
numbers or logs inside ``training_step``, which the probe must replay or silence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from tests.helpers import TinyModule, dp, make_trainer, params_of

N = 12


class LossOf(TinyModule):
    """TinyModule with a loss written by the test."""

    def __init__(self, net: nn.Module, loss) -> None:
        super().__init__(net=net, lr=0.5)
        self.loss_of = loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        self.record(x, y)
        return self.loss_of(self.net, x, y)


def _data(x: Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, torch.arange(len(x)) % 3), batch_size=len(x))  # q = 1


def _x(*shape: int) -> Tensor:
    return torch.randn(N, *shape, generator=torch.Generator().manual_seed(0))


def _mlp(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Dropout(dropout), nn.Linear(5, 3))


def _fit(module: TinyModule, data: DataLoader, steps: int = 2, **strategy: object) -> None:
    make_trainer(dp(noise_multiplier=0.0, max_grad_norm=1.0, **strategy), max_steps=steps).fit(module, data)


def _assert_refused(module: TinyModule, data: DataLoader) -> None:
    before = params_of(module)
    with pytest.raises(RuntimeError, match="replacing the other examples of the batch changed the gradients"):
        _fit(module, data)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    assert len(module.batches) == 1  # the real batch; the probe's replay is not recorded


@pytest.fixture(params=["summary", "held"])
def comparison(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of comparing: from a summary of the clipped real pass, or from its held per-example state."""
    from dplightning.strategies import private_step

    monkeypatch.setattr(private_step, "summary_pays", lambda grads: request.param == "summary")
    return request.param


def _token_mean_over_the_batch(net, ids, labels):
    logits = net(input_ids=ids).logits[:, :-1]
    targets = labels[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    counted = (targets != -100).float()
    return (per_token * counted).sum() / counted.sum()  # Hugging Face's labels= loss, written out


def test_a_token_mean_over_the_batch_is_refused(comparison: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=17, n_positions=8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, 17, (N, 7), generator=torch.Generator().manual_seed(1))
    lengths = torch.randint(2, 8, (N,), generator=torch.Generator().manual_seed(2))
    labels = ids.masked_fill(torch.arange(7) >= lengths[:, None], -100)  # sequences of different lengths
    data = DataLoader(TensorDataset(ids, labels), batch_size=N)
    _assert_refused(LossOf(GPT2LMHeadModel(config), _token_mean_over_the_batch), data)


def test_a_contrastive_loss_over_the_batch_is_refused(comparison: str) -> None:
    def info_nce(net, x, y):
        z = F.normalize(net(x), dim=1)
        return F.cross_entropy(z @ z.T / 0.5, torch.arange(len(x)))  # in-batch negatives

    _assert_refused(LossOf(_mlp(), info_nce), _data(_x(6)))


def test_batch_centred_outputs_are_refused(comparison: str) -> None:
    def centred(net, x, y):
        out = net(x)
        return F.cross_entropy(out - out.mean(0), y)

    _assert_refused(LossOf(_mlp(), centred), _data(_x(6)))


def test_sequence_first_input_as_long_as_the_batch_is_refused(comparison: str) -> None:
    # [T, n, d] with T == n: every layer sees as many rows as the batch has examples, so the
    # row check passes; the probe sees that "example" i is time step i of every sequence.
    class OverTime(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.step(x.transpose(0, 1)).tanh().mean(0))

    _assert_refused(LossOf(OverTime(), lambda net, x, y: F.cross_entropy(net(x), y)), _data(_x(N, 4)))


def test_dropout_and_noise_drawn_in_the_step_are_replayed(comparison: str) -> None:
    def noisy(net, x, y):
        return F.cross_entropy(net(x + torch.randn_like(x)), y)  # DPDM-like draws, and dropout in the net

    module = LossOf(_mlp(dropout=0.5), noisy)
    _fit(module, _data(_x(6)), steps=3)
    assert len(module.batches) == 3


class Logged(LossOf):
    def __init__(self) -> None:
        super().__init__(_mlp(), lambda net, x, y: F.cross_entropy(net(x), y))
        self.seen = MeanMetric()
        self.logged = 0

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        self.seen.update(x.sum(1))
        self.log("rows", float(len(x)))
        if not self.trainer.strategy.probing:
            self.logged += 1
        return super().training_step(batch, batch_idx)


def test_the_probe_does_not_log_or_update_metrics() -> None:
    module = Logged()
    _fit(module, _data(_x(6)), steps=3)
    assert module.logged == 3 and module.seen.update_count == 3
    torch.testing.assert_close(module.seen.compute(), _x(6).sum(1).mean())


def test_verify_gradients_never_turns_the_probe_off() -> None:
    def centred(net, x, y):
        out = net(x)
        return F.cross_entropy(out - out.mean(0), y)

    module = LossOf(_mlp(), centred)
    _fit(module, _data(_x(6)), verify_gradients="never")  # trains on a coupled loss: the user's choice
    assert len(module.batches) == 2


def test_the_probe_runs_without_autograd_gradients_and_a_refusal_leaves_none() -> None:
    # The real step's p.grad is only read by the gradient verification, before the probe: held
    # through the probe's forward it raised the peak by a model's size (memory_plan_check.py).
    held: list[bool] = []

    def watched(net, x, y):
        out = net(x)
        if module.trainer.strategy.probing:
            held.append(any(p.grad is not None for p in net.parameters()))
        return F.cross_entropy(out - out.mean(0), y)

    module = LossOf(_mlp(), watched)
    _assert_refused(module, _data(_x(6)))
    assert held == [False]
    assert all(p.grad is None for p in module.parameters())  # autograd's raw sum is not private


@pytest.mark.parametrize("engine", ["instantiate", "book_keeping"])
def test_the_real_steps_per_example_state_is_freed_before_the_probe(engine: str, monkeypatch) -> None:
    # Each captured call keeps its layer's inputs in its hook's closure, which lives on the graph as long
    # as the loss does (to the end of the step), and book-keeping's factored gradients hold the inputs and
    # the output gradients until they are clipped. Held through the probe's forward they doubled the peak
    # at long sequences (scaling_curves.py, T = 2048: 1,520 MiB against 1,084 without verification) and
    # raised GPT-2's by a third (memory_plan_check.py): the real pass is clipped before the probe and
    # compared through a summary.
    import gc
    import weakref

    from dplightning.privacy.grad_sample import hooks as hooks_module

    captured: list[weakref.ref] = []
    alive_in_probe: list[int] = []
    detach, pop = hooks_module._detach, hooks_module.PerExampleHooks.pop

    def recording_detach(value):
        out = detach(value)
        if isinstance(out, Tensor) and out.is_floating_point() and not module.trainer.strategy.probing:
            captured.append(weakref.ref(out))
        return out

    def recording_pop(self, rows_per_unit: int = 1):
        grads = pop(self, rows_per_unit)
        if not module.trainer.strategy.probing:
            for g in grads.values():
                captured.extend(weakref.ref(t) for t in vars(g).values() if isinstance(t, Tensor))
        return grads

    def watched(net, x, y):
        if module.trainer.strategy.probing and not alive_in_probe:
            gc.collect()
            alive_in_probe.append(sum(ref() is not None for ref in captured))
        return F.cross_entropy(net(x), y)

    monkeypatch.setattr(hooks_module, "_detach", recording_detach)
    monkeypatch.setattr(hooks_module.PerExampleHooks, "pop", recording_pop)
    module = LossOf(_mlp(), watched)
    _fit(module, _data(_x(6)), steps=1, clipping_engine=engine)
    assert captured and alive_in_probe == [0]


def test_a_refusal_discards_the_clipped_sum() -> None:
    # The real pass is clipped into the buckets before the probe runs: a refused step must leave nothing
    # there that a later release could publish.
    privatizers = []

    def centred(net, x, y):
        privatizers.append(module.trainer.strategy.private_step.privatizer)
        out = net(x)
        return F.cross_entropy(out - out.mean(0), y)

    module = LossOf(_mlp(), centred)
    _assert_refused(module, _data(_x(6)))
    buckets = privatizers[0].buckets
    assert buckets and all(torch.count_nonzero(b) == 0 for b in buckets)


def test_the_summary_is_taken_where_it_is_smaller_than_the_state_it_frees() -> None:
    from dplightning.privacy.grad_sample import Dense, Factored
    from dplightning.privacy.grad_sample.grads import held_bytes
    from dplightning.strategies.coupling import summary_pays

    weight, bias = nn.Parameter(torch.zeros(256, 256)), nn.Parameter(torch.zeros(256))

    def linear(n: int, tokens: int) -> dict[nn.Parameter, object]:
        a, d = torch.randn(n, tokens, 256), torch.randn(n, tokens, 256)
        return {weight: Factored(a, d, 256, weight.shape), bias: Dense(d.sum(1))}

    long_sequences, one_row_each = linear(32, 64), linear(2, 1)
    assert summary_pays(long_sequences)  # activations: 2 x 32 x 64 x 256 floats against 256 x 257
    assert not summary_pays(one_row_each)
    shared = torch.randn(4, 8, 16)  # q, k and v projections of one input keep it once
    grads = [Factored(shared, torch.randn(4, 8, 16), 16, torch.Size([16, 16])) for _ in range(3)]
    assert held_bytes(grads) == 4 * shared.numel() * 4


class _Sizes:
    """Batches of the given sizes in order (a batch sampler; its batch_size is the expected one)."""

    batch_size = 2

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self):  # type: ignore[no-untyped-def]
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


def test_the_probe_counts_only_batches_it_compared() -> None:
    """Batches of one example compare nothing; the probe keeps going until two batches were compared (40.7)."""
    x = _x(6)
    data = DataLoader(TensorDataset(x, torch.arange(N) % 3), batch_sampler=_Sizes([1, 1, 3, 3, 4]))
    module = LossOf(_mlp(), lambda net, x, y: (net(x) - net(x).mean(0)).square().sum() / max(len(x), 1))
    with pytest.raises(RuntimeError, match="replacing the other examples of the batch changed the gradients"):
        _fit(module, data, steps=6, poisson_sampling=False)
    assert len(module.batches) == 3  # refused at the first batch with two examples or more


def test_a_refusal_after_a_release_says_what_was_spent() -> None:
    """Seed 11 draws Poisson batches of 1, 1, 2, ... examples: the probe first compares at the third step."""
    data = DataLoader(TensorDataset(_x(6), torch.arange(N) % 3), batch_size=2)
    module = LossOf(_mlp(), lambda net, x, y: (net(x) - net(x).mean(0)).square().sum() / max(len(x), 1))
    with pytest.raises(RuntimeError) as refused:
        _fit(module, data, steps=6, seed=11)
    assert [len(y) for _, y in module.batches] == [1, 1, 2]
    assert "had already released 2 noisy step(s) before this check refused" in str(refused.value)


class _Sequences(torch.utils.data.Dataset):
    """Sequences of 1..5 tokens of 6 features, padded by the collate to the batch's longest (dynamic padding)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(3)
        self.items = [(torch.randn(int(torch.randint(1, 6, (1,), generator=g)), 6, generator=g), i % 3)
                      for i in range(n)]  # fmt: skip
        self.items[0] = (self.items[0][0][:1], 0)  # a short one and a long one are always among them
        self.items[1] = (torch.randn(5, 6, generator=g), 1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return self.items[i]


def _pad(items):  # type: ignore[no-untyped-def]
    length = max(x.shape[0] for x, _ in items)
    x = torch.zeros(len(items), length, 6)
    mask = torch.zeros(len(items), length)
    for i, (xi, _) in enumerate(items):
        x[i, : len(xi)], mask[i, : len(xi)] = xi, 1.0
    return x, mask, torch.tensor([y for _, y in items])


class _Tokens(TinyModule):
    """Per-token cross-entropy over padded sequences, reduced as ``form`` says (dropout on: eval-mode probe)."""

    def __init__(self, form: str) -> None:
        super().__init__(net=nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Dropout(0.2), nn.Linear(5, 3)), lr=0.5)
        self.form = form

    def training_step(self, batch, batch_idx: int) -> Tensor:  # type: ignore[no-untyped-def]
        x, mask, y = batch
        out = self.net(x)  # [n, T, 3]
        per_token = F.cross_entropy(out.transpose(1, 2), y[:, None].expand(mask.shape), reduction="none")
        if self.form == "padded_grid_mean":
            return (per_token * mask).mean()  # divides by n x T_max: the longest example scales every gradient
        if self.form == "mean_pooling_over_padding":
            return F.cross_entropy(out.mean(1), y)  # pools the padded steps too
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()  # per example over its own tokens


@pytest.mark.parametrize("form", ["padded_grid_mean", "mean_pooling_over_padding"])
def test_a_loss_that_depends_on_the_padded_shape_is_refused(form: str) -> None:
    """The swap probe keeps the batch's shape; a unit collated alone does not (finding 40.4: 6.95 C)."""
    module = _Tokens(form)
    before = params_of(module)
    data = DataLoader(_Sequences(), batch_size=8, collate_fn=_pad)
    with pytest.raises(RuntimeError, match="changed when it was collated alone"):
        _fit(module, data, steps=3, seed=1)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_a_per_example_masked_mean_over_padded_batches_trains() -> None:
    module = _Tokens("masked_mean_per_example")
    _fit(module, DataLoader(_Sequences(), batch_size=8, collate_fn=_pad), steps=3, seed=1)


@pytest.mark.parametrize("clipping", ["per_layer", "flat"])
def test_a_probe_after_the_verified_steps_sees_the_whole_pass(clipping: str) -> None:
    """Steps of one example use up the verification but not the probe; the later probe must not meet early
    per-layer clipping, which takes the per-example gradients before it compares (the harness found it)."""
    data = DataLoader(TensorDataset(_x(6), torch.arange(N) % 3), batch_sampler=_Sizes([1, 1, 3, 3, 4]))
    module = LossOf(_mlp(), lambda net, x, y: F.cross_entropy(net(x), y))
    _fit(module, data, steps=5, poisson_sampling=False, clipping=clipping)
    assert len(module.batches) == 5


def test_each_check_reports_its_decision_at_the_seam() -> None:
    """The audit contract: refusals and acceptances are named events (dplightning.privacy.release)."""
    from dplightning.privacy.release import Decision, observe_decisions

    seen: list[Decision] = []
    with observe_decisions(seen.append):
        _fit(LossOf(_mlp(), lambda net, x, y: F.cross_entropy(net(x), y)), _data(_x(6)), steps=2)
    assert {d.check for d in seen} >= {"gradient_verification", "coupling_probe", "state_watch", "whole_logical_batch"}
    assert all(d.accepted for d in seen)
    seen.clear()
    with observe_decisions(seen.append), pytest.raises(RuntimeError):
        _fit(LossOf(_mlp(), lambda net, x, y: F.cross_entropy(net(x) - net(x).mean(0), y)), _data(_x(6)))
    assert seen[-1] == Decision("coupling_probe", False)
