"""With σ = 0, no clipping and q = 1, one DP step equals a plain autograd step, or the strategy refuses.

Each case is a model that once trained silently on the wrong gradient (review of the DP
core). The reference is the same module trained one step by Lightning without DP.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dplightning.privacy.grad_sample import register_broadcast_embedding
from tests.helpers import TinyModule, dp, make_trainer, params_of

N = 12
NO_CLIP = 1e6


class Net(TinyModule):
    """TinyModule over any network and any batch-to-loss function."""

    def __init__(self, net: nn.Module, loss: Callable[[nn.Module, Tensor, Tensor], Tensor] | None = None) -> None:
        super().__init__(net=net, lr=0.5)
        self.loss_of = loss or (lambda net, x, y: F.cross_entropy(net(x), y))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.record(x, y)
        return self.loss_of(self.net, x, y)


def _data(x: Tensor, classes: int = 3) -> DataLoader:
    y = torch.arange(len(x)) % classes
    return DataLoader(TensorDataset(x, y), batch_size=len(x), shuffle=False)  # q = 1: one batch, all examples


def _one_step(module: pl.LightningModule, data: DataLoader, strategy: object, **kwargs: object) -> dict[str, Tensor]:
    make_trainer(strategy, max_steps=1, **kwargs).fit(module, data)
    return params_of(module)


def assert_dp_step_is_the_autograd_step(module: pl.LightningModule, data: DataLoader, **strategy_kwargs) -> None:
    """Also with ``clip_replay`` (verification off, so that the one step is replayed) unless the case sets it."""
    plain, replayed = copy.deepcopy(module), copy.deepcopy(module)
    before = params_of(module)
    private = _one_step(module, data, dp(max_grad_norm=NO_CLIP, **strategy_kwargs))
    expected = _one_step(plain, data, "auto")
    replay_kwargs = {"clip_replay": True, "verify_gradients": "never", **strategy_kwargs}
    private_replayed = _one_step(replayed, data, dp(max_grad_norm=NO_CLIP, **replay_kwargs))
    moved = False
    for name in expected:
        torch.testing.assert_close(private[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(private_replayed[name], expected[name], rtol=1e-4, atol=1e-6, msg=f"{name} replay")
        moved |= not torch.equal(expected[name], before[name])
    assert moved  # the reference step really trained something


def assert_refused_before_any_update(module: pl.LightningModule, data: DataLoader, error: type, match: str) -> None:
    before = params_of(module)
    with pytest.raises(error, match=match):
        _one_step(module, data, dp(max_grad_norm=NO_CLIP))
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _x(*shape: int) -> Tensor:
    return torch.randn(N, *shape, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ now exact


def test_layer_called_twice_with_one_call_cut_from_the_graph() -> None:
    def loss(net, x, y):
        shared = net[0]
        h = torch.tanh(shared(x))
        _ = shared(3 * x).detach()  # a second call, on other inputs, whose output never gets a gradient
        return F.cross_entropy(net[1](h), y)

    assert_dp_step_is_the_autograd_step(Net(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)), loss), _data(_x(6)))


def test_forward_with_gradients_that_is_never_backpropagated() -> None:
    def loss(net, x, y):
        out = F.cross_entropy(net(x), y)
        net(x * 2)  # a metric pass after the loss, with gradients enabled
        return out

    assert_dp_step_is_the_autograd_step(Net(_mlp(), loss), _data(_x(6)))


def test_trainable_submodule_in_eval_mode() -> None:
    class EvalHead(Net):
        def on_train_epoch_start(self) -> None:
            self.net[2].eval()  # e.g. to turn off its dropout; it still trains

    assert_dp_step_is_the_autograd_step(EvalHead(_mlp()), _data(_x(6)))


def test_embedding_padding_row_gets_no_gradient() -> None:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(9, 4, padding_idx=0)
            self.head = nn.Linear(4, 3)

        def forward(self, ids: Tensor) -> Tensor:
            return self.head(self.emb(ids).mean(1))

    ids = torch.randint(0, 9, (N, 5), generator=torch.Generator().manual_seed(1))
    ids[:, -2:] = 0  # padded positions
    module = Net(Bag())
    padding_row = module.net.emb.weight[0].detach().clone()
    assert_dp_step_is_the_autograd_step(module, _data(ids))
    torch.testing.assert_close(module.net.emb.weight[0], padding_row, rtol=0, atol=0)


class TwoInputs(nn.Module):
    """A layer without a registered sampler whose forward takes a second input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x: Tensor, gate: Tensor, *, shift: Tensor) -> Tensor:
        return x * self.w * torch.sigmoid(gate) + shift


@pytest.mark.parametrize("second", ["positional", "keyword"])
def test_functorch_fallback_replays_every_input(second: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = TwoInputs()
            self.head = nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            gate, shift = x.flip(1), torch.ones(6)  # shift is shared by the batch: not split per example
            out = self.mix(x, gate, shift=shift) if second == "positional" else self.mix(x, gate=gate, shift=shift)
            return self.head(out)

    assert_dp_step_is_the_autograd_step(Net(Model()), _data(_x(6)), grad_sample_mode="functorch")


def test_functorch_fallback_on_multihead_attention() -> None:
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.attn(x, x, x)[0].mean(1))  # query, key and value; the weights output unused

    assert_dp_step_is_the_autograd_step(Net(Attend()), _data(_x(4, 8)), grad_sample_mode="functorch")


class _Positions(nn.Module):
    """Token plus position embeddings, positions looked up as [1, T] ids (Hugging Face's default)."""

    def __init__(self, combine: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(9, 4), nn.Embedding(5, 4), nn.Linear(4, 3)
        self.combine = combine

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T]
        return self.head(self.combine(self.tok(ids), self.pos(positions)).tanh().mean(1))


class _AddedPositions(_Positions):
    def __init__(self) -> None:
        super().__init__(lambda tokens, positions: tokens + positions)  # broadcast over the batch: exact per example


register_broadcast_embedding(_AddedPositions, "pos")


def test_declared_broadcast_position_ids_are_looked_up_per_example() -> None:
    ids = torch.randint(0, 9, (N, 5), generator=torch.Generator().manual_seed(2))
    assert_dp_step_is_the_autograd_step(Net(_AddedPositions()), _data(ids))


@pytest.mark.parametrize(
    "combine",
    [
        lambda tokens, positions: tokens + positions,  # exact, but not declared
        lambda tokens, positions: tokens + positions[0],  # each copy but the first gets no gradient
        lambda tokens, positions: tokens + positions.mean(0),  # every copy gets 1/n of the batch's
    ],
    ids=["added", "first-row", "mean"],
)
def test_undeclared_broadcast_embedding_is_refused_before_any_update(combine) -> None:
    ids = torch.randint(0, 9, (N, 5), generator=torch.Generator().manual_seed(2))
    assert_refused_before_any_update(
        Net(_Positions(combine)), _data(ids), RuntimeError, r"'net\.pos'.*1 rows.*register_broadcast_embedding"
    )


def test_layer_unfrozen_during_training_is_trained() -> None:
    class Unfreeze(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 1:
                pl_module.net[0].requires_grad_(True)

    module = TinyModule(lr=0.5)
    module.net[0].requires_grad_(False)  # in the optimizer, but frozen at setup
    data = _data(_x(6))
    trainer = make_trainer(dp(max_grad_norm=NO_CLIP), max_epochs=2, max_steps=-1, callbacks=[Unfreeze()])
    after_first = {}

    class Snapshot(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            after_first.setdefault("params", params_of(pl_module))

    trainer.callbacks.append(Snapshot())
    trainer.fit(module, data)
    first = after_first["params"]
    assert not torch.equal(module.net[0].weight, first["net.0.weight"])
    # The second step is the autograd step of the unfrozen model.
    reference = TinyModule(lr=0.5)
    reference.load_state_dict({k: v for k, v in first.items()}, strict=False)
    expected = _one_step(reference, data, "auto")
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-4, atol=1e-6, msg=name)


def _lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Next-token loss, the mean over each sequence's own tokens, then over the batch."""
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return per_token.mean(1).mean()


def test_gpt2_with_default_position_ids() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=17, n_positions=8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)

    def loss(net, ids, y):
        return _lm_loss(net(input_ids=ids).logits, ids)

    ids = torch.randint(0, 17, (N, 6), generator=torch.Generator().manual_seed(3))
    assert_dp_step_is_the_autograd_step(Net(model, loss), _data(ids))


def test_opt_under_the_functorch_fallback() -> None:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, ffn_dim=16, vocab_size=17,
                       max_position_embeddings=8, word_embed_proj_dim=8, dropout=0.0,
                       attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = OPTForCausalLM(config)

    def loss(net, ids, y):
        return _lm_loss(net(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ids)

    ids = torch.randint(2, 17, (N, 6), generator=torch.Generator().manual_seed(4))
    assert_dp_step_is_the_autograd_step(Net(model, loss), _data(ids), grad_sample_mode="functorch")


# ------------------------------------------------------------------ refused: contributions outside the hooks


def test_weight_used_outside_its_module_is_refused_with_its_name() -> None:
    class TiedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix = nn.Embedding(9, 4), nn.Linear(4, 4)

        def forward(self, ids: Tensor) -> Tensor:
            h = self.mix(self.emb(ids).mean(1))
            return F.linear(h, self.emb.weight)[:, :3]  # the embedding used as the head, outside its module

    ids = torch.randint(0, 9, (N, 5), generator=torch.Generator().manual_seed(1))
    assert_refused_before_any_update(
        Net(TiedHead()), _data(ids), RuntimeError, r"net\.emb\.weight.*bypasses the per-example hooks"
    )


def test_penalty_on_a_weight_in_training_step_is_refused() -> None:
    def loss(net, x, y):
        return F.cross_entropy(net(x), y) + 0.5 * net[0].weight.square().sum()

    with pytest.raises(RuntimeError, match=r"net\.0\.weight.*weight_decay"):
        _one_step(Net(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), loss), _data(_x(6)),
                  dp(max_grad_norm=NO_CLIP))  # fmt: skip


def test_verification_can_be_turned_off() -> None:
    def loss(net, x, y):
        return F.cross_entropy(net(x), y) + 0.5 * net[0].weight.square().sum()

    module = Net(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), loss)
    _one_step(module, _data(_x(6)), dp(max_grad_norm=NO_CLIP, verify_gradients="never"))  # trains on the hooked part


def test_broadcast_batch_dimension_in_another_layer_is_named_at_the_first_step() -> None:
    class SharedQuery(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(6, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            q = self.query(torch.ones(1, 6))  # one row shared by the batch, broadcast below
            return self.head(x * q)

    with pytest.raises(RuntimeError, match=r"'net\.query'.*1 rows.*broadcasts a batch dimension"):
        _one_step(Net(SharedQuery()), _data(_x(6)), dp(max_grad_norm=NO_CLIP))


def test_embedding_options_that_couple_examples_are_refused() -> None:
    net = nn.Sequential(nn.Embedding(9, 4, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(20, 3))
    ids = torch.randint(0, 9, (N, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        _one_step(Net(net), _data(ids), dp())


# ------------------------------------------------------------------ batches of any type: the count is never unknown


@dataclasses.dataclass
class _DataclassBatch:
    x: Tensor
    y: Tensor


class _OpaqueBatch:
    """A batch object the strategy cannot look into."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y


class _ObjectBatches(Net):
    """Net over batches collated into an object; optionally saying how many examples a batch holds."""

    def __init__(self, net: nn.Module, counts: bool = False) -> None:
        super().__init__(net)
        if counts:
            self.dp_batch_size = lambda batch: len(batch.x)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self.loss_of(self.net, batch.x, batch.y)


def _object_data(x: Tensor, batch_type: type) -> DataLoader:
    y = torch.arange(len(x)) % 3

    def collate(rows):
        xs, ys = zip(*rows) if rows else ((), ())
        return batch_type(torch.stack(xs) if xs else x[:0], torch.stack(ys) if ys else y[:0])

    return DataLoader(TensorDataset(x, y), batch_size=len(x), shuffle=False, collate_fn=collate)


class _SequenceFirst(nn.Module):
    """A recurrent-style model whose Linear layer sees [T, n, d] (time first)."""

    def __init__(self) -> None:
        super().__init__()
        self.step, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.step(x.transpose(0, 1)).tanh()  # [T, n, d]
        return self.head(h.mean(0))


def test_dataclass_batch_is_counted_and_sequence_first_input_refused() -> None:
    assert_refused_before_any_update(
        _ObjectBatches(_SequenceFirst()),
        _object_data(torch.randn(N, 6, 4), _DataclassBatch),
        RuntimeError,
        r"'net\.step'.*6 rows.*12 examples.*sequence-first",
    )


def test_batch_of_unknown_size_is_refused_naming_the_hook() -> None:
    assert_refused_before_any_update(
        _ObjectBatches(_mlp()), _object_data(_x(6), _OpaqueBatch), TypeError, r"_OpaqueBatch.*dp_batch_size"
    )


def test_batch_counted_by_the_module_hook_gives_the_autograd_step() -> None:
    # The mean loss is scaled back by the module's count: 12 examples, not 1.
    assert_dp_step_is_the_autograd_step(_ObjectBatches(_mlp(), counts=True), _object_data(_x(6), _OpaqueBatch))


def test_module_hook_must_return_a_count() -> None:
    module = _ObjectBatches(_mlp(), counts=True)
    module.dp_batch_size = lambda batch: 12.0
    with pytest.raises(ValueError, match=r"dp_batch_size.*int >= 0.*12\.0"):
        _one_step(module, _object_data(_x(6), _OpaqueBatch), dp(max_grad_norm=NO_CLIP))


def test_layer_called_without_a_positional_input_is_refused() -> None:
    class KeywordCall(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.body(input=x).tanh())  # no positional tensor: the samplers split args[0]

    assert_refused_before_any_update(
        Net(KeywordCall()), _data(_x(6)), RuntimeError, r"'net\.body'.*without a positional tensor input"
    )


class _RenamedRMSNorm(nn.Module):
    """Llama's RMSNorm under a name no sampler is registered for (as Gemma, Granite, Cohere ... ship theirs)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.variance_epsilon = 1e-6

    def forward(self, x: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


def test_a_layer_without_a_sampler_is_differentiated_by_torch_func_by_default() -> None:
    """Issue 43: a layer is not refused for its class name when torch.func computes it exactly."""
    from dplightning.privacy.grad_sample.samplers import registered_sampler

    net = nn.Sequential(nn.Linear(6, 8), _RenamedRMSNorm(8), nn.Tanh(), nn.Linear(8, 3))
    assert registered_sampler(net[1]) is None
    assert_dp_step_is_the_autograd_step(Net(net), _data(_x(6)))
    strategy = dp(noise_multiplier=1.0)
    make_trainer(strategy, max_steps=1).fit(Net(copy.deepcopy(net)), _data(_x(6)))
    assert "torch.func" in strategy.engine_table()


def test_hooks_mode_still_refuses_a_layer_without_a_sampler() -> None:
    net = nn.Sequential(nn.Linear(6, 8), _RenamedRMSNorm(8), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="No per-example gradient sampler.*_RenamedRMSNorm"):
        make_trainer(dp(noise_multiplier=1.0, grad_sample_mode="hooks"), max_steps=1).fit(Net(net), _data(_x(6)))


def test_a_weight_read_only_outside_its_layer_is_refused_whatever_its_scale() -> None:
    """Issue 43 item 2 (DeBERTa's rel_embeddings): no call of the layer, a gradient far below the others'."""

    class TableRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.table = nn.Linear(6, 3), nn.Embedding(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.body(x) + 1e-7 * self.table.weight.sum(0)  # the table is read, its layer never called

    assert_refused_before_any_update(Net(TableRead()), _data(_x(6)), RuntimeError, r"net\.table\.weight")
