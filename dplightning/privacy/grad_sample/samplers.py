"""Per-layer samplers: one layer call's inputs and output gradients -> per-example gradients.

Opacus' registered samplers (``GradSampleHooks.GRAD_SAMPLERS``) do the per-layer math for
the layers they cover. Written here, because Opacus' do not give what the autograd
gradient is:

* ``nn.Embedding`` with ``padding_idx``: autograd leaves the padding row's gradient at
  zero; Opacus' sampler gives it the padding tokens' backprops.
* Hugging Face's ``Conv1D`` (GPT-2's linear layer) and ``ViTEmbeddings`` ([CLS] token and
  position embeddings, owned by the module itself): Opacus has no sampler.
* The ``torch.func`` fallback: Opacus' re-runs a layer with its first input only, so a
  layer taking a second input (a key and a value, an attention mask, an int offset)
  fails or is differentiated at the wrong point. Ours replays the whole call.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten


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
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    output_slots: list[int] = field(default_factory=lambda: [0])
    autocast: tuple[str, torch.dtype] | None = None
    fold: int = 1

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
        """Leading dimension of the first tensor input (the examples of the call)."""
        first = next((a for a in self.args if isinstance(a, Tensor)), None)
        return first.shape[0] if first is not None and first.dim() > 0 else 0


GradSampler = Callable[[nn.Module, LayerCall, list["Tensor | None"]], dict[nn.Parameter, Tensor]]
"""``(layer, call, output_grads) -> {parameter: [n, *p.shape]}`` for one call of a layer."""

OpacusSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]


def _opacus(sampler: OpacusSampler) -> GradSampler:
    def run(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
        return sampler(layer, call.activations, grads[0])  # type: ignore[arg-type]

    return run


def _embedding(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    opacus_embedding = GradSampleHooks.GRAD_SAMPLERS[nn.Embedding]
    out = opacus_embedding(layer, call.activations, grads[0])
    if layer.padding_idx is not None and layer.weight in out:
        out[layer.weight][:, layer.padding_idx] = 0  # autograd gives the padding row no gradient
    return out


def _hf_conv1d(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # Conv1D computes y = x @ W + b with W stored [in, out] (transposed with respect to nn.Linear).
    a, b = call.args[0], grads[0]
    assert b is not None
    a3 = a.reshape(a.shape[0], -1, a.shape[-1])
    b3 = b.reshape(b.shape[0], -1, b.shape[-1]).to(a3.dtype)
    out: dict[nn.Parameter, Tensor] = {}
    if layer.weight.requires_grad:
        out[layer.weight] = torch.einsum("nti,nto->nio", a3, b3)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = b3.sum(dim=1)
    return out


def _hf_vit_embeddings(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
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
    grad = grads[0]
    assert grad is not None
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


def _hf_opt_positions(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
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


def _hf_rms_norm(layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> dict[nn.Parameter, Tensor]:
    # y = w * (x / rms(x)), normalised in fp32 and cast back, as LlamaRMSNorm (and its copies) compute it.
    x, grad = call.args[0], grads[0]
    assert grad is not None
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)).to(x.dtype)
    per_token = (grad * normed).float()
    return {layer.weight: per_token.reshape(per_token.shape[0], -1, per_token.shape[-1]).sum(1)}


_OWN: dict[type[nn.Module], GradSampler] = {nn.Embedding: _embedding}
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
    the others (ints, masks shared by the batch) are passed whole. The replay runs in the
    autocast state of the original call.
    """
    trainable = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    fixed: dict[str, Tensor] = {n: p.detach() for n, p in layer.named_parameters() if not p.requires_grad}
    fixed.update(dict(layer.named_buffers()))
    rows = call.rows
    if rows == 0:
        return {p: p.new_zeros(0, *p.shape) for p in trainable.values()}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    batched = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows]
    used = [(slot, g) for slot, g in zip(call.output_slots, grads) if g is not None]

    def loss(params: dict[str, Tensor], inputs: list[Tensor], out_grads: list[Tensor]) -> Tensor:
        full = list(leaves)
        for i, t in zip(batched, inputs):
            full[i] = t.unsqueeze(0)
        args, kwargs = tree_unflatten(full, spec)
        with torch.autocast(*call.autocast) if call.autocast else nullcontext():
            outputs, _ = tree_flatten(functional_call(layer, {**params, **fixed}, tuple(args), kwargs))
        return sum((outputs[slot].float() * g.unsqueeze(0).float()).sum() for (slot, _), g in zip(used, out_grads))

    try:
        per_example = vmap(grad(loss), in_dims=(None, 0, 0))(
            trainable, [leaves[i] for i in batched], [g for _, g in used]
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
