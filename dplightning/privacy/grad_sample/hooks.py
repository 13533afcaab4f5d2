"""Per-example gradient capture on the model's own layers, with a clipping engine per layer.

The hooks are ours, written by hand because Opacus' plumbing cannot give what the
strategy needs:

* **Exact pairing of a call with its backward.** Opacus keeps each layer's inputs on a
  stack and pops one per module backward hook, so a layer called twice where one call is
  cut from the graph (``.detach()``), or a forward that is never backpropagated (a metric
  pass after the loss), pairs a backward with the wrong call's inputs. Here each call
  registers a hook on *its own output tensor*, holding its inputs in the hook's closure:
  the hook fires only if gradient reaches that output, and the inputs are freed with
  the graph when it does not.
* **No zero-filled copies, no per-parameter attributes.** Opacus stores every per-example
  gradient on a parameter attribute through a zero-filled copy (twice the memory traffic:
  a forward and backward of a 4x512 MLP at batch 64 took 0.38-0.44 s through its hooks
  and 0.18 s through these, one CPU thread). Here the engine's per-example gradients of
  one backward pass, factored or formed, are handed over and forgotten.
* **Capture by gradient, not by mode.** A trainable layer put in ``eval()`` (to turn off
  its dropout) still trains, so calls are captured whenever autograd records them.
* **Autograd's own weight gradients can be skipped.** The strategy may turn
  ``requires_grad`` off on the privatized parameters during the backward (the engines do
  not need autograd's ``p.grad``, only the layers' inputs and output gradients); a
  layer whose output would then not require gradient hands on a copy that does, made
  by an op so that in-place ops after the layer (``ReLU(inplace=True)``) still work
  (a layer whose output is a view hands on a copy too: see :func:`_hookable`; a stock
  ``nn.Linear`` or ``Conv1D`` on ``[n, T, d]`` instead hooks its own matmul's node, which
  needs no copy: see :func:`_matmul_node`).
  ``nn.TransformerEncoder``'s inference fast path (taken in ``eval()`` when nothing
  requires gradient) packs the batch into a nested tensor for its layers, so it is
  turned off while it runs a captured forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from dplightning.privacy.grad_sample.broadcast import broadcast_embeddings
from dplightning.privacy.grad_sample.engines import Engine, make_engine
from dplightning.privacy.grad_sample.grads import Dense, PerExampleGrad, add
from dplightning.privacy.grad_sample.samplers import LayerCall, batch_major_layers, example_rows
from dplightning.privacy.grad_sample.transforms import SlotTransform
from dplightning.privacy.grad_sample.validation import check_model, handled_per_layer, unit_parameters


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _autocast_state(tensors: Sequence[Tensor]) -> tuple[str, torch.dtype] | None:
    device_type = tensors[0].device.type if tensors else "cpu"
    if torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _input_shape(call: LayerCall) -> str:
    """The shape of the call's first tensor input, positional or (an ``nn.EmbeddingBag``'s ids) by keyword."""
    first = next((a for a in (*call.args, *call.kwargs.values()) if isinstance(a, Tensor)), None)
    return "no tensor input" if first is None else f"shape {list(first.shape)}"


def _is_plain_embedding(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Embedding) and type(layer).forward is nn.Embedding.forward


def _hookable(output: Tensor) -> Tensor | None:
    """A copy of ``output`` to hand on in its place, where a gradient hook on ``output`` itself would fail.

    * ``output`` does not require gradient (autograd's weight gradients are off and this is
      the first layer): a leaf made to require it, or a view of one, would refuse in-place
      ops after the layer (``ReLU(inplace=True)``: "a leaf Variable that requires grad is
      being used in an in-place operation"); its sum with a zero that requires gradient
      is neither.
    * ``output`` is a view (``nn.Linear`` on ``[n, T, d]``, ``InstanceNorm``): an in-place op
      on a view moves its history onto its base, and a hook on the view never fires.

    The layer's own output is freed as usual; the copy costs one elementwise pass.
    """
    if not output.requires_grad:
        return output + output.new_zeros((), requires_grad=True)
    if output._is_view():
        return output.clone()
    return None


_MATMUL_NODES = ("AddmmBackward0", "MmBackward0")


@functools.cache
def _stock_matmul_forwards() -> tuple[Callable[..., Any], ...]:
    """Forwards known to return a view of their own 2-D matmul on ``[n, T, d]`` input, with no other use of it."""
    forwards: list[Callable[..., Any]] = [nn.Linear.forward]
    try:  # GPT-2's Conv1D: addmm on the flattened input, viewed back
        from transformers.pytorch_utils import Conv1D

        forwards.append(Conv1D.forward)
    except ImportError:
        pass
    return tuple(forwards)


def _matmul_node(layer: nn.Module, output: Tensor) -> Any:
    """The autograd node of the matmul whose whole result ``output`` views, for a stock Linear or Conv1D; else ``None``.

    ``nn.Linear`` on ``[n, T, d]`` returns a view of its 2-D ``addmm`` product. A hook on the view
    misses the gradient once an op after the layer modifies the output in place (autograd then
    reroutes it through the base), which a copy of the output avoids at one elementwise pass
    (:func:`_hookable`: 0.08 of a 32 x 8,192-logit head's forward and backward on one CPU thread). The
    product's own node receives the gradient on both routes, and the product, made inside the
    stock forward, has no other use, so a pre-hook there sees exactly the output's gradient,
    without the copy. Only for the stock forwards (a subclass' may use the product again).
    """
    base = output._base
    if base is None or base.grad_fn is None or type(layer).forward not in _stock_matmul_forwards():
        return None
    if type(base.grad_fn).__name__ not in _MATMUL_NODES or base.numel() != output.numel():
        return None
    if not (base.is_contiguous() and output.is_contiguous()):
        return None
    return base.grad_fn


def _row_sums(grad: Tensor) -> Tensor:
    """Σ over each row of ``grad`` (its first dimension), fp64."""
    if grad.dim() < 2:
        return grad.double().reshape(-1)
    return grad.sum(dim=tuple(range(1, grad.dim())), dtype=torch.float64)


_FAST_PATH_LAYERS = (nn.TransformerEncoder,)
"""Layers whose ``eval()`` fast path, taken when nothing requires gradient, feeds their sub-layers nested
tensors (a padded batch packed without its padding). Transformer layers and attention skip their own
fast paths when hooks are attached to them."""


class PerExampleHooks:
    """Hooks on every layer owning a privatized parameter; hands over per-example gradients.

    Args:
        module: The model (the LightningModule itself): hooks go on its own submodules, so
            ``state_dict`` keys stay unchanged.
        params: The privatized parameters.
        engine: Name of the clipping engine (``"auto"``, ``"book_keeping"``, ``"instantiate"``).
        functorch_fallback: Differentiate layers without a per-example sampler with
            ``torch.func``; otherwise they are an error.
        transforms: Per-parameter linear maps applied to every per-example gradient
            (an optimizer's DP plan), inside the engine's representation.

    Raises:
        ValueError: For layers that mix examples or that no engine or sampler handles.
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[nn.Parameter],
        engine: str = "auto",
        functorch_fallback: bool = False,
        transforms: Mapping[nn.Parameter, SlotTransform] | None = None,
    ) -> None:
        self.params = set(params)
        check_model(module, self.params, functorch_fallback)
        self.engine: Engine = make_engine(engine, functorch_fallback)
        self.transforms = dict(transforms or {})
        self.capturing = True
        """Whether forwards are captured (the strategy captures inside ``training_step`` only)."""
        self.batch_rows: int | None = None
        """Rows of the current forward batch; ``None`` takes each layer's input rows."""
        self._names = {m: name or "<root>" for name, m in module.named_modules()}
        self._batch_major = batch_major_layers(module)
        self._grads: dict[nn.Parameter, list[PerExampleGrad]] = {}
        self._outstanding: dict[nn.Module, int] = {}
        self._calls: list[LayerCall] = []  # captured since the last pop, for forget_inputs
        self.on_layer_done: Callable[[nn.Module], None] | None = None
        """Called when the last captured call of a layer got its gradient (its parameters may be taken)."""
        self.fingerprint = False
        """Fingerprint every call's output gradients, for a replay of this backward pass (see :meth:`replay`)."""
        self.sink: Callable[[nn.Parameter, PerExampleGrad], None] | None = None
        self._fingerprinted = 0
        self._replayed = 0
        self._replay_differs: Tensor | None = None
        self._handles: list[RemovableHandle] = []
        self.layers = self._layers(module)
        """The hooked layers, each with its privatized parameters."""
        broadcast = broadcast_embeddings(module)
        for layer in self.layers:
            if _is_plain_embedding(layer) and layer in broadcast:
                self._handles.append(layer.register_forward_pre_hook(self._expand_broadcast_batch))
            self._handles.append(layer.register_forward_hook(self._capture, with_kwargs=True))
        self._fast_path: list[bool] = []
        for m in module.modules():
            if isinstance(m, _FAST_PATH_LAYERS) and any(p in self.params for p in m.parameters()):
                self._handles.append(m.register_forward_pre_hook(self._no_fast_path))
                self._handles.append(m.register_forward_hook(self._restore_fast_path, always_call=True))

    def _layers(self, module: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
        """Modules owning privatized parameters; a layer only ``torch.func`` handles covers its subtree."""
        layers: dict[nn.Module, list[nn.Parameter]] = {}

        def visit(m: nn.Module) -> None:
            own = unit_parameters(m, self.params)
            if own and not handled_per_layer(m):
                layers[m] = [p for p in m.parameters() if p in self.params]
                return
            if own:
                layers[m] = own
            for child in m.children():
                visit(child)

        visit(module)
        return layers

    def summary(self) -> list[tuple[str, str, int, str]]:
        """``(layer, type, privatized parameters, engine)`` for every hooked layer."""
        return [
            (self._names.get(m, "?"), type(m).__name__, sum(p.numel() for p in ps), self.engine.describe(m))
            for m, ps in self.layers.items()
        ]

    @contextmanager
    def capture(self, rows: int | None) -> Iterator[None]:
        """Capture the forwards of one training batch with ``rows`` forward rows."""
        self.capturing, self.batch_rows = True, rows
        try:
            yield
        finally:
            self.capturing = False

    def _recording(self, layer: nn.Module) -> bool:
        return self.capturing and torch.is_grad_enabled() and layer in self.layers

    def _no_fast_path(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        self._fast_path.append(torch.backends.mha.get_fastpath_enabled())
        if self.capturing and torch.is_grad_enabled():
            torch.backends.mha.set_fastpath_enabled(False)

    def _restore_fast_path(self, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._fast_path:
            torch.backends.mha.set_fastpath_enabled(self._fast_path.pop())

    def _expand_broadcast_batch(self, layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # Exact only for the declared embeddings whose [1, T] lookup is added to a batch-first
        # tensor (see broadcast.py): each example then backpropagates into its own copy.
        rows, ids = self.batch_rows, args[0] if args else None
        if not self._recording(layer) or not rows or rows <= 1 or not isinstance(ids, Tensor):
            return None
        if ids.dim() >= 2 and ids.shape[0] == 1:
            return (ids.expand(rows, *ids.shape[1:]), *args[1:])
        return None

    def _capture(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not self._recording(layer):
            return None
        outputs, spec = tree_flatten(output)
        slots = [i for i, t in enumerate(outputs) if isinstance(t, Tensor) and t.is_floating_point()]
        if not slots:
            return None
        replaced = False
        node = _matmul_node(layer, outputs[slots[0]]) if len(slots) == 1 else None
        for i in slots if node is None else ():
            copy = _hookable(outputs[i])
            if copy is not None:
                outputs[i], replaced = copy, True
        call = LayerCall(
            args=tuple(_detach(a) for a in args),
            kwargs={k: _detach(v) for k, v in kwargs.items()},
            output_slots=slots,
            autocast=_autocast_state([t for t in args if isinstance(t, Tensor)]),
        )
        call.examples = example_rows(layer, call)
        call.fold = self._rows_per_example(layer, call)
        self._calls.append(call)
        tensors = [outputs[i] for i in slots]
        self._outstanding[layer] = self._outstanding.get(layer, 0) + 1
        if node is not None:
            shape = tensors[0].shape
            node.register_prehook(
                lambda grads: self._on_output_grads(
                    layer, call, [None if grads[0] is None else grads[0].reshape(shape)]
                )
            )
        elif len(tensors) == 1:
            tensors[0].register_hook(lambda grad: self._on_output_grads(layer, call, [grad]))
        else:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._on_output_grads(layer, call, list(grads))
            )
        return tree_unflatten(outputs, spec) if replaced else None

    def _rows_per_example(self, layer: nn.Module, call: LayerCall) -> int:
        """1, or m when a layer known to see batch-major flattened input has m rows per example."""
        first = next((a for a in call.args if isinstance(a, Tensor)), None)
        rows, seen = self.batch_rows, call.rows
        if rows is None or seen == rows:
            return 1
        if call.examples is None and (first is None or first.dim() == 0):
            # The samplers (and the torch.func replay) split the call by its first positional tensor.
            raise RuntimeError(
                f"Layer '{self._names.get(layer, type(layer).__name__)}' ({type(layer).__name__}) was called without "
                f"a positional tensor input whose first dimension is the batch ({rows} examples), so its per-example "
                "gradients cannot be formed. Pass its input positionally: layer(x), not layer(input=x)."
            )
        if layer in self._batch_major and rows > 0 and seen % rows == 0 and call.examples is None:
            return seen // rows
        raise RuntimeError(
            f"Layer '{self._names.get(layer, type(layer).__name__)}' ({type(layer).__name__}) was called with an "
            f"input of {seen} rows ({_input_shape(call)}) while the training batch has {rows} "
            "examples, so its per-example gradients cannot be told apart. Either the model carries state from an "
            "earlier batch into this one (e.g. an RNN hidden state kept in self.hidden between batches: stateful "
            "models are not supported, since the state holds other examples' data; start every batch from a fresh "
            "state), or the layer is fed sequence-first "
            "input (batch_first=False: the privacy unit must be the batch's first dimension), or the model "
            "broadcasts a batch dimension of 1 over the batch after this layer (a tensor of shape [1, ...] shared "
            "by all examples): pass that input with the batch dimension expanded to the batch size (for an "
            "embedding whose [1, ...] lookup is added to a batch-first tensor, see "
            "dplightning.privacy.grad_sample.register_broadcast_embedding)."
        )

    @contextmanager
    def _engine_view(self, layer: nn.Module) -> Iterator[None]:
        # Samplers skip parameters without requires_grad, which the strategy may have turned off;
        # and the torch.func fallback replays the layer's forward, which must not be captured again.
        params = self.layers[layer]
        flags = [p.requires_grad for p in params]
        capturing, self.capturing = self.capturing, False
        for p in params:
            p.requires_grad_(True)
        try:
            yield
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
            self.capturing = capturing

    def _on_output_grads(self, layer: nn.Module, call: LayerCall, grads: list[Tensor | None]) -> None:
        grads = [None if g is None else g.detach() for g in grads]
        if self.fingerprint or self.sink is not None:
            self._check_replay(call, grads)
        if call.fold > 1:
            fold, call = call.fold, call.folded()  # the fold is explicit: an empty batch cannot infer it
            grads = [None if g is None else g.reshape(g.shape[0] // fold, fold, *g.shape[1:]) for g in grads]
        with self._engine_view(layer):
            per_example = self.engine.grads(layer, call, grads)
        rows = self.batch_rows if self.batch_rows is not None else call.rows
        for p, g in per_example.items():
            if p not in self.params:
                continue
            if isinstance(g, Dense) and g.rows != rows:  # some samplers answer an empty batch with one row of zeros
                g = Dense(g.value[:rows])
            if p in self.transforms:
                g = self.engine.settle(self.transforms[p].apply(g))
            if self.sink is not None:
                self.sink(p, g)
            else:
                self._grads.setdefault(p, []).append(g)
        if self.sink is not None:
            return
        self._outstanding[layer] -= 1
        if self._outstanding[layer] == 0 and self.on_layer_done is not None:
            self.on_layer_done(layer)

    def _check_replay(self, call: LayerCall, grads: list[Tensor | None]) -> None:
        # Σ over each example's output gradient, bit for bit: a replay whose backward differs from the
        # first pass' (a nondeterministic kernel) would weight gradients by factors taken from others.
        prints = [_row_sums(g) for g in grads if g is not None]
        if self.sink is None:
            call.fingerprint = prints
            self._fingerprinted += 1
            return
        self._replayed += 1
        first, call.fingerprint = call.fingerprint, None
        if first is None or [a.shape for a in first] != [b.shape for b in prints]:
            differs = torch.ones((), dtype=torch.bool)
        elif not prints:  # no gradient reached the call's outputs, in either pass: nothing to compare
            return
        else:  # bitwise, NaN included
            differs = torch.stack([(a.view(torch.int64) != b.view(torch.int64)).any() for a, b in zip(first, prints)])
            differs = differs.any()
        self._replay_differs = differs if self._replay_differs is None else self._replay_differs | differs

    @contextmanager
    def replay(self, sink: Callable[[nn.Parameter, PerExampleGrad], None]) -> Iterator[None]:
        """Hand every call's per-example gradients to ``sink`` during a replayed backward pass.

        The first pass must have run with :attr:`fingerprint` on. Nothing is kept and no layer is
        marked done; on exit the replay is checked to have met every call of the first pass with
        the same output gradients.

        Raises:
            RuntimeError: If the replayed backward pass differed from the first.
        """
        self.sink, self._replayed, self._replay_differs = sink, 0, None
        try:
            yield
        finally:
            self.sink, self.fingerprint = None, False
        fingerprinted, self._fingerprinted = self._fingerprinted, 0
        differs = self._replay_differs is not None and bool(self._replay_differs)
        if differs or self._replayed != fingerprinted:
            raise RuntimeError(
                f"The replayed backward pass (clip_replay=True) differed from the first: {self._replayed} layer calls "
                f"got a gradient against {fingerprinted}"
                + (", and some output gradients changed" if differs else "")
                + ". The replay's clipped sum would be weighted by another pass' norms; the step is refused. The "
                "backward pass must be deterministic (on a GPU: torch.use_deterministic_algorithms(True), or "
                "Trainer(deterministic=True)) and LightningModule.backward must pass its arguments on to "
                "loss.backward; or leave clip_replay off."
            )

    def forget_inputs(self) -> None:
        """Drop the inputs of every call captured since the last :meth:`pop` (their gradients are taken).

        A call's hook holds its layer's inputs in its closure, which lives on the graph as long as the
        loss does (Lightning keeps it to the end of the step), so every layer's input would outlive its
        use: through the coupling probe's second forward and the optimizer step. A factored gradient
        keeps its own reference to what it needs. Only for a graph no further backward pass can reach
        (automatic optimization: one backward per graph); a hook that fires after this would fail.
        """
        for call in self._calls:
            call.args, call.kwargs = (), {}
        self._calls.clear()

    def take(self, params: Sequence[nn.Parameter], rows_per_unit: int = 1) -> dict[nn.Parameter, PerExampleGrad]:
        """The per-example gradients of ``params`` captured so far, per privacy unit; they are forgotten."""
        return {p: add(self._grads.pop(p)).units(rows_per_unit) for p in params if p in self._grads}

    def pop(self, rows_per_unit: int = 1) -> dict[nn.Parameter, PerExampleGrad]:
        """The per-example gradients of everything captured since the last pop, per privacy unit.

        A layer called several times, a parameter shared by layers, and several backward
        passes add up; ``rows_per_unit`` consecutive rows form one unit and add up too.
        """
        grads = {p: add(parts).units(rows_per_unit) for p, parts in self._grads.items()}
        self._grads.clear()
        self._calls.clear()
        self._outstanding.clear()  # calls whose output got no gradient (cut from the graph) are forgotten
        self.fingerprint, self._fingerprinted = False, 0
        return grads

    def close(self) -> None:
        """Remove every hook the capture added to the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._grads.clear()
        self._calls.clear()
