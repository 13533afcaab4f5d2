"""Clipping engines: per layer, one call's inputs and output gradients -> per-example gradients.

An engine turns what the hooks captured for one call of one layer (its inputs A and the
gradient Δ of its output) into the per-example gradients of the layer's parameters, as
:class:`~dplightning.privacy.grad_sample.grads.PerExampleGrad` objects that give norms and
weighted sums. Engines are registered by name and chosen per layer, first match wins:

* ``instantiate``: forms every g_i (per-layer samplers, ours or Opacus', or ``torch.func``).
* ``book_keeping``: keeps A and Δ and never forms g_i for the weight matrices of Linear,
  ungrouped Conv1d/Conv2d/Conv3d (im2col, padded as the layer pads: any ``padding_mode``,
  ``padding="same"``), Embedding and Hugging Face ``Conv1D`` layers (peft's LoRA
  adapters are Linear layers): norms by the ghost norm or by forming g_i, whichever takes
  less memory, and the clipped sum by one matrix product (Bu et al., arXiv 2210.00038).
  Biases and norm affines are small and formed. Other layers fall back to ``instantiate``.
* ``auto`` (default): book-keeping where the ghost norm pays (2T² < a·b for the layer's
  a×b weight and T tokens), instantiation otherwise, decided per call; a slot gradient of
  an optimizer's plan (a projection) is formed as soon as that takes less memory than
  its factors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, cast

from torch import Tensor, nn

from dplightning.privacy.grad_sample.grads import Dense, Factored, PerExampleGrad, Summed
from dplightning.privacy.grad_sample.samplers import (
    LayerCall,
    conv_columns,
    functorch_grad_sample,
    registered_sampler,
)

OutputGrads = list["Tensor | None"]


class Engine(ABC):
    """Computes the per-example gradients of one layer call."""

    name: ClassVar[str]

    def __init__(self, functorch_fallback: bool = False) -> None:
        self.functorch_fallback = functorch_fallback

    @abstractmethod
    def grads(self, layer: nn.Module, call: LayerCall, output_grads: OutputGrads) -> dict[nn.Parameter, PerExampleGrad]:
        """Per-example gradients of ``layer``'s trainable parameters for this call."""

    @abstractmethod
    def describe(self, layer: nn.Module) -> str:
        """How this engine handles ``layer`` (one cell of the setup summary)."""

    def settle(self, grad: PerExampleGrad) -> PerExampleGrad:
        """The form in which a transformed (slot) gradient is held until the clipped sum (default: as is)."""
        return grad


_ENGINES: dict[str, type[Engine]] = {}


def register_engine(name: str) -> Callable[[type[Engine]], type[Engine]]:
    """Class decorator registering a clipping engine under ``name``."""

    def decorator(cls: type[Engine]) -> type[Engine]:
        cls.name = name
        _ENGINES[name] = cls
        return cls

    return decorator


def available_engines() -> list[str]:
    """Names accepted by ``clipping_engine=``."""
    return sorted(_ENGINES)


def make_engine(name: str, functorch_fallback: bool = False) -> Engine:
    """The engine registered as ``name``."""
    if name not in _ENGINES:
        raise ValueError(f"Unknown clipping_engine {name!r}; choose one of {available_engines()}.")
    return _ENGINES[name](functorch_fallback)


@register_engine("instantiate")
class Instantiate(Engine):
    """Every per-example gradient formed, by the layer's registered sampler or ``torch.func``."""

    def grads(self, layer: nn.Module, call: LayerCall, output_grads: OutputGrads) -> dict[nn.Parameter, PerExampleGrad]:
        sampler = registered_sampler(layer) or functorch_grad_sample
        return {p: Dense(g) for p, g in sampler(layer, call, output_grads).items() if p.requires_grad}

    def describe(self, layer: nn.Module) -> str:
        return "instantiate" if registered_sampler(layer) is not None else "instantiate (torch.func)"


# ---------------------------------------------------------------- factored layers


def _weight(layer: nn.Module) -> nn.Parameter:
    """The weight of a layer the engines factor (every factored kind has one)."""
    # nn.Module.__getattr__ types attributes as Tensor | Module; torch types most weights as Tensor.
    return cast(nn.Parameter, layer.weight)


def _tokens(t: Tensor) -> Tensor:
    """``[n, ..., d]`` -> ``[n, T, d]`` (T = 1 for a plain ``[n, d]`` input)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])  # explicit T: n may be 0


def _linear(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, Tensor]:
    a, d = _tokens(call.args[0]), _tokens(grad)
    return Factored(d, a.to(d.dtype), layer.weight.shape[0], layer.weight.shape), d.sum(1)


def _hf_conv1d(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, Tensor]:
    a, d = _tokens(call.args[0]), _tokens(grad)  # weight is [in, out]: g_i = A_iᵀ Δ_i
    return Factored(a.to(d.dtype), d, layer.weight.shape[0], layer.weight.shape), d.sum(1)


def _embedding(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, None]:
    ids = call.args[0].reshape(grad.shape[0], math.prod(grad.shape[1:-1])).long()
    d = _tokens(grad)
    if layer.padding_idx is not None:  # autograd gives the padding row no gradient
        d = d * (ids != layer.padding_idx).unsqueeze(-1).to(d.dtype)
    return Factored(ids, d, layer.weight.shape[0], layer.weight.shape), None


def _conv(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, Tensor]:
    n = grad.shape[0]
    cols = conv_columns(layer, call.args[0].to(grad.dtype))  # [n, C k, P], padded as the layer pads
    d = grad.reshape(n, grad.shape[1], math.prod(grad.shape[2:])).transpose(1, 2)  # [n, P, out]
    return Factored(d, cols.transpose(1, 2), layer.weight.shape[0], layer.weight.shape), d.sum(1)


def is_hf_conv1d(layer: nn.Module) -> bool:
    """Whether ``layer`` is Hugging Face's ``Conv1D`` (GPT-2's Linear with its weight stored ``[in, out]``)."""
    cls = type(layer)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _plain(layer: nn.Module, base: type[nn.Module]) -> bool:
    return isinstance(layer, base) and type(layer).forward is base.forward


def factors_matrix(layer: nn.Module) -> bool:
    """Whether the engines factor ``layer``'s weight gradient as a matrix product (a plain Linear or HF Conv1D).

    A Linear subclass with its own ``forward`` is not factored: its per-example gradients are
    instantiated, so nothing can be projected before they are formed.
    """
    return _plain(layer, nn.Linear) or is_hf_conv1d(layer)


def factored_kind(layer: nn.Module) -> Callable[[nn.Module, LayerCall, Tensor], tuple[Factored, Tensor | None]] | None:
    """The factorisation of ``layer``'s weight gradient, or ``None`` if it has none here."""
    if _plain(layer, nn.Linear):
        return _linear
    if _plain(layer, nn.Embedding):
        return _embedding
    if is_hf_conv1d(layer):
        return _hf_conv1d
    if any(_plain(layer, conv) for conv in _CONVS) and layer.groups == 1:  # grouped: instantiated per group
        return _conv
    return None


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def weight_tokens(layer: nn.Module, call: LayerCall, grad: Tensor) -> int:
    """T, the rows per example of ``layer``'s factored weight gradient in this call."""
    if isinstance(layer, _CONVS):
        return math.prod(grad.shape[2:])
    return math.prod(grad.shape[1:-1]) if grad.dim() > 2 else 1


@register_engine("book_keeping")
class BookKeeping(Engine):
    """A and Δ kept, weight gradients never formed where the ghost norm pays; the rest instantiated."""

    def __init__(self, functorch_fallback: bool = False) -> None:
        super().__init__(functorch_fallback)
        self._fallback = Instantiate(functorch_fallback)

    def grads(self, layer: nn.Module, call: LayerCall, output_grads: OutputGrads) -> dict[nn.Parameter, PerExampleGrad]:
        kind, grad = factored_kind(layer), output_grads[0]
        if kind is None or grad is None or not self.factor(layer, call, grad):
            return self._fallback.grads(layer, call, output_grads)
        weight, bias_grad = kind(layer, call, grad)
        out: dict[nn.Parameter, PerExampleGrad] = {}
        if _weight(layer).requires_grad:
            out[_weight(layer)] = weight
        bias = getattr(layer, "bias", None)
        if isinstance(bias, nn.Parameter) and bias.requires_grad and bias_grad is not None:
            out[bias] = Dense(bias_grad)
        return out

    def factor(self, layer: nn.Module, call: LayerCall, grad: Tensor) -> bool:
        """Whether to keep this call factored (always, for book-keeping)."""
        return True

    def describe(self, layer: nn.Module) -> str:
        if factored_kind(layer) is None:
            return self._fallback.describe(layer)
        limit = math.isqrt(max(math.prod(_weight(layer).shape) // 2 - 1, 0))
        return f"book_keeping (ghost norm for T <= {limit})"


@register_engine("auto")
class Auto(BookKeeping):
    """Book-keeping for calls where the ghost norm pays (2T² < a·b), instantiation for the others."""

    def factor(self, layer: nn.Module, call: LayerCall, grad: Tensor) -> bool:
        return 2 * weight_tokens(layer, call, grad) ** 2 < math.prod(_weight(layer).shape)

    def settle(self, grad: PerExampleGrad) -> PerExampleGrad:
        """Form a projected slot's g_i when that is smaller than its factors (DP-GRAPE: n·m·r vs n·T·(m + r)).

        The factors are the layer's output gradient Δ and input A, one of them projected; held
        until the clipped sum they outlive autograd's use of them, for every projected layer
        at once. The formed slot frees them right away: the memory the projection exists for.
        """
        if isinstance(grad, Summed):
            return Summed([self.settle(part) for part in grad.parts])
        if not isinstance(grad, Factored):
            return grad
        held = grad.left.numel() * grad.left.element_size() + grad.right.numel() * grad.right.element_size()
        formed = grad.rows * math.prod(grad.shape) * 4  # instantiate() is fp32
        return Dense(grad.instantiate()) if formed < held else grad

    def describe(self, layer: nn.Module) -> str:
        if factored_kind(layer) is None:
            return self._fallback.describe(layer)
        limit = math.isqrt(max(math.prod(_weight(layer).shape) // 2 - 1, 0))
        return f"book_keeping for T <= {limit}, else instantiate"
