"""Every torch.nn layer with parameters, and the Hugging Face, peft and Opacus layers we support.

Each case is one layer, called on a batch of N examples and followed by an in-place op
(as ``Conv2d -> ReLU(inplace=True)`` in VGG-style networks). Under every clipping engine
and both ``grad_sample_mode``\\ s, ``PerExampleHooks`` either refuses at construction with
a message naming the layer, or gives per-example gradients equal to a loop of
per-example backward passes; both with the parameters requiring gradient (the strategy's
verified steps) and with ``requires_grad`` turned off around the forward and backward (its
other steps). The table must name every ``torch.nn`` class: a new layer with parameters
fails :func:`test_the_table_covers_every_torch_nn_layer` until it is added here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch
import torch.nn.modules
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from dplightning.privacy.grad_sample import PerExampleHooks, available_engines

N = 4
Outcome = Literal["exact", "refused"]
Inputs = tuple[Any, ...]


def _rows(inputs: Inputs, i: int) -> Inputs:
    """Example ``i`` alone: row i of every input with N rows; the others are shared."""
    return tuple(x[i : i + 1] if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == N else x for x in inputs)


@dataclass(frozen=True)
class Case:
    """One layer, its batch, and what must happen under each ``grad_sample_mode``.

    Attributes:
        layer: Builds the layer (seeded).
        inputs: Builds the batch of N examples (seeded), positional inputs of ``call``.
        hooks: Outcome under ``grad_sample_mode="hooks"``.
        functorch: Outcome under ``grad_sample_mode="functorch"``.
        refusal: What the refusal must say besides the layer's name (a regex).
        call: How the layer is called on the inputs.
        example: Example i's inputs alone (for the per-example backward loop).
        prepare: Applied to the layer before the test (freezing, ``eval()``, a dry forward).
        named: The layer type the refusal names (default: the layer's own).
        inplace: Follow the layer by an in-place op (not where the layer's backward needs its output:
            plain autograd refuses that too).
    """

    layer: Callable[[], nn.Module]
    inputs: Callable[[], Inputs]
    hooks: Outcome = "exact"
    functorch: Outcome = "exact"
    refusal: str = ""
    call: Callable[[nn.Module, Inputs], Any] = lambda layer, inputs: layer(*inputs)
    example: Callable[[Inputs, int], Inputs] = _rows
    prepare: Callable[[nn.Module], None] = lambda layer: None
    named: str | None = None
    inplace: bool = True


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def x(*shape: int, seed: int = 0) -> Callable[[], Inputs]:
    return lambda: (torch.randn(N, *shape, generator=_gen(seed)),)


def ids(*shape: int, vocab: int = 7, seed: int = 1) -> Callable[[], Inputs]:
    return lambda: (torch.randint(0, vocab, (N, *shape), generator=_gen(seed)),)


def build(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = factory()
        for p in layer.parameters():  # away from initial values (ones, zeros) that hide a wrong formula
            if not isinstance(p, nn.parameter.UninitializedParameter):
                with torch.no_grad():
                    p.add_(0.3 * torch.randn(p.shape, generator=_gen(p.numel())))
        return layer

    return make


def materialize(inputs: Callable[[], Inputs]) -> Callable[[nn.Module], None]:
    """Materialize a lazy layer with one forward (after which it is its eager class)."""
    return lambda layer: layer(*inputs())


def freeze(*names: str) -> Callable[[nn.Module], None]:
    def prepare(layer: nn.Module) -> None:
        for n, p in layer.named_parameters():
            p.requires_grad_(not any(n.startswith(k) for k in names))

    return prepare


def only(*names: str) -> Callable[[nn.Module], None]:
    def prepare(layer: nn.Module) -> None:
        for n, p in layer.named_parameters():
            p.requires_grad_(any(n.startswith(k) for k in names))

    return prepare


def evaluating(layer: nn.Module) -> None:
    layer.eval()  # a trainable layer in eval(): PyTorch's transformer fast paths are eligible


# ------------------------------------------------------------------ call helpers


def _self_attention(layer: nn.Module, inputs: Inputs) -> Any:
    return layer(inputs[0], inputs[0], inputs[0])


def _attention_kwargs(**kwargs: Any) -> Callable[[nn.Module, Inputs], Any]:
    def call(layer: nn.Module, inputs: Inputs) -> Any:
        extra = {k: (inputs[v] if isinstance(v, int) else v) for k, v in kwargs.items()}
        return layer(inputs[0], inputs[0], inputs[0], **extra)

    return call


def _grouped_mask_example(inputs: Inputs, i: int) -> Inputs:
    x_, mask = inputs
    heads = mask.shape[0] // N
    return x_[i : i + 1], mask[i * heads : (i + 1) * heads]


def _bags(weighted: bool = False, last: bool = False) -> dict[str, Any]:
    """``inputs`` and ``example`` of 1-D ids with offsets (one bag empty), per-sample weights, include_last_offset."""
    flat = torch.tensor([1, 2, 4, 6, 6, 0, 3, 5, 2])
    offsets = torch.tensor([0, 3, 3, 6])  # the second bag is empty
    weights = torch.linspace(0.5, 2.0, len(flat))

    def inputs() -> Inputs:
        off = torch.cat([offsets, torch.tensor([len(flat)])]) if last else offsets
        return (flat, off, weights if weighted else None)

    def example(batch: Inputs, i: int) -> Inputs:
        ends = [*offsets.tolist(), len(flat)]
        lo, hi = ends[i], ends[i + 1]
        off = torch.tensor([0, hi - lo]) if last else torch.tensor([0])
        return (flat[lo:hi], off, weights[lo:hi] if weighted else None)

    return {"inputs": inputs, "example": example, "call": _bag_call}


def _bag_call(layer: nn.Module, inputs: Inputs) -> Any:
    flat, offsets, weights = inputs
    return layer(flat, offsets, per_sample_weights=weights)


def _two(first: tuple[int, ...], second: tuple[int, ...]) -> Callable[[], Inputs]:
    return lambda: (torch.randn(N, *first, generator=_gen(2)), torch.randn(N, *second, generator=_gen(3)))


def _targets_call(layer: nn.Module, inputs: Inputs) -> Any:
    return layer(inputs[0], inputs[1])


def _xy(features: int, classes: int) -> Callable[[], Inputs]:
    return lambda: (torch.randn(N, features, generator=_gen(4)), torch.arange(N) % classes)


# ------------------------------------------------------------------ the table

NO_SAMPLER = r"No per-example gradient sampler"
MIXING = r"mix the examples"
RECURRENT = r"DPLSTM/DPGRU/DPRNN"
SEQUENCE_FIRST = r"batch_first=False"
UNINITIALIZED = r"not initialized"
MAX_NORM = r"max_norm"
D = 8  # model width of the attention cases

_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _convs(cls: type[nn.Module], shape: tuple[int, ...]) -> list[Case]:
    dims = len(shape) - 1
    cases = [
        Case(build(lambda mode=mode: cls(2, 4, 3, padding=1, padding_mode=mode)), x(*shape)) for mode in _PADDING_MODES
    ]
    even = (2,) + (3,) * (dims - 1)  # an even kernel: 'same' pads unevenly
    cases += [
        Case(build(lambda: cls(2, 4, even, padding="same", dilation=2)), x(*shape)),
        Case(build(lambda: cls(2, 4, even, padding="same", padding_mode="reflect")), x(*shape)),
        Case(build(lambda: cls(2, 4, 3, stride=2, dilation=2, padding="valid", bias=False)), x(*shape)),
        Case(build(lambda: cls(4, 6, 3, groups=2, padding=2, stride=2, padding_mode="circular")), x(4, *shape[1:])),
    ]
    return cases


def _conv_transposes(cls: type[nn.Module], shape: tuple[int, ...]) -> list[Case]:
    return [
        Case(build(lambda: cls(2, 4, 3, stride=2, padding=1, output_padding=1)), x(*shape), hooks="refused",
             refusal=NO_SAMPLER),
        Case(build(lambda: cls(4, 6, 2, groups=2, dilation=2, bias=False)), x(4, *shape[1:]), hooks="refused",
             refusal=NO_SAMPLER),
    ]  # fmt: skip


def _lazy(factory: Callable[[], nn.Module], inputs: Callable[[], Inputs], **kwargs: Any) -> list[Case]:
    """The layer once materialized (its eager class), and refused before."""
    return [
        Case(build(factory), inputs, prepare=materialize(inputs), **kwargs),
        Case(build(factory), inputs, hooks="refused", functorch="refused", refusal=UNINITIALIZED),
    ]


def _norm(cls: type[nn.Module], channels: int, shape: tuple[int, ...]) -> list[Case]:
    return [
        Case(build(lambda: cls(channels, affine=True)), x(*shape)),
        Case(build(lambda: cls(channels, affine=True, track_running_stats=True)), x(*shape), hooks="refused",
             functorch="refused", refusal=MIXING),
    ]  # fmt: skip


def _batch_norm(cls: type[nn.Module], *args: Any) -> list[Case]:
    return [Case(build(lambda: cls(*args)), x(3), hooks="refused", functorch="refused", refusal=MIXING)]


def _recurrent(cls: type[nn.Module], inputs: Callable[[], Inputs], **kwargs: Any) -> list[Case]:
    return [Case(build(lambda: cls(3, 4, **kwargs)), inputs, hooks="refused", functorch="refused", refusal=RECURRENT)]


def _mha(**kwargs: Any) -> Callable[[], nn.Module]:
    return build(lambda: nn.MultiheadAttention(D, 2, batch_first=True, **kwargs))


def _encoder_layer(**kwargs: Any) -> Callable[[], nn.Module]:
    return build(lambda: nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True, **kwargs))


def _decoder_layer(**kwargs: Any) -> Callable[[], nn.Module]:
    return build(lambda: nn.TransformerDecoderLayer(D, 2, 16, dropout=0.0, batch_first=True, **kwargs))


_ATTENTION_MODULES = dict(hooks="refused", refusal=NO_SAMPLER, named="MultiheadAttention")
"""Transformer layers: their attention needs torch.func; the rest is exact under it."""

TABLE: dict[type[nn.Module], list[Case]] = {
    nn.Linear: [
        Case(build(lambda: nn.Linear(5, 3)), x(5)),
        Case(build(lambda: nn.Linear(5, 3)), x(2, 5)),  # its output is a view of the [n·T, 3] product
        Case(build(lambda: nn.Linear(5, 3, bias=False)), x(2, 5)),
    ],
    nn.modules.linear.NonDynamicallyQuantizableLinear: [
        Case(build(lambda: nn.modules.linear.NonDynamicallyQuantizableLinear(5, 3)), x(5))
    ],
    nn.LazyLinear: _lazy(lambda: nn.LazyLinear(3), x(5)),
    nn.Bilinear: [
        Case(build(lambda: nn.Bilinear(3, 4, 2)), _two((3,), (4,))),
        Case(build(lambda: nn.Bilinear(3, 4, 2, bias=False)), _two((2, 3), (2, 4))),
    ],
    nn.Conv1d: _convs(nn.Conv1d, (2, 9)),
    nn.Conv2d: _convs(nn.Conv2d, (2, 6, 7)),
    nn.Conv3d: _convs(nn.Conv3d, (2, 5, 5, 6)),
    nn.ConvTranspose1d: _conv_transposes(nn.ConvTranspose1d, (2, 5)),
    nn.ConvTranspose2d: _conv_transposes(nn.ConvTranspose2d, (2, 4, 3)),
    nn.ConvTranspose3d: _conv_transposes(nn.ConvTranspose3d, (2, 3, 3, 2)),
    nn.LazyConv1d: _lazy(lambda: nn.LazyConv1d(3, 3, padding=1, padding_mode="reflect"), x(2, 6)),
    nn.LazyConv2d: _lazy(lambda: nn.LazyConv2d(3, 3, padding="same", padding_mode="circular"), x(2, 5, 5)),
    nn.LazyConv3d: _lazy(lambda: nn.LazyConv3d(3, 2), x(2, 3, 3, 3)),
    nn.LazyConvTranspose1d: _lazy(lambda: nn.LazyConvTranspose1d(3, 3), x(2, 4),
                                  hooks="refused", refusal=NO_SAMPLER),
    nn.LazyConvTranspose2d: _lazy(lambda: nn.LazyConvTranspose2d(3, 2), x(2, 3, 3),
                                  hooks="refused", refusal=NO_SAMPLER),
    nn.LazyConvTranspose3d: _lazy(lambda: nn.LazyConvTranspose3d(3, 2), x(2, 2, 2, 2),
                                  hooks="refused", refusal=NO_SAMPLER),
    nn.Embedding: [
        Case(build(lambda: nn.Embedding(7, 3)), ids(5)),
        Case(build(lambda: nn.Embedding(7, 3, padding_idx=2)), ids(5)),
        Case(build(lambda: nn.Embedding(7, 3, max_norm=1.0)), ids(5), hooks="refused", functorch="refused",
             refusal=MAX_NORM),
    ],
    nn.EmbeddingBag: [
        *(Case(build(lambda mode=mode: nn.EmbeddingBag(7, 3, mode=mode)), ids(5)) for mode in ("sum", "mean", "max")),
        Case(build(lambda: nn.EmbeddingBag(7, 3, mode="mean", padding_idx=2)), ids(6)),
        Case(build(lambda: nn.EmbeddingBag(7, 3, mode="sum")), lambda: (*ids(5)(), torch.rand(N, 5, generator=_gen(5))),
             call=lambda layer, inputs: layer(inputs[0], per_sample_weights=inputs[1])),
        *(Case(build(lambda mode=mode: nn.EmbeddingBag(7, 3, mode=mode)), **_bags())
          for mode in ("sum", "mean", "max")),
        Case(build(lambda: nn.EmbeddingBag(7, 3, mode="sum")), **_bags(weighted=True)),
        Case(build(lambda: nn.EmbeddingBag(7, 3, mode="max", include_last_offset=True)), **_bags(last=True)),
        Case(build(lambda: nn.EmbeddingBag(7, 3, max_norm=1.0)), ids(5), hooks="refused", functorch="refused",
             refusal=MAX_NORM),
    ],
    nn.LayerNorm: [
        Case(build(lambda: nn.LayerNorm(5)), x(3, 5)),
        Case(build(lambda: nn.LayerNorm(5, bias=False)), x(3, 5)),
        Case(build(lambda: nn.LayerNorm((3, 5), bias=False)), x(3, 5)),
    ],
    nn.GroupNorm: [Case(build(lambda: nn.GroupNorm(2, 4)), x(4, 5)),
                   Case(build(lambda: nn.GroupNorm(1, 4)), x(4, 2, 3))],
    nn.RMSNorm: [Case(build(lambda: nn.RMSNorm(5)), x(3, 5)),
                 Case(build(lambda: nn.RMSNorm((3, 5), eps=1e-3)), x(3, 5))],
    nn.BatchNorm1d: _batch_norm(nn.BatchNorm1d, 3),
    nn.BatchNorm2d: _batch_norm(nn.BatchNorm2d, 3),
    nn.BatchNorm3d: _batch_norm(nn.BatchNorm3d, 3),
    nn.SyncBatchNorm: _batch_norm(nn.SyncBatchNorm, 3),
    nn.LazyBatchNorm1d: _batch_norm(nn.LazyBatchNorm1d),
    nn.LazyBatchNorm2d: _batch_norm(nn.LazyBatchNorm2d),
    nn.LazyBatchNorm3d: _batch_norm(nn.LazyBatchNorm3d),
    nn.InstanceNorm1d: _norm(nn.InstanceNorm1d, 3, (3, 5)),
    nn.InstanceNorm2d: _norm(nn.InstanceNorm2d, 3, (3, 4, 4)),
    nn.InstanceNorm3d: _norm(nn.InstanceNorm3d, 3, (3, 3, 3, 3)),
    nn.LazyInstanceNorm1d: _lazy(lambda: nn.LazyInstanceNorm1d(affine=True, track_running_stats=False), x(3, 5)),
    nn.LazyInstanceNorm2d: _lazy(lambda: nn.LazyInstanceNorm2d(affine=True, track_running_stats=False), x(3, 4, 4)),
    nn.LazyInstanceNorm3d: _lazy(lambda: nn.LazyInstanceNorm3d(affine=True, track_running_stats=False), x(3, 3, 3, 3)),
    nn.PReLU: [Case(build(lambda: nn.PReLU()), x(3, 5)), Case(build(lambda: nn.PReLU(3)), x(3, 5))],
    nn.RNN: _recurrent(nn.RNN, x(5, 3), batch_first=True),
    nn.LSTM: _recurrent(nn.LSTM, x(5, 3), batch_first=True),
    nn.GRU: _recurrent(nn.GRU, x(5, 3), batch_first=True, num_layers=2),
    nn.RNNCell: _recurrent(nn.RNNCell, x(3)),
    nn.LSTMCell: _recurrent(nn.LSTMCell, x(3)),
    nn.GRUCell: _recurrent(nn.GRUCell, x(3)),
    nn.RNNBase: [Case(build(lambda: nn.RNNBase("LSTM", 3, 4, batch_first=True)), x(5, 3), hooks="refused",
                      functorch="refused", refusal=RECURRENT)],  # fmt: skip
    nn.MultiheadAttention: [
        Case(_mha(), x(3, D), call=_self_attention, hooks="refused", refusal=NO_SAMPLER),
        Case(_mha(kdim=5, vdim=6, add_bias_kv=True), lambda: (*x(3, D)(), *_two((4, 5), (4, 6))()),
             call=lambda layer, inputs: layer(*inputs), hooks="refused", refusal=NO_SAMPLER),
        Case(_mha(), lambda: (*x(3, D)(), torch.arange(3).repeat(N, 1) >= torch.tensor([[3], [2], [3], [1]])),
             call=_attention_kwargs(key_padding_mask=1), hooks="refused", refusal=NO_SAMPLER),
        Case(_mha(), x(N, D), call=_attention_kwargs(attn_mask=torch.triu(torch.ones(N, N, dtype=torch.bool), 1)),
             hooks="refused", refusal=NO_SAMPLER),  # a [T, T] mask with T = N is still shared by the batch
        Case(_mha(), lambda: (*x(3, D)(), torch.randn(N * 2, 3, 3, generator=_gen(6))),
             call=_attention_kwargs(attn_mask=1), example=_grouped_mask_example, hooks="refused",
             refusal=NO_SAMPLER),  # [n·heads, T, S]: each example's own heads
        Case(_mha(), x(3, D), call=_self_attention, prepare=only("out_proj"), hooks="refused", refusal=NO_SAMPLER),
        Case(_mha(), x(3, D), call=_self_attention, prepare=evaluating, hooks="refused", refusal=NO_SAMPLER),
        Case(build(lambda: nn.MultiheadAttention(D, 2)), x(3, D), call=_self_attention, hooks="refused",
             functorch="refused", refusal=SEQUENCE_FIRST),
    ],
    nn.TransformerEncoderLayer: [
        Case(_encoder_layer(), x(3, D), **_ATTENTION_MODULES),
        Case(_encoder_layer(norm_first=True, activation="gelu"), x(3, D), **_ATTENTION_MODULES),
        Case(_encoder_layer(), x(3, D), prepare=evaluating, **_ATTENTION_MODULES),
        Case(_encoder_layer(), x(3, D), prepare=lambda m: (freeze("self_attn")(m), m.eval())),  # the fast path
        Case(build(lambda: nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0)), x(3, D), hooks="refused",
             functorch="refused", refusal=SEQUENCE_FIRST),
    ],
    nn.TransformerEncoder: [
        Case(build(lambda: nn.TransformerEncoder(_encoder_layer()(), 2, norm=nn.LayerNorm(D),
                                                 enable_nested_tensor=False)), x(3, D), **_ATTENTION_MODULES),
        Case(build(lambda: nn.TransformerEncoder(_encoder_layer()(), 2)),
             lambda: (*x(3, D)(), torch.arange(3).repeat(N, 1) >= torch.tensor([[3], [2], [3], [1]])),
             call=lambda layer, inputs: layer(inputs[0], src_key_padding_mask=inputs[1]),
             prepare=evaluating, **_ATTENTION_MODULES),  # eval with a padding mask: the nested-tensor path
    ],
    nn.TransformerDecoderLayer: [
        Case(_decoder_layer(), _two((3, D), (4, D)), **_ATTENTION_MODULES),
        Case(_decoder_layer(norm_first=True), _two((3, D), (4, D)), prepare=evaluating, **_ATTENTION_MODULES),
    ],
    nn.TransformerDecoder: [
        Case(build(lambda: nn.TransformerDecoder(_decoder_layer()(), 2, norm=nn.LayerNorm(D))), _two((3, D), (4, D)),
             call=lambda layer, inputs: layer(*inputs, tgt_is_causal=True,
                                              tgt_mask=nn.Transformer.generate_square_subsequent_mask(3)),
             **_ATTENTION_MODULES),
    ],
    nn.Transformer: [
        Case(build(lambda: nn.Transformer(D, 2, 1, 1, 16, dropout=0.0, batch_first=True)), _two((4, D), (3, D)),
             **_ATTENTION_MODULES),
        Case(build(lambda: nn.Transformer(D, 2, 1, 1, 16, dropout=0.0)), _two((4, D), (3, D)), hooks="refused",
             functorch="refused", refusal=SEQUENCE_FIRST),
    ],
    nn.AdaptiveLogSoftmaxWithLoss: [
        Case(build(lambda: nn.AdaptiveLogSoftmaxWithLoss(5, 6, [2, 4])), _xy(5, 6), call=_targets_call,
             hooks="refused", functorch="refused", refusal="subset of the batch"),
    ],
}  # fmt: skip

if hasattr(nn, "LinearCrossEntropyLoss"):
    TABLE[nn.LinearCrossEntropyLoss] = [
        Case(build(lambda: nn.LinearCrossEntropyLoss(5, 3, bias=True, reduction="none")), _xy(5, 3),
             call=_targets_call, hooks="refused", refusal=NO_SAMPLER),
        Case(build(lambda: nn.LinearCrossEntropyLoss(5, 3)), _xy(5, 3), call=_targets_call, hooks="refused",
             functorch="refused", refusal="reduces over the batch"),
    ]  # fmt: skip

NOT_LAYERS = {
    "Module", "Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict",
    "DataParallel", "RNNCellBase",  # RNNCellBase has no forward; its subclasses are in the table
}  # fmt: skip
"""Containers and abstract bases: no forward of their own to differentiate."""

PARAMETER_FREE: dict[str, tuple[Any, ...]] = {
    **{name: () for name in (
        "AlphaDropout", "BCELoss", "BCEWithLogitsLoss", "CELU", "CTCLoss", "CosineEmbeddingLoss", "CosineSimilarity",
        "CrossEntropyLoss", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "ELU", "FeatureAlphaDropout", "Flatten",
        "GELU", "GLU", "GaussianNLLLoss", "Hardshrink", "Hardsigmoid", "Hardswish", "Hardtanh", "HingeEmbeddingLoss",
        "HuberLoss", "Identity", "KLDivLoss", "L1Loss", "LeakyReLU", "LogSigmoid", "LogSoftmax", "MSELoss",
        "MarginRankingLoss", "Mish", "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss", "NLLLoss",
        "NLLLoss2d", "PairwiseDistance", "PoissonNLLLoss", "RReLU", "ReLU", "ReLU6", "SELU", "SiLU", "Sigmoid",
        "SmoothL1Loss", "SoftMarginLoss", "Softmax", "Softmax2d", "Softmin", "Softplus", "Softshrink", "Softsign",
        "Tanh", "Tanhshrink", "TripletMarginLoss", "TripletMarginWithDistanceLoss", "Upsample",
        "UpsamplingBilinear2d", "UpsamplingNearest2d")},
    **{f"{kind}{d}d": (2,) for kind in ("AdaptiveAvgPool", "AdaptiveMaxPool", "AvgPool", "MaxPool", "MaxUnpool")
       for d in (1, 2, 3)},
    **{f"{kind}{d}d": (2, 2) for kind in ("LPPool",) for d in (1, 2, 3)},
    **{f"{kind}{d}d": (1,) for kind in ("CircularPad", "ReflectionPad", "ReplicationPad", "ZeroPad")
       for d in (1, 2, 3)},
    **{f"ConstantPad{d}d": (1, 0.0) for d in (1, 2, 3)},
    "FractionalMaxPool2d": (2, 2), "FractionalMaxPool3d": (2, 2), "ChannelShuffle": (2,), "PixelShuffle": (2,),
    "PixelUnshuffle": (2,), "Fold": (4, 2), "Unfold": (2,), "Unflatten": (1, (2, 2)), "Threshold": (0.1, 0.0),
    "LocalResponseNorm": (2,), "CrossMapLRN2d": (2,),
}  # fmt: skip


def _torch_nn_layers() -> dict[str, type[nn.Module]]:
    """Every public ``nn.Module`` class of ``torch.nn`` and its ``torch.nn.modules`` submodules."""
    found = {n: c for n, c in vars(nn).items() if inspect.isclass(c) and issubclass(c, nn.Module)}
    for info in pkgutil.iter_modules(torch.nn.modules.__path__):
        module = importlib.import_module(f"torch.nn.modules.{info.name}")
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, nn.Module) and not name.startswith("_"):
                found[cls.__name__] = cls
    return found


def test_the_table_covers_every_torch_nn_layer() -> None:
    layers = _torch_nn_layers()
    tabled = {cls.__name__ for cls in TABLE}
    unknown = sorted(set(layers) - tabled - set(PARAMETER_FREE) - NOT_LAYERS)
    assert not unknown, f"torch.nn layers in no table of {__name__}: {unknown} (add their cases)"
    assert not (tabled & set(PARAMETER_FREE)), "a layer is listed both as parametrized and as parameter-free"
    for name, args in PARAMETER_FREE.items():
        if name in layers:
            assert not list(layers[name](*args).parameters()), f"{name} has parameters: move it to TABLE"
    for cls, cases in TABLE.items():
        assert cases and all(list(c.layer().parameters()) for c in cases), cls.__name__


# ------------------------------------------------------------------ Hugging Face, peft, Opacus


def _hf_rms_norm(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        module = importlib.import_module(f"transformers.models.{name.lower()}.modeling_{name.lower()}")
        return getattr(module, f"{name}RMSNorm")(5, eps=1e-5)

    return build(make)


def _hf_conv1d() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(4, 5)


def _vit_embeddings() -> nn.Module:
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTEmbeddings

    config = ViTConfig(image_size=8, patch_size=4, num_channels=2, hidden_size=6, hidden_dropout_prob=0.0)
    return ViTEmbeddings(config)


def _opt_positions() -> nn.Module:
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    return OPTLearnedPositionalEmbedding(10, 3)


def _lora_linear() -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(5, 4)

        def forward(self, x_: Tensor) -> Tensor:
            return self.proj(x_)

    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["proj"]), Wrapped())
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def _opacus(name: str, *args: Any, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import opacus.layers.dp_rnn as dp_rnn
        from opacus.layers import DPMultiheadAttention

        cls = DPMultiheadAttention if name == "DPMultiheadAttention" else getattr(dp_rnn, name)
        return cls(*args, **kwargs)

    return build(make)


def _first_output(layer: nn.Module, inputs: Inputs) -> Any:
    return layer(*inputs)[0]


OTHER_LAYERS: dict[str, list[Case]] = {
    "transformers Conv1D": [Case(build(_hf_conv1d), x(3, 5))],
    "transformers ViTEmbeddings": [Case(build(_vit_embeddings), x(2, 8, 8))],
    "transformers OPTLearnedPositionalEmbedding": [
        Case(build(_opt_positions), lambda: (torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0]]),))
    ],
    **{f"transformers {name}RMSNorm": [Case(_hf_rms_norm(name), x(3, 5))]
       for name in ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Phi3")},
    "peft LoRA Linear": [Case(build(_lora_linear), x(3, 5))],
    "opacus DPLSTM": [Case(_opacus("DPLSTM", 3, 4, batch_first=True), x(5, 3), call=_first_output)],
    "opacus DPGRU": [Case(_opacus("DPGRU", 3, 4, batch_first=True, num_layers=2), x(5, 3), call=_first_output)],
    "opacus DPRNN": [Case(_opacus("DPRNN", 3, 4, batch_first=True, bidirectional=True), x(5, 3), call=_first_output)],
    "opacus DPLSTMCell": [Case(_opacus("DPLSTMCell", 3, 4, bias=True), x(3), call=_first_output)],
    "opacus DPGRUCell": [Case(_opacus("DPGRUCell", 3, 4, bias=True), x(3))],
    "opacus DPRNNCell": [Case(_opacus("DPRNNCell", 3, 4, bias=True), x(3), inplace=False)],  # tanh saves its output
    "opacus DPMultiheadAttention": [
        Case(_opacus("DPMultiheadAttention", D, 2, batch_first=True), x(3, D), call=_self_attention)
    ],
}  # fmt: skip

CASES = {f"{cls.__name__}-{i}": case for cls, cases in TABLE.items() for i, case in enumerate(cases)} | {
    f"{name}-{i}": case for name, cases in OTHER_LAYERS.items() for i, case in enumerate(cases)
}


# ------------------------------------------------------------------ the check


class Probe(nn.Module):
    """The layer under test, then an in-place op on its output (ReLU(inplace=True)-style)."""

    def __init__(self, layer: nn.Module, case: Case) -> None:
        super().__init__()
        self.layer = layer
        self.case = case

    def forward(self, *inputs: Any) -> Tensor:
        outputs, _ = tree_flatten(self.case.call(self.layer, inputs))
        out = next(t for t in outputs if isinstance(t, Tensor) and t.is_floating_point())
        return out.mul_(1.5) if self.case.inplace else out * 1.5


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return 0.5 * (out.reshape(out.shape[0], -1) - target).square().sum()


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _per_example_loop(model: Probe, case: Case, inputs: Inputs, target: Tensor) -> dict[str, Tensor]:
    """The reference: one forward and backward pass per example."""
    params = _trainable(model)
    grads: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(N):
        one = torch.autograd.grad(_loss(model(*case.example(inputs, i)), target[i : i + 1]), list(params.values()),
                                  allow_unused=True)  # fmt: skip
        for n, p, g in zip(params, params.values(), one):
            grads[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(g) for n, g in grads.items()}


def _hooked(model: Probe, hooks: PerExampleHooks, inputs: Inputs, target: Tensor, suspended: bool) -> dict[str, Tensor]:
    params = _trainable(model)
    if suspended:  # what the strategy does outside its verified steps
        for p in params.values():
            p.requires_grad_(False)
    try:
        with hooks.capture(N):  # the strategy's batch: each layer's rows are checked against it
            loss = _loss(model(*inputs), target)
        loss.backward()
    finally:
        for p in params.values():
            p.requires_grad_(True)
    names = {p: n for n, p in params.items()}
    grads = {names[p]: g.instantiate() for p, g in hooks.pop().items()}
    for p in params.values():
        p.grad = None
    return grads


def _setup(case: Case) -> tuple[Probe, Inputs, Tensor]:
    layer = case.layer()
    case.prepare(layer)
    model = Probe(layer, case)
    inputs = case.inputs()
    with torch.no_grad():
        target = torch.randn(model(*inputs).reshape(N, -1).shape, generator=_gen(9))
    return model, inputs, target


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("engine", available_engines())
@pytest.mark.parametrize("name", list(CASES))
def test_every_layer_is_exact_or_refused_at_setup(name: str, engine: str, mode: Literal["hooks", "functorch"]) -> None:
    case = CASES[name]
    if getattr(case, mode) == "refused":
        layer = case.layer()
        case.prepare(layer)
        model = Probe(layer, case)
        with pytest.raises((ValueError, NotImplementedError)) as refused:
            PerExampleHooks(
                model, list(_trainable(model).values()), engine=engine, functorch_fallback=mode == "functorch"
            )
        message = str(refused.value)
        assert re.search(r"\blayer\b", message) and (case.named or type(layer).__name__) in message, message
        assert refused.match(case.refusal)
        return
    model, inputs, target = _setup(case)
    params = list(_trainable(model).values())
    reference = _per_example_loop(model, case, inputs, target)
    hooks = PerExampleHooks(model, params, engine=engine, functorch_fallback=mode == "functorch")
    try:
        for suspended in (False, True):
            got = _hooked(model, hooks, inputs, target, suspended)
            assert set(got) == set(reference), f"suspended={suspended}: {sorted(set(reference) ^ set(got))}"
            for n, value in reference.items():
                scale = max(1.0, float(value.abs().max()))  # sums over many positions: fp32 error grows with them
                where = f"{n}, suspended={suspended}"
                torch.testing.assert_close(
                    got[n], value, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, w=where: f"{w}: {m}"
                )
    finally:
        hooks.close()


def _empty(inputs: Inputs) -> Inputs:
    """The batch cut to zero examples (Poisson sampling draws empty batches); shared inputs kept."""
    return tuple(x[:0] if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == N else x for x in inputs)


@pytest.mark.parametrize("engine", available_engines())
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.hooks == "exact" and c.example is _rows])
def test_every_layer_takes_an_empty_batch(name: str, engine: str) -> None:
    """Zero examples in, zero-row per-example gradients out, under every engine (finding 48.N3's class).

    Over the cases whose examples are rows of their inputs (the others, e.g. EmbeddingBag's
    flat ids with offsets, have no row to cut; torch crashes on some of them when empty).
    """
    case = CASES[name]
    layer = case.layer()
    case.prepare(layer)
    model = Probe(layer, case)
    empty = _empty(case.inputs())
    try:  # the layer alone, unhooked: if torch cannot run it on zero rows, there is nothing to hook
        model(*empty).sum().backward()
    except (RuntimeError, ValueError, IndexError) as err:
        pytest.skip(f"torch itself cannot run {name} on an empty batch: {err}")
    model.zero_grad(set_to_none=True)
    params = list(_trainable(model).values())
    hooks = PerExampleHooks(model, params, engine=engine)
    try:
        for p in params:
            p.requires_grad_(False)  # the strategy's steps outside verification
        try:
            with hooks.capture(0):
                out = model(*empty)
            if out.requires_grad:
                out.square().sum().backward()
        finally:
            for p in params:
                p.requires_grad_(True)
        for p, g in hooks.pop().items():
            assert g.rows == 0 and tuple(g.instantiate().shape) == (0, *p.shape), name
    finally:
        hooks.close()
