"""Backends on Opacus' ``GradSampleHooks``: per-layer samplers hooked in place."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import ClassVar

from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn

from dplightning.privacy.grad_sample.backend import GradSampleBackend, register_grad_sample_backend
from dplightning.privacy.grad_sample.conv1d import register_conv1d
from dplightning.privacy.grad_sample.validation import mixing_modules, modules_without_sampler

# Opacus' full backward hooks on the first layer trigger this torch warning on every run;
# it concerns the input (which needs no gradient), not the parameters' per-example gradients.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")

_MODULE_ATTRS = ("activations", "max_batch_len")
_PARAM_ATTRS = ("grad_sample", "_current_grad_sample", "_forward_counter")


@register_grad_sample_backend("hooks")
class HooksBackend(GradSampleBackend):
    """Opacus' registered per-layer samplers only; any other trainable layer is an error."""

    functorch_fallback: ClassVar[bool] = False

    def __init__(self, module: nn.Module, loss_reduction: str) -> None:
        super().__init__(module, loss_reduction)
        register_conv1d()
        self._check(module)
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction=loss_reduction, strict=False)

    def _check(self, module: nn.Module) -> None:
        mixing = mixing_modules(module)
        if mixing:
            raise ValueError(
                f"Per-example clipping is undefined with modules that mix the examples of a batch: {mixing}. "
                "Replace BatchNorm with GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix(model) "
                "does it) and set track_running_stats=False on InstanceNorm."
            )
        if any(p.requires_grad for p in module.parameters(recurse=False)):
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

    def pop(self, params: Sequence[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
        grads: dict[nn.Parameter, Tensor] = {}
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if isinstance(gs, list):
                raise RuntimeError("A parameter received per-example gradients from several backward passes.")
            if gs is not None:
                grads[p] = gs
            p.grad_sample = None
        self._forget_unused_forwards()
        return grads

    def _forget_unused_forwards(self) -> None:
        # A forward without a matching backward leaves activations and counters behind,
        # which would pair the next backward with the wrong inputs.
        for m in self.module.modules():
            if getattr(m, "activations", None):
                m.activations.clear()
            if hasattr(m, "max_batch_len"):
                del m.max_batch_len
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    p._forward_counter = 0
                    if hasattr(p, "_current_grad_sample"):
                        del p._current_grad_sample

    def close(self) -> None:
        self._hooks.cleanup()
        for m in self.module.modules():
            for attr in _MODULE_ATTRS:
                if hasattr(m, attr):
                    delattr(m, attr)
            for p in m.parameters(recurse=False):
                for attr in _PARAM_ATTRS:
                    if hasattr(p, attr):
                        delattr(p, attr)


@register_grad_sample_backend("functorch")
class FunctorchFallbackBackend(HooksBackend):
    """Registered samplers where they exist, ``torch.func`` per layer for the rest."""

    functorch_fallback: ClassVar[bool] = True
