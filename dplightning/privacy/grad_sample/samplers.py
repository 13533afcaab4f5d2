"""Per-layer samplers: one layer call's inputs and output gradients -> per-example gradients.

Opacus' registered samplers (``GradSampleHooks.GRAD_SAMPLERS``) do the per-layer math for
the layers they cover. Written here, because Opacus' do not give what the autograd
gradient is:

* ``nn.Embedding`` with ``padding_idx``: autograd leaves the padding row's gradient at
  zero; Opacus' sampler gives it the padding tokens' backprops.
* ``nn.Conv1d/2d/3d``: Opacus' sampler pads with zeros whatever the layer's
  ``padding_mode`` (reflect, replicate, circular: 5-50 % off). Ours pads as the layer does.
* ``nn.LayerNorm(bias=False)``: Opacus' sampler reads the missing bias and fails.
* ``nn.EmbeddingBag``: Opacus' sampler takes only 1-D ids with offsets and ignores
  ``mode="max"``, ``per_sample_weights`` and ``padding_idx``. Ours differentiates each bag
  through its own copy of the table, in every mode.
* ``nn.Bilinear`` and ``nn.PReLU``: Opacus has no sampler; each is one contraction.
* Hugging Face's ``Conv1D`` (GPT-2's linear layer) and ``ViTEmbeddings`` ([CLS] token and
  position embeddings, owned by the module itself): Opacus has no sampler.
* The ``torch.func`` fallback: Opacus' re-runs a layer with its first input only, so a
  layer taking a second input (a key and a value, an attention mask, an int offset)
  fails or is differentiated at the wrong point. Ours replays the whole call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleHooks
from opacus.utils.tensor_utils import sum_over_all_but_batch_and_last_n, unfold3d
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from dplightning._state import known
from dplightning.privacy.grad_sample.grads import as_tokens


@dataclass
class LayerCall:
    """One captured forward call of a hooked layer.

    Attributes:
        args: Positional inputs (tensors detached).
        kwargs: Keyword inputs (tensors detached).
        output_slots: Positions, in the flattened output, of the tensors whose gradient is taken.
        autocast: ``(device_type, dtype)`` of the autocast region the call ran in, if any.
        fold: Rows per example when the layer saw its batch flattened batch-major
            (``[n·m, ...]`` from ``[n, m, ...]``); 1 otherwise.
        examples: The number of examples when it is not the first input's leading
            dimension (an ``nn.EmbeddingBag`` given 1-D ids and offsets: its bags).
        fingerprint: Per-example sums of the output gradients of the call's first backward
            pass, when a replay of that pass is to be checked against it.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    output_slots: list[int] = field(default_factory=lambda: [0])
    autocast: tuple[str, torch.dtype] | None = None
    fold: int = 1
    examples: int | None = None
    fingerprint: list[Tensor] | None = None

    def folded(self) -> LayerCall:
        """The call with every ``[n·m, ...]`` input viewed as ``[n, m, ...]``."""
        flat_rows = self.rows
        n = flat_rows // self.fold

        def fold(value: Any) -> Any:
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == flat_rows:
                return value.reshape(n, self.fold, *value.shape[1:])
            return value

        return LayerCall(
            args=tuple(fold(a) for a in self.args),
            kwargs={k: fold(v) for k, v in self.kwargs.items()},
            output_slots=self.output_slots,
            autocast=self.autocast,
        )

    @property
    def activations(self) -> list[Any]:
        """Positional inputs, the form Opacus' samplers take."""
        return list(self.args)

    @property
    def rows(self) -> int:
        """The examples of the call: :attr:`examples`, else the first tensor input's leading dimension."""
        if self.examples is not None:
            return self.examples
        first = next((a for a in self.args if isinstance(a, Tensor)), None)
        return first.shape[0] if first is not None and first.dim() > 0 else 0


def example_rows(layer: nn.Module, call: LayerCall) -> int | None:
    """The examples of a call whose first input does not have one row per example, else ``None``.

    An ``nn.EmbeddingBag`` given 1-D ids and offsets sees one bag per example.
    """
    if not isinstance(layer, nn.EmbeddingBag) or type(layer).forward is not nn.EmbeddingBag.forward:
        return None
    ids, offsets = _call_arg(call, 0, ("input",)), _call_arg(call, 1, ("offsets",))
    if not isinstance(ids, Tensor) or ids.dim() != 1 or not isinstance(offsets, Tensor):
        return None
    return offsets.shape[0] - int(layer.include_last_offset)


GradSampler = Callable[[nn.Module, LayerCall, list["Tensor | None"]], dict[nn.Parameter, Tensor]]
"""``(layer, call, output_grads) -> {parameter: [n, *p.shape]}`` for one call of a layer."""

OpacusSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]

# The samplers below read their layer's attributes by name (weight, bias, padding_idx, ...). They take it as
# ``Any``: ``nn.Module.__getattr__`` types every attribute as ``Tensor | Module``, torch types most weights
# as ``Tensor`` (not ``Parameter``), and the Hugging Face layers are matched by name, never imported.


def _opacus(sampler: OpacusSampler) -> GradSampler:
    def run(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
        return sampler(layer, call.activations, grads[0])  # type: ignore[arg-type]

    return run


def _embedding(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    opacus_embedding = GradSampleHooks.GRAD_SAMPLERS[nn.Embedding]
    out = opacus_embedding(layer, call.activations, grads[0])
    if layer.padding_idx is not None and layer.weight in out:
        out[layer.weight][:, layer.padding_idx] = 0  # autograd gives the padding row no gradient
    return out


def _hf_conv1d(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # Conv1D computes y = x @ W + b with W stored [in, out] (transposed with respect to nn.Linear).
    a, b = call.args[0], known(grads[0], "the layer's output gradient")
    a3 = as_tokens(a)
    b3 = as_tokens(b).to(a3.dtype)
    out: dict[nn.Parameter, Tensor] = {}
    if layer.weight.requires_grad:
        out[layer.weight] = torch.einsum("nti,nto->nio", a3, b3)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = b3.sum(dim=1)
    return out


def _hf_vit_embeddings(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # ViTEmbeddings owns the [CLS] token and the position embeddings directly (its patch projection is
    # a Conv2d child with its own hook): out = dropout(cat(cls, patches) + position_embeddings).
    interpolate = call.kwargs.get("interpolate_pos_encoding", call.args[2] if len(call.args) > 2 else False)
    masked = call.kwargs.get("bool_masked_pos", call.args[1] if len(call.args) > 1 else None)
    if interpolate or masked is not None or (layer.training and layer.dropout.p > 0):
        raise RuntimeError(
            "Per-example gradients of ViTEmbeddings' [CLS] token and position embeddings are taken from the "
            "gradient of its output, which is exact without interpolate_pos_encoding, bool_masked_pos or "
            "embedding dropout: set hidden_dropout_prob=0 (the embeddings' dropout) or freeze them."
        )
    grad = known(grads[0], "the layer's output gradient")
    out: dict[nn.Parameter, Tensor] = {}
    if layer.cls_token.requires_grad:
        out[layer.cls_token] = grad[:, :1].unsqueeze(1)
    if layer.position_embeddings.requires_grad:
        out[layer.position_embeddings] = grad.unsqueeze(1)
    return out


def _call_arg(call: LayerCall, index: int, names: tuple[str, ...], default: Any = None) -> Any:
    """Argument ``index`` of the call, passed positionally or under one of ``names`` (renamed across versions)."""
    for name in names:
        if name in call.kwargs:
            return call.kwargs[name]
    return call.args[index] if len(call.args) > index else default


def _hf_opt_positions(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # OPT's learned positions take the attention mask, not ids (Opacus fails on them): the ids
    # are recomputed exactly as OPTLearnedPositionalEmbedding.forward does, then looked up per example.
    mask = _call_arg(call, 0, ("attention_mask",))
    cache = int(_call_arg(call, 1, ("cache_length", "past_key_values_length"), 0) or 0)
    positions = _call_arg(call, 2, ("position_ids",))
    if positions is None:
        positions = ((torch.cumsum(mask, dim=1) * mask - 1).long())[:, cache:]
    if positions.shape[0] != call.rows:
        positions = positions.expand(call.rows, *positions.shape[1:])
    opacus_embedding = GradSampleHooks.GRAD_SAMPLERS[nn.Embedding]
    return opacus_embedding(layer, [positions + layer.offset], grads[0])


def _hf_rms_norm(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # y = w * (x / rms(x)), normalised in fp32 and cast back, as LlamaRMSNorm (and its copies) compute it.
    x, grad = call.args[0], known(grads[0], "the layer's output gradient")
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)).to(x.dtype)
    per_token = (grad * normed).float()
    return {layer.weight: as_tokens(per_token).sum(1)}


def conv_columns(layer: Any, x: Tensor) -> Tensor:
    """``[n, C·k, P]``: the input patches each kernel position sees, padded as the layer pads.

    The layer's padding (any ``padding_mode``, ``padding="same"`` with its uneven split) is
    applied first, exactly as ``_ConvNd.forward`` does, then the patches are unfolded
    without padding.
    """
    pads = layer._reversed_padding_repeated_twice
    if any(pads):
        x = F.pad(x, pads, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode)
    if isinstance(layer, nn.Conv3d):
        # Opacus' unfold3d cannot reshape zero rows: unfold one zero example for the shape instead.
        rows = x if x.shape[0] else x.new_zeros(1, *x.shape[1:])
        cols = unfold3d(rows, kernel_size=layer.kernel_size, stride=layer.stride, dilation=layer.dilation)
        return cols[: x.shape[0]]
    if isinstance(layer, nn.Conv1d):  # as a 2-d convolution of height 1
        return F.unfold(x.unsqueeze(-2), (1, *layer.kernel_size), dilation=(1, *layer.dilation),
                        stride=(1, *layer.stride))  # fmt: skip
    return F.unfold(x, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)


def _conv(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # g_i = Δ_i colsᵀ per group: output channels of group j see input channels of group j only.
    grad = known(grads[0], "the layer's output gradient")
    n, groups = grad.shape[0], layer.groups
    params = [p for p in (layer.weight, layer.bias) if p is not None and p.requires_grad]
    if n == 0:
        return {p: p.new_zeros(0, *p.shape) for p in params}
    backprops = grad.reshape(n, groups, layer.out_channels // groups, -1)  # [n, g, O/g, P]
    out: dict[nn.Parameter, Tensor] = {}
    if layer.weight.requires_grad:
        cols = conv_columns(layer, call.args[0].to(grad.dtype))
        cols = cols.reshape(n, groups, -1, cols.shape[-1])  # [n, g, C/g·k, P]
        out[layer.weight] = torch.einsum("ngop,ngqp->ngoq", backprops, cols).reshape(n, *layer.weight.shape)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = backprops.sum(-1).reshape(n, layer.out_channels)
    return out


def _layer_norm(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    grad = known(grads[0], "the layer's output gradient")
    out: dict[nn.Parameter, Tensor] = {}
    if layer.weight is not None and layer.weight.requires_grad:
        normed = F.layer_norm(call.args[0].to(grad.dtype), layer.normalized_shape, eps=layer.eps)
        out[layer.weight] = sum_over_all_but_batch_and_last_n(normed * grad, layer.weight.dim())
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = sum_over_all_but_batch_and_last_n(grad, layer.bias.dim())
    return out


def _embedding_bag(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # Bag b looks its ids up in its own copy b of the table (ids shifted by b·V), so autograd's
    # gradient of the copies is every bag's own, in every mode (max picks the same rows in each
    # copy). Padding ids keep pointing at one shared row, whose gradient autograd leaves at zero.
    grad = known(grads[0], "the layer's output gradient")
    if not layer.weight.requires_grad:
        return {}
    ids, offsets = _call_arg(call, 0, ("input",)), _call_arg(call, 1, ("offsets",))
    weights = _call_arg(call, 2, ("per_sample_weights",))
    n, vocab = grad.shape[0], layer.num_embeddings
    if ids.dim() == 2:
        bag = torch.arange(n, device=ids.device).unsqueeze(1).expand_as(ids)
    else:
        starts = offsets[:-1] if layer.include_last_offset else offsets
        bag = (torch.searchsorted(starts, torch.arange(ids.shape[0], device=ids.device), right=True) - 1).clamp(min=0)
    shifted = ids + bag * vocab
    padding = None
    if layer.padding_idx is not None:
        padding = n * vocab
        shifted = torch.where(ids == layer.padding_idx, torch.full_like(ids, padding), shifted)
    table = torch.cat([layer.weight.detach().repeat(n, 1), layer.weight.detach()[:1]]).requires_grad_(True)
    with torch.enable_grad():
        bags = F.embedding_bag(shifted, table, offsets, mode=layer.mode, per_sample_weights=weights,
                               include_last_offset=layer.include_last_offset, padding_idx=padding)  # fmt: skip
        (table_grad,) = torch.autograd.grad(bags, table, grad)
    return {layer.weight: table_grad[: n * vocab].view(n, vocab, layer.embedding_dim)}


def _bilinear(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # y_o = x1ᵀ W_o x2 + b_o: g_i = Σ_t Δ_t ⊗ x1_t ⊗ x2_t over the positions t of example i.
    grad = known(grads[0], "the layer's output gradient")
    x1, x2 = _call_arg(call, 0, ("input1",)), _call_arg(call, 1, ("input2",))
    d = as_tokens(grad)
    out: dict[nn.Parameter, Tensor] = {}
    if layer.weight.requires_grad:
        a, b = (as_tokens(x.to(grad.dtype)) for x in (x1, x2))
        out[layer.weight] = torch.einsum("nto,nti,ntj->noij", d, a, b)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = d.sum(1)
    return out


def _prelu(layer: Any, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # y = max(0, x) + a·min(0, x) per channel (dim 1), or with one a for every element.
    grad, x = known(grads[0], "the layer's output gradient"), call.args[0]
    if not layer.weight.requires_grad:
        return {}
    n = grad.shape[0]
    per_element = grad * x.to(grad.dtype).clamp(max=0)
    # Explicit sizes, not -1: an empty Poisson batch has zero elements and -1 would be ambiguous.
    if layer.num_parameters == 1:
        return {layer.weight: per_element.reshape(n, per_element.shape[1:].numel()).sum(1, keepdim=True)}
    per_channel = per_element.shape[1:].numel() // layer.num_parameters
    return {layer.weight: per_element.reshape(n, layer.num_parameters, per_channel).sum(2)}


_OWN: dict[type[nn.Module], GradSampler] = {
    nn.Embedding: _embedding,
    nn.EmbeddingBag: _embedding_bag,
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.Conv3d: _conv,
    nn.LayerNorm: _layer_norm,
    nn.Bilinear: _bilinear,
    nn.PReLU: _prelu,
}
# Hugging Face layers, matched by name so that the check does not import transformers (seconds) for every
# model. The RMSNorm classes listed share LlamaRMSNorm's forward line for line (Gemma's and OLMo-2's do not).
_HF_OWN: dict[str, GradSampler] = {
    "Conv1D": _hf_conv1d,
    "ViTEmbeddings": _hf_vit_embeddings,
    "OPTLearnedPositionalEmbedding": _hf_opt_positions,
    **{f"{name}RMSNorm": _hf_rms_norm for name in ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Phi3")},
}


def _hf_sampler(cls: type) -> GradSampler | None:
    return _HF_OWN.get(cls.__name__) if cls.__module__.startswith("transformers") else None


def registered_sampler(layer: nn.Module) -> GradSampler | None:
    """The sampler for ``layer``'s type, or for a base class whose ``forward`` it does not override."""
    for cls in type(layer).__mro__:
        if not issubclass(cls, nn.Module) or cls is nn.Module:
            break
        if type(layer).forward is not cls.forward:
            break
        if cls in _OWN:
            return _OWN[cls]
        if _hf_sampler(cls) is not None:
            return _hf_sampler(cls)
        if cls in GradSampleHooks.GRAD_SAMPLERS:
            return _opacus(GradSampleHooks.GRAD_SAMPLERS[cls])
    return None


def functorch_grad_sample(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    """Per-example gradients of any layer by replaying its call per example under ``torch.func``.

    Every input whose leading dimension equals the call's row count is split per example;
    the others (ints, masks shared by the batch) are passed whole. ``nn.MultiheadAttention``'s
    ``attn_mask`` is never taken for a per-example input: a ``[T, S]`` mask is shared (even
    when T is the batch size) and a ``[n·h, T, S]`` one is split into its h rows per example.
    The replay runs in the autocast state of the original call.

    Raises:
        RuntimeError: If an output that received a gradient has no leading dimension of one
            row per example (the layer reduced over the batch).
    """
    trainable = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    fixed: dict[str, Tensor] = {n: p.detach() for n, p in layer.named_parameters() if not p.requires_grad}
    fixed.update(dict(layer.named_buffers()))
    rows = call.rows
    used = [(slot, g) for slot, g in zip(call.output_slots, grads) if g is not None]
    if any(g.dim() == 0 or g.shape[0] != rows for _, g in used):
        raise RuntimeError(
            f"An output of {type(layer).__name__} has no leading dimension of {rows} rows, one per example "
            f"(output gradient shapes {[list(g.shape) for _, g in used]}): the layer reduces over the batch, so "
            "its per-example gradients are undefined. Return one row per example (e.g. reduction='none')."
        )
    if rows == 0:
        return {p: p.new_zeros(0, *p.shape) for p in trainable.values()}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    batched = _per_example_inputs(layer, call, leaves)

    def loss(params: Mapping[str, Tensor], inputs: list[Tensor], out_grads: list[Tensor]) -> Tensor:
        full = list(leaves)
        for (i, (_, grouped)), t in zip(batched.items(), inputs):
            full[i] = t if grouped else t.unsqueeze(0)
        args, kwargs = tree_unflatten(full, spec)
        with torch.autocast(*call.autocast) if call.autocast else nullcontext():
            outputs, _ = tree_flatten(functional_call(layer, {**params, **fixed}, tuple(args), kwargs))
        return sum((outputs[slot].float() * g.unsqueeze(0).float()).sum() for (slot, _), g in zip(used, out_grads))

    try:
        per_example = vmap(grad(loss), in_dims=(None, 0, 0))(
            trainable, [t for t, _ in batched.values()], [g for _, g in used]
        )
    except RuntimeError as err:
        if "randomness" not in str(err):
            raise
        raise RuntimeError(
            f"{type(layer).__name__} draws random numbers in its forward (dropout?). The torch.func fallback "
            "replays the call per example and would draw other masks than the forward did. Put that layer in "
            "eval() mode, or give it a registered per-example sampler."
        ) from err
    return {trainable[n]: g for n, g in per_example.items()}


_GROUPED_KWARGS: dict[type[nn.Module], set[str]] = {nn.MultiheadAttention: {"attn_mask"}}
"""Keyword arguments that are shared by the batch, or hold a whole number of rows per example, but never one."""


def _per_example_inputs(layer: nn.Module, call: LayerCall, leaves: list[Any]) -> dict[int, tuple[Tensor, bool]]:
    """Inputs split per example: leaf index -> (``[n, ...]`` tensor, whether a slice is already a batch)."""
    rows = call.rows
    grouped = {id(v) for k, v in call.kwargs.items() if k in _GROUPED_KWARGS.get(type(layer), ())}
    out: dict[int, tuple[Tensor, bool]] = {}
    for i, t in enumerate(leaves):
        if not isinstance(t, Tensor) or t.dim() == 0:
            continue
        if id(t) in grouped:
            if t.dim() == 3 and t.shape[0] % rows == 0:  # [n·h, T, S] -> [n, h, T, S]
                out[i] = (t.reshape(rows, t.shape[0] // rows, *t.shape[1:]), True)
        elif t.shape[0] == rows:
            out[i] = (t, False)
    return out


_BATCH_MAJOR_CONTAINERS: set[str] = {
    # OPT's decoder layer runs its MLP on hidden_states.reshape(-1, d) of a batch-first [n, T, d] tensor.
    "transformers.models.opt.modeling_opt.OPTDecoderLayer",
}


def register_batch_major_container(cls: type[nn.Module]) -> type[nn.Module]:
    """Declare that layers inside ``cls`` may see the batch flattened batch-major.

    A layer inside such a module that is called with ``n·m`` rows for a batch of ``n``
    examples is taken to hold example ``i`` in rows ``i·m .. i·m + m - 1`` (what
    ``x.reshape(-1, d)`` of a batch-first ``[n, m, d]`` tensor gives). Declaring a module
    that flattens any other way (sequence-first, ``x.transpose(0, 1).reshape(-1, d)``)
    would mix examples: only declare what you have read in its ``forward``. Usable as a
    class decorator.
    """
    _BATCH_MAJOR_CONTAINERS.add(f"{cls.__module__}.{cls.__qualname__}")
    return cls


def batch_major_layers(module: nn.Module) -> set[nn.Module]:
    """Submodules of ``module`` inside a registered batch-major container."""
    inside: set[nn.Module] = set()
    for m in module.modules():
        if f"{type(m).__module__}.{type(m).__qualname__}" in _BATCH_MAJOR_CONTAINERS:
            inside.update(m.modules())
    return inside
