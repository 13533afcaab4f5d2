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

Two rules live here and nowhere else; the memory planner (:mod:`dplightning.planning.memory`)
and the optimizers call them:

* :func:`ghost_norm_pays`, the ghost-norm rule 2T² < a·b, and :meth:`Engine.keeps_factors`, which
  engine keeps a factorisable weight's factors for a call of T tokens;
* :func:`classify`, what a layer is (its kind, its widths per token) and its
  :class:`Factorisation`, if the engines factor its weight gradient. A new factorisable layer
  type is added in one place, :func:`register_factorisation`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from torch import Tensor, nn

from dplightning.privacy.grad_sample.grads import (
    Dense,
    Factored,
    PerExampleGrad,
    Summed,
    as_tokens,
    ghost_norm_pays,
)
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

    @classmethod
    def keeps_factors(cls, tokens: int, elements: int) -> bool:
        """Whether this engine keeps a factorisable weight of ``elements`` entries factored for a call of T tokens.

        The one statement of each engine's choice: :meth:`BookKeeping.grads` asks it per call,
        the memory planner asks it per layer (through :func:`keeps_factors`).
        """
        return False


def ghost_norm_limit(elements: int) -> int:
    """The largest T for which :func:`ghost_norm_pays` on a weight of ``elements`` entries (0 if none does)."""
    # 2T² < e  <=>  2T² <= e - 1  <=>  T² <= (e - 1) // 2 for integers.
    return math.isqrt(max(elements - 1, 0) // 2)


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
    return _engine_class(name)(functorch_fallback)


def keeps_factors(engine: str, tokens: int, elements: int) -> bool:
    """Whether the engine named ``engine`` keeps a factorisable weight's factors (:meth:`Engine.keeps_factors`)."""
    return _engine_class(engine).keeps_factors(tokens, elements)


def _engine_class(name: str) -> type[Engine]:
    if name not in _ENGINES:
        raise ValueError(f"Unknown clipping_engine {name!r}; choose one of {available_engines()}.")
    return _ENGINES[name]


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


def _linear(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, Tensor]:
    a, d = as_tokens(call.args[0]), as_tokens(grad)
    return Factored(d, a.to(d.dtype), layer.weight.shape[0], layer.weight.shape), d.sum(1)


def _hf_conv1d(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, Tensor]:
    a, d = as_tokens(call.args[0]), as_tokens(grad)  # weight is [in, out]: g_i = A_iᵀ Δ_i
    return Factored(a.to(d.dtype), d, layer.weight.shape[0], layer.weight.shape), d.sum(1)


def _embedding(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, None]:
    ids = call.args[0].reshape(grad.shape[0], math.prod(grad.shape[1:-1])).long()
    d = as_tokens(grad)
    if layer.padding_idx is not None:  # autograd gives the padding row no gradient
        d = d * (ids != layer.padding_idx).unsqueeze(-1).to(d.dtype)
    return Factored(ids, d, layer.weight.shape[0], layer.weight.shape), None


def _conv(layer: Any, call: LayerCall, grad: Tensor) -> tuple[Factored, Tensor]:
    n = grad.shape[0]
    cols = conv_columns(layer, call.args[0].to(grad.dtype))  # [n, C k, P], padded as the layer pads
    d = grad.reshape(n, grad.shape[1], math.prod(grad.shape[2:])).transpose(1, 2)  # [n, P, out]
    return Factored(d, cols.transpose(1, 2), layer.weight.shape[0], layer.weight.shape), d.sum(1)


def is_hf_conv1d(layer: nn.Module) -> bool:
    """Whether ``layer`` is Hugging Face's ``Conv1D`` (GPT-2's Linear with its weight stored ``[in, out]``).

    The one Conv1D check: matched by name, so ``transformers`` is never imported for it.
    """
    cls = type(layer)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _plain(layer: nn.Module, base: type[nn.Module]) -> bool:
    """An instance of ``base`` that keeps ``base``'s forward (a subclass with its own may compute anything)."""
    return isinstance(layer, base) and type(layer).forward is base.forward


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

FactorFn = Callable[[Any, LayerCall, Tensor], "tuple[Factored, Tensor | None]"]
"""``(layer, call, output gradient) -> (the weight's factored g_i, the bias's per-example gradient or None)``."""


def _ungrouped_conv(layer: Any) -> bool:
    """A plain Conv1d/2d/3d with one group (a grouped one is instantiated per group)."""
    return any(_plain(layer, conv) for conv in _CONVS) and layer.groups == 1


def _token_rows(grad: Tensor) -> int:
    """T of a ``[n, ..., out]`` output gradient: the positions between the batch and the features."""
    return math.prod(grad.shape[1:-1]) if grad.dim() > 2 else 1


def _conv_positions(grad: Tensor) -> int:
    """T of a ``[n, out, *spatial]`` output gradient: its spatial positions."""
    return math.prod(grad.shape[2:])


@dataclass(frozen=True)
class Factorisation:
    """How the engines factor one kind of layer's weight gradient, g_i = L_iᵀ R_i.

    Attributes:
        name: Registry key (``"linear"``, ``"embedding"``, ``"hf_conv1d"``, ``"conv"``).
        kind: The layer kind :func:`classify` reports (``"linear"`` for every matmul layer).
        matches: Whether a layer is of this kind (registered order: the first match wins).
        factor: The factors of one call (:data:`FactorFn`).
        tokens: T, the rows per example of the factors, from the call's output gradient.
        widths: ``(input features, output features)`` per token (0 for index inputs).
        matrix: Whether g_i is a product of the per-token inputs and output gradients of a
            matrix weight, so an optimizer's projection can act on the factors before g_i is
            formed (DP-GRAPE selects only such layers).
    """

    name: str
    kind: str
    matches: Callable[[nn.Module], bool]
    factor: FactorFn
    tokens: Callable[[Tensor], int]
    widths: Callable[[Any], tuple[int, int]]
    matrix: bool = False


_FACTORISATIONS: dict[str, Factorisation] = {}


def register_factorisation(factorisation: Factorisation) -> Factorisation:
    """Make the engines factor a layer type's weight gradient (and the planner count it as factored).

    Every layer :attr:`Factorisation.matches` then counts as handled per layer (the model check of
    ``grad_sample_mode="hooks"`` accepts it); ``book_keeping`` keeps its calls factored, ``auto``
    where :func:`ghost_norm_pays` (other calls are formed by its registered sampler, else
    ``torch.func``), and the memory planner counts it as factored.

    Raises:
        ValueError: If the name is taken.
    """
    if factorisation.name in _FACTORISATIONS:
        raise ValueError(f"A factorisation named {factorisation.name!r} is registered already.")
    _FACTORISATIONS[factorisation.name] = factorisation
    return factorisation


register_factorisation(
    Factorisation(
        "linear",
        "linear",
        lambda m: _plain(m, nn.Linear),
        _linear,
        _token_rows,
        lambda m: (m.in_features, m.out_features),
        matrix=True,
    )
)
register_factorisation(
    Factorisation(
        "embedding",
        "embedding",
        lambda m: _plain(m, nn.Embedding),
        _embedding,
        _token_rows,
        lambda m: (0, m.embedding_dim),
    )
)
register_factorisation(
    Factorisation(
        "hf_conv1d",
        "linear",
        is_hf_conv1d,
        _hf_conv1d,
        _token_rows,
        lambda m: (m.weight.shape[0], m.weight.shape[1]),
        matrix=True,
    )
)
register_factorisation(
    Factorisation(
        "conv",
        "conv",
        _ungrouped_conv,
        _conv,
        _conv_positions,
        lambda m: (m.in_channels * math.prod(m.kernel_size), m.out_channels),
    )
)


@dataclass(frozen=True)
class LayerKind:
    """What a layer is, for the engines and the memory planner.

    Attributes:
        kind: ``"linear"`` (``nn.Linear`` and Hugging Face ``Conv1D``, with or without their own
            forward), ``"embedding"``, ``"conv"``, ``"norm"`` or ``"other"``.
        in_width: Input features per token (0 for index inputs and where unknown).
        out_width: Output features per token (0 where unknown).
        factorisation: How the engines factor its weight gradient; ``None``: formed.
    """

    kind: str
    in_width: int
    out_width: int
    factorisation: Factorisation | None = None


def classify(layer: nn.Module) -> LayerKind:
    """The one classification of a layer: its registered factorisation if any, else its kind by type."""
    for factorisation in _FACTORISATIONS.values():
        if factorisation.matches(layer):
            return LayerKind(factorisation.kind, *factorisation.widths(layer), factorisation)
    return _unfactored(layer)


def _unfactored(layer: Any) -> LayerKind:
    if isinstance(layer, nn.Linear):  # a subclass with its own forward: its gradient is formed
        return LayerKind("linear", layer.in_features, layer.out_features)
    if isinstance(layer, nn.Embedding):
        return LayerKind("embedding", 0, layer.embedding_dim)
    if isinstance(layer, _CONVS):
        return LayerKind("conv", 0, 0)
    if isinstance(layer, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(layer).__name__.lower():
        width = int(layer.weight.shape[-1]) if getattr(layer, "weight", None) is not None else 0
        return LayerKind("norm", width, width)
    return LayerKind("other", 0, 0)


def factorisation_of(layer: nn.Module) -> Factorisation | None:
    """How the engines factor ``layer``'s weight gradient, or ``None`` if they form it."""
    return classify(layer).factorisation


def factors_matrix(layer: nn.Module) -> bool:
    """Whether the engines factor ``layer``'s weight gradient as a matrix product (a plain Linear or HF Conv1D).

    A Linear subclass with its own ``forward`` is not factored: its per-example gradients are
    instantiated, so nothing can be projected before they are formed.
    """
    found = factorisation_of(layer)
    return found is not None and found.matrix


def factored_kind(layer: nn.Module) -> FactorFn | None:
    """The factorisation function of ``layer``'s weight gradient, or ``None`` if it has none here."""
    found = factorisation_of(layer)
    return None if found is None else found.factor


def weight_tokens(layer: nn.Module, call: LayerCall, grad: Tensor) -> int:
    """T, the rows per example of ``layer``'s factored weight gradient in this call."""
    found = factorisation_of(layer)
    return _token_rows(grad) if found is None else found.tokens(grad)


@register_engine("book_keeping")
class BookKeeping(Engine):
    """A and Δ kept, weight gradients never formed where the ghost norm pays; the rest instantiated."""

    def __init__(self, functorch_fallback: bool = False) -> None:
        super().__init__(functorch_fallback)
        self._fallback = Instantiate(functorch_fallback)

    def grads(self, layer: nn.Module, call: LayerCall, output_grads: OutputGrads) -> dict[nn.Parameter, PerExampleGrad]:
        found, grad = factorisation_of(layer), output_grads[0]
        if found is None or grad is None or not self.factor(layer, call, grad):
            return self._fallback.grads(layer, call, output_grads)
        weight, bias_grad = found.factor(layer, call, grad)
        out: dict[nn.Parameter, PerExampleGrad] = {}
        if _weight(layer).requires_grad:
            out[_weight(layer)] = weight
        bias = getattr(layer, "bias", None)
        if isinstance(bias, nn.Parameter) and bias.requires_grad and bias_grad is not None:
            out[bias] = Dense(bias_grad)
        return out

    def factor(self, layer: nn.Module, call: LayerCall, grad: Tensor) -> bool:
        """Whether to keep this call factored (:meth:`keeps_factors` for the call's T and the layer's weight)."""
        return self.keeps_factors(weight_tokens(layer, call, grad), math.prod(_weight(layer).shape))

    @classmethod
    def keeps_factors(cls, tokens: int, elements: int) -> bool:
        """Always, for book-keeping."""
        return True

    def describe(self, layer: nn.Module) -> str:
        if factorisation_of(layer) is None:
            return self._fallback.describe(layer)
        return f"book_keeping (ghost norm for T <= {ghost_norm_limit(math.prod(_weight(layer).shape))})"


@register_engine("auto")
class Auto(BookKeeping):
    """Book-keeping for calls where the ghost norm pays (2T² < a·b), instantiation for the others."""

    @classmethod
    def keeps_factors(cls, tokens: int, elements: int) -> bool:
        """Where the ghost norm pays (:func:`ghost_norm_pays`)."""
        return ghost_norm_pays(tokens, elements)

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
        if factorisation_of(layer) is None:
            return self._fallback.describe(layer)
        return f"book_keeping for T <= {ghost_norm_limit(math.prod(_weight(layer).shape))}, else instantiate"
