"""Backends on Opacus' per-layer grad samplers, hooked onto the model's own layers.

The per-layer math is Opacus' (``GradSampleHooks.GRAD_SAMPLERS``), with a few samplers of
our own (``samplers.py``). The hook plumbing is ours, written by hand because Opacus'
cannot give what the strategy needs:

* **Exact pairing of a call with its backward.** Opacus keeps each layer's inputs on a
  stack and pops one per module backward hook, so a layer called twice where one call is
  cut from the graph (``.detach()``), or a forward that is never backpropagated (a metric
  pass after the loss), pairs a backward with the wrong call's inputs. Here each call
  registers a hook on *its own output tensor*, holding its inputs in the hook's closure:
  the hook fires only if gradient reaches that output, and the inputs are freed with
  the graph when it does not.
* **No zero-filled copies.** Opacus stores every per-example gradient on a parameter
  attribute through a zero-filled copy (twice the memory traffic of the gradient: a
  forward and backward of a 4x512 MLP at batch 64 took 0.38-0.44 s through its hooks and
  0.18 s through these, one CPU thread). Here the gradients of one backward pass are
  handed over and forgotten.
* **Capture by gradient, not by mode.** A trainable layer put in ``eval()`` (to turn off
  its dropout) still trains, so calls are captured whenever autograd records them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from dplightning.privacy.grad_sample.backend import GradSampleBackend, register_grad_sample_backend
from dplightning.privacy.grad_sample.samplers import (
    GradSampler,
    LayerCall,
    batch_major_layers,
    functorch_grad_sample,
    registered_sampler,
)
from dplightning.privacy.grad_sample.validation import (
    check_embeddings,
    mixing_modules,
    modules_without_sampler,
    owns_trainable,
)


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _autocast_state(tensors: Sequence[Tensor]) -> tuple[str, torch.dtype] | None:
    device_type = tensors[0].device.type if tensors else "cpu"
    if torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _is_plain_embedding(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Embedding) and type(layer).forward is nn.Embedding.forward


@register_grad_sample_backend("hooks")
class HooksBackend(GradSampleBackend):
    """Opacus' registered per-layer samplers only; any other trainable layer is an error.

    The strategy sets :attr:`batch_rows` to the row count of each training batch and turns
    :attr:`capturing` off outside ``training_step``; used on its own, the backend captures
    every forward that autograd records and takes each layer's rows from its input.
    """

    functorch_fallback: ClassVar[bool] = False

    def __init__(self, module: nn.Module, loss_reduction: str) -> None:
        super().__init__(module, loss_reduction)
        self._check(module)
        self.capturing = True
        """Whether forwards are captured (the strategy captures inside ``training_step`` only)."""
        self.batch_rows: int | None = None
        """Examples in the current batch; ``None`` takes each layer's input rows."""
        self._samplers: dict[nn.Module, GradSampler] = {}
        self._names = {m: name or "<root>" for name, m in module.named_modules()}
        self._grads: dict[nn.Parameter, Tensor] = {}
        self._handles: list[RemovableHandle] = []
        self._batch_major = batch_major_layers(module)
        for layer in self._layers(module):
            self._samplers[layer] = registered_sampler(layer) or functorch_grad_sample
            if _is_plain_embedding(layer):
                self._handles.append(layer.register_forward_pre_hook(self._expand_broadcast_batch))
            self._handles.append(layer.register_forward_hook(self._capture, with_kwargs=True))

    def _check(self, module: nn.Module) -> None:
        mixing = mixing_modules(module)
        if mixing:
            raise ValueError(
                f"Per-example clipping is undefined with modules that mix the examples of a batch: {mixing}. "
                "Replace BatchNorm with GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix(model) "
                "does it) and set track_running_stats=False on InstanceNorm."
            )
        check_embeddings(module)
        if owns_trainable(module):
            raise ValueError(
                f"{type(module).__name__} owns trainable parameters directly; per-example gradients are "
                "computed per submodule, so move them into a submodule (e.g. an nn.Module holding them)."
            )
        if self.functorch_fallback:
            return
        missing = modules_without_sampler(module, lambda m: registered_sampler(m) is not None)
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
        if owns and registered_sampler(module) is None:  # only with the functorch fallback
            return [module]
        return [module] * owns + [m for child in module.children() for m in self._layers(child)]

    @contextmanager
    def capture(self, rows: int | None) -> Any:
        """Capture the forwards of one training batch of ``rows`` examples."""
        self.capturing, self.batch_rows = True, rows
        try:
            yield
        finally:
            self.capturing = False

    def _recording(self, layer: nn.Module) -> bool:
        return self.capturing and torch.is_grad_enabled() and any(p.requires_grad for p in layer.parameters())

    def _expand_broadcast_batch(self, layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # Hugging Face's default position ids have shape [1, T] and are broadcast over the batch
        # *after* the embedding, where autograd sums the examples' gradients. Looking the ids up
        # once per example instead gives every example its own backprop; the output is the same.
        rows, ids = self.batch_rows, args[0] if args else None
        if not self._recording(layer) or not rows or rows <= 1 or not isinstance(ids, Tensor):
            return None
        if ids.dim() >= 2 and ids.shape[0] == 1:
            return (ids.expand(rows, *ids.shape[1:]), *args[1:])
        return None

    def _capture(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self._recording(layer):
            return
        outputs, _ = tree_flatten(output)
        slots = [i for i, t in enumerate(outputs) if isinstance(t, Tensor) and t.requires_grad]
        if not slots:
            return
        fold = self._rows_per_example(layer, args)
        call = LayerCall(
            args=tuple(_detach(a) for a in args),
            kwargs={k: _detach(v) for k, v in kwargs.items()},
            output_slots=slots,
            autocast=_autocast_state([t for t in args if isinstance(t, Tensor)]),
            fold=fold,
        )
        tensors = [outputs[i] for i in slots]
        if len(tensors) == 1:
            tensors[0].register_hook(lambda grad: self._on_output_grads(layer, call, [grad]))
        else:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._on_output_grads(layer, call, list(grads))
            )

    def _rows_per_example(self, layer: nn.Module, args: tuple[Any, ...]) -> int:
        """1, or m when a layer known to see batch-major flattened input has m rows per example."""
        first = next((a for a in args if isinstance(a, Tensor)), None)
        rows = self.batch_rows
        if rows is None or first is None or first.dim() == 0 or first.shape[0] == rows:
            return 1
        if layer in self._batch_major and rows > 0 and first.shape[0] % rows == 0:
            return first.shape[0] // rows
        raise RuntimeError(
            f"Layer '{self._names.get(layer, type(layer).__name__)}' ({type(layer).__name__}) was called with an "
            f"input of {first.shape[0]} rows (shape {list(first.shape)}) while the training batch has {rows} "
            "examples, so its per-example gradients cannot be told apart. Either the layer is fed sequence-first "
            "input (batch_first=False: the privacy unit must be the batch's first dimension), or the model "
            "broadcasts a batch dimension of 1 over the batch after this layer (a tensor of shape [1, ...] shared "
            "by all examples): pass that input with the batch dimension expanded to the batch size."
        )

    def _on_output_grads(self, layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> None:
        if call.fold > 1:
            call = call.folded()
            grads = [None if g is None else g.reshape(call.rows, -1, *g.shape[1:]) for g in grads]
        rows = self.batch_rows if self.batch_rows is not None else call.rows
        grads = [None if g is None else g.detach() for g in grads]
        if self.loss_reduction == "mean":  # undo the mean over the rows of the batch
            grads = [None if g is None else g * rows for g in grads]
        capturing, self.capturing = self.capturing, False  # the torch.func fallback replays the layer's forward
        try:
            per_example = self._samplers[layer](layer, call, grads)
        finally:
            self.capturing = capturing
        for p, gs in per_example.items():
            gs = gs[:rows]  # some samplers answer an empty batch with one row of zeros
            if p.requires_grad:  # a layer called twice, or a tied parameter: the contributions add up
                self._grads[p] = self._grads[p] + gs if p in self._grads else gs

    def pop(self, params: Sequence[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
        grads = {p: self._grads[p] for p in params if p in self._grads}
        self._grads.clear()
        return grads

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._samplers.clear()
        self._grads.clear()


@register_grad_sample_backend("functorch")
class FunctorchFallbackBackend(HooksBackend):
    """Registered samplers where they exist, ``torch.func`` per layer for the rest."""

    functorch_fallback: ClassVar[bool] = True
