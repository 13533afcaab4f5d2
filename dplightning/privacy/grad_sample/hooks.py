"""Backends on Opacus' per-layer grad samplers, hooked onto the model's own layers.

The per-layer math is Opacus' (``GradSampleHooks.GRAD_SAMPLERS``, and its ``torch.func``
fallback). The hook plumbing is ours, written by hand for two reasons: Opacus' hooks
store every per-example gradient on a parameter attribute through a zero-filled copy
(twice the memory traffic of the gradient itself: a forward and backward of a 4x512 MLP
at batch 64 took 0.38-0.44 s through them and 0.18 s through these hooks, one CPU
thread; ``benchmarks/step_overhead.py`` compares whole steps with Opacus'), and the
strategy needs the gradients of each backward pass handed over and forgotten, not
accumulated on the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dplightning.privacy.grad_sample.backend import GradSampleBackend, register_grad_sample_backend
from dplightning.privacy.grad_sample.conv1d import register_conv1d
from dplightning.privacy.grad_sample.validation import mixing_modules, modules_without_sampler, owns_trainable

# Full backward hooks on the first layer trigger this torch warning on every run; it
# concerns the input (which needs no gradient), not the parameters' per-example gradients.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs"
)

GradSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]


@register_grad_sample_backend("hooks")
class HooksBackend(GradSampleBackend):
    """Opacus' registered per-layer samplers only; any other trainable layer is an error."""

    functorch_fallback: ClassVar[bool] = False

    def __init__(self, module: nn.Module, loss_reduction: str) -> None:
        super().__init__(module, loss_reduction)
        register_conv1d()
        self._check(module)
        self._samplers: dict[nn.Module, GradSampler] = {}
        self._activations: dict[nn.Module, list[list[Tensor]]] = {}
        self._grads: dict[nn.Parameter, Tensor] = {}
        self._handles: list[RemovableHandle] = []
        for layer in self._layers(module):
            self._samplers[layer] = GradSampleHooks.GRAD_SAMPLERS.get(type(layer)) or self._functorch(layer)
            self._handles.append(layer.register_forward_hook(self._capture))
            self._handles.append(layer.register_full_backward_hook(self._backprop))

    def _check(self, module: nn.Module) -> None:
        mixing = mixing_modules(module)
        if mixing:
            raise ValueError(
                f"Per-example clipping is undefined with modules that mix the examples of a batch: {mixing}. "
                "Replace BatchNorm with GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix(model) "
                "does it) and set track_running_stats=False on InstanceNorm."
            )
        if owns_trainable(module):
            raise ValueError(
                f"{type(module).__name__} owns trainable parameters directly; per-example gradients are "
                "computed per submodule, so move them into a submodule (e.g. an nn.Module holding them)."
            )
        if self.functorch_fallback:
            return
        missing = modules_without_sampler(module, lambda m: type(m) in GradSampleHooks.GRAD_SAMPLERS)
        if missing:
            raise ValueError(
                f"No per-example gradient sampler for these modules with trainable parameters: {missing}. "
                "Replace them (nn.LSTM/GRU/RNN -> opacus.layers.DPLSTM/DPGRU/DPRNN, nn.MultiheadAttention -> "
                "opacus.layers.DPMultiheadAttention), register a sampler with "
                "opacus.grad_sample.register_grad_sampler, freeze them, or pass grad_sample_mode='functorch' "
                "to differentiate them per example with torch.func."
            )

    def _layers(self, module: nn.Module) -> list[nn.Module]:
        """Modules owning trainable parameters; a functorch layer covers its whole subtree."""
        owns = owns_trainable(module)
        if owns and type(module) not in GradSampleHooks.GRAD_SAMPLERS:  # only with the functorch fallback
            return [module]
        return [module] * owns + [m for child in module.children() for m in self._layers(child)]

    @staticmethod
    def _functorch(layer: nn.Module) -> GradSampler:
        prepare_layer(layer, batch_first=True)
        return ft_compute_per_sample_gradient

    def _capture(self, layer: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
        if not layer.training or not torch.is_grad_enabled():
            return
        self._activations.setdefault(layer, []).append([t.detach() if isinstance(t, Tensor) else t for t in inputs])

    def _backprop(self, layer: nn.Module, _grad_input: Any, grad_output: tuple[Tensor, ...]) -> None:
        calls = self._activations.get(layer)
        if not calls:
            return
        activations = calls.pop()  # backward visits a layer's calls in reverse order
        backprops = grad_output[0].detach()
        rows = activations[-1].shape[0]
        if self.loss_reduction == "mean":  # undo the mean over the rows of the batch
            backprops = backprops * rows
        for p, gs in self._samplers[layer](layer, activations, backprops).items():
            gs = gs[:rows]  # some samplers answer an empty batch with one row of zeros
            if p.requires_grad:  # a layer called twice, or a tied parameter: the contributions add up
                self._grads[p] = self._grads[p] + gs if p in self._grads else gs

    def pop(self, params: Sequence[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
        grads = {p: self._grads[p] for p in params if p in self._grads}
        # Forget everything, including activations of forwards that had no backward.
        self._grads.clear()
        self._activations.clear()
        return grads

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for layer in self._samplers:
            if hasattr(layer, "ft_compute_sample_grad"):
                del layer.ft_compute_sample_grad
        self._samplers.clear()
        self._grads.clear()
        self._activations.clear()


@register_grad_sample_backend("functorch")
class FunctorchFallbackBackend(HooksBackend):
    """Registered samplers where they exist, ``torch.func`` per layer for the rest."""

    functorch_fallback: ClassVar[bool] = True
