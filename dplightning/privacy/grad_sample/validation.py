"""Checks that a model can be trained with per-example clipping, naming what cannot."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils.hooks import RemovableHandle


def mixing_modules(module: nn.Module) -> list[str]:
    """Names of modules that mix examples of a batch or store statistics of private data.

    BatchNorm normalises with batch statistics (per-example gradients are undefined)
    and InstanceNorm with ``track_running_stats`` writes running statistics of the
    private data into buffers that would be released unprotected.
    """
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) or (isinstance(m, _InstanceNorm) and m.track_running_stats)
    ]


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters registered on ``module`` itself that are not aliases of a child's.

    Opacus' ``DPLSTM`` re-registers its ``RNNLinear`` children's weights under
    ``nn.LSTM``'s names; those children, not the wrapper, compute them.
    """
    children = {id(p) for child in module.children() for p in child.parameters()}
    return [p for p in module.parameters(recurse=False) if id(p) not in children]


def handled_per_layer(module: nn.Module) -> bool:
    """Whether a registered sampler or an engine's factorisation covers ``module``'s own parameters."""
    from dplightning.privacy.grad_sample.engines import factored_kind
    from dplightning.privacy.grad_sample.samplers import registered_sampler

    return registered_sampler(module) is not None or factored_kind(module) is not None


_LINEAR_CROSS_ENTROPY: tuple[type[nn.Module], ...] = tuple(filter(None, [getattr(nn, "LinearCrossEntropyLoss", None)]))
_USES_CHILDREN_WEIGHTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, *_LINEAR_CROSS_ENTROPY)
"""Layers whose forward reads their children's weights (``out_proj.weight``) without calling the children."""


def unit_parameters(module: nn.Module, params: Collection[nn.Parameter]) -> list[nn.Parameter]:
    """The privatized parameters that ``module``'s own forward computes with.

    Its own parameters, and those of its whole subtree for a layer that reads its
    children's weights without calling them (a hook on such a child would never fire).
    """
    scope = module.parameters() if isinstance(module, _USES_CHILDREN_WEIGHTS) else own_parameters(module)
    return [p for p in scope if p in params]


_SEQUENCE_FIRST = (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                   nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)  # fmt: skip


def _refusal(module: nn.Module) -> str | None:
    """Why per-example gradients of a layer holding privatized parameters are refused, if they are."""
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
        return (
            "its fused kernel has no per-example sampler, torch.func cannot replay GRU/RNN cells per example, and "
            "its initial state (batch in dim 1) would not be split by example; use opacus.layers.DPLSTM/DPGRU/DPRNN "
            "(same parameter names; cells: opacus.layers.dp_rnn.DPLSTMCell/DPGRUCell/DPRNNCell), whose gates are "
            "nn.Linear layers"
        )
    if isinstance(module, nn.AdaptiveLogSoftmaxWithLoss):
        return (
            "it calls its tail layers on the subset of the batch whose targets fall in each cluster and returns the "
            "batch's mean loss, so no layer sees one row per example; use an nn.Linear head and a per-example loss"
        )
    if isinstance(module, _LINEAR_CROSS_ENTROPY) and module.reduction != "none":
        return f"reduction={module.reduction!r} reduces over the batch; use reduction='none' and reduce per example"
    if isinstance(module, _SEQUENCE_FIRST) and not _batch_first(module):
        return "batch_first=False feeds it sequence-first input; the privacy unit must be the first dimension"
    return None


def _batch_first(module: nn.Module) -> bool:
    attention = [m for m in module.modules() if isinstance(m, nn.MultiheadAttention)]
    return all(m.batch_first for m in attention)


def refused_layers(module: nn.Module, params: Collection[nn.Parameter]) -> list[str]:
    """``name (type): reason`` for every outermost layer holding privatized parameters that no engine can handle."""
    refused: list[str] = []
    inside: set[nn.Module] = set()
    for name, m in module.named_modules():
        if m in inside or not any(p in params for p in m.parameters()):
            continue
        reason = _refusal(m)
        if reason is not None:
            refused.append(f"{name or '<root>'} ({type(m).__name__}): {reason}")
            inside.update(m.modules())
        lazy = [n for n, p in m.named_parameters(recurse=False) if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            refused.append(
                f"{name or '<root>'} ({type(m).__name__}): its parameters {lazy} are not initialized yet (a lazy "
                "layer); run one forward pass before fitting (e.g. in configure_model or __init__)"
            )
    return refused


def check_model(module: nn.Module, params: Collection[nn.Parameter], functorch_fallback: bool) -> None:
    """Raise, naming the modules and the fix, if ``module`` cannot be trained with per-example clipping.

    Args:
        module: The model.
        params: The parameters to privatize.
        functorch_fallback: Whether layers without a sampler may be differentiated by ``torch.func``.
    """
    mixing = mixing_modules(module)
    if mixing:
        kinds = sorted({type(m).__name__ for name, m in module.named_modules() if (name or type(m).__name__) in mixing})
        raise ValueError(
            f"Per-example clipping is undefined with modules that mix the examples of a batch: {mixing} "
            f"({', '.join(kinds)}). "
            "Replace BatchNorm with GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix(model) "
            "does it) and set track_running_stats=False on InstanceNorm."
        )
    check_embeddings(module)
    check_no_gradient_checkpointing(module)
    refused = refused_layers(module, params)
    if refused:
        raise ValueError("Per-example gradients cannot be computed for these layers:\n  " + "\n  ".join(refused))
    if any(p in params for p in own_parameters(module)):
        raise ValueError(
            f"{type(module).__name__} owns trainable parameters directly; per-example gradients are "
            "computed per submodule, so move them into a submodule (e.g. an nn.Module holding them)."
        )
    if functorch_fallback:
        return
    unhandled = [
        (name, m) for name, m in module.named_modules() if unit_parameters(m, params) and not handled_per_layer(m)
    ]
    if unhandled:
        missing = [f"{name or '<root>'} ({type(m).__name__})" for name, m in unhandled]
        raise ValueError(
            f"No per-example gradient sampler for these modules with trainable parameters: {missing}. "
            "Replace them (nn.LSTM/GRU/RNN -> opacus.layers.DPLSTM/DPGRU/DPRNN, nn.MultiheadAttention -> "
            "opacus.layers.DPMultiheadAttention), register a sampler with "
            "opacus.grad_sample.register_grad_sampler, freeze them, or pass grad_sample_mode='functorch' "
            "to differentiate them per example with torch.func." + _attention_conditions([m for _, m in unhandled])
        )


def _attention_conditions(unhandled: list[nn.Module]) -> str:
    """What each of the two ways out of an unhandled ``nn.MultiheadAttention`` requires (empty if there is none).

    Both are named up front so that the advice does not lead into the next error: Opacus'
    ``DPMultiheadAttention`` (1.6) asserts ``is_causal=False`` and, with ``batch_first=True``,
    checks an ``attn_mask``'s size against the batch dimension; the torch.func replay refuses
    layers that draw random numbers (attention dropout in training mode).
    """
    attention = [m for m in unhandled if isinstance(m, nn.MultiheadAttention)]
    if not attention:
        return ""
    dropout = sorted({m.dropout for m in attention if m.dropout > 0})
    yours = f"; yours have dropout={', '.join(map(str, dropout))}" if dropout else ""
    return (
        " For nn.MultiheadAttention each way has a condition: opacus.layers.DPMultiheadAttention has no causal "
        "mask (its forward asserts is_causal=False, and with batch_first=True it checks an attn_mask's size "
        "against the batch size), so it fits unmasked encoders but not a causal decoder (nn.TransformerDecoder, "
        "tgt_mask); grad_sample_mode='functorch' takes any mask but refuses a layer that draws random numbers, "
        f"so the attention's dropout must be 0 in training (e.g. nn.TransformerDecoderLayer(..., dropout=0.0){yours}; "
        "dropout modules elsewhere are fine)."
    )


def check_no_gradient_checkpointing(module: nn.Module) -> None:
    """Refuse activation (gradient) checkpointing, Hugging Face's or any module's flag for it.

    Per-example gradients are formed from each layer's input activation and output
    gradient, captured when the training step runs the forward. Reentrant checkpointing
    runs that forward without autograd and recomputes it inside the backward pass, where
    nothing is captured; non-reentrant checkpointing would work only by keeping every
    layer's input alive, which is exactly the memory it was meant to save.
    """
    on = [name or "<root>" for name, m in module.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        raise NotImplementedError(
            f"Gradient checkpointing is on ({', '.join(on[:3])}): per-example gradients need each "
            "layer's input activation from the training forward, which checkpointing discards and recomputes "
            "inside the backward pass, where the per-example hooks cannot capture it (and keeping them would "
            "undo its memory saving). Call model.gradient_checkpointing_disable(); fit memory with a smaller "
            "physical batch and accumulate_grad_batches (exact under DP), LoRA, or book_keeping clipping."
        )


def check_embeddings(module: nn.Module) -> None:
    """Refuse embeddings that write the batch into their weights; trainable ones with coupled or sparse gradients.

    ``max_norm`` rescales, in place and outside any gradient, the rows the batch looks
    up: which rows were rescaled tells which tokens the private data held, trainable or
    frozen. ``scale_grad_by_freq`` divides each token's gradient by its count in the whole
    batch, so one example's gradient depends on the others; ``sparse`` gradients bypass
    the dense buckets the noise is added to.
    """
    for name, m in module.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        if m.max_norm is not None:
            raise ValueError(
                f"{type(m).__name__} '{name}' has max_norm={m.max_norm}: its forward rescales, in place, the rows the "
                "batch looks up, a change of the weights that depends on the private data and bypasses the noise. "
                "Set max_norm=None (renormalising every row after the optimizer step depends on released values only)."
            )
        if not m.weight.requires_grad:
            continue
        if m.scale_grad_by_freq:
            raise ValueError(
                f"Embedding '{name}' has scale_grad_by_freq=True: each example's gradient would depend on the token "
                "counts of the whole batch, so per-example clipping does not bound one example. Set it to False."
            )
        if m.sparse:
            raise ValueError(f"Embedding '{name}' has sparse=True; DP training needs dense gradients. Set it to False.")


EXAMPLE_MEAN_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForMultipleChoice")
"""Hugging Face heads whose built-in loss (``labels=``) is a mean over the examples, one term each."""

_PER_EXAMPLE_LM_LOSS = """
    logits = model(input_ids=ids, attention_mask=mask).logits
    targets = labels[:, 1:]                                  # causal LM: predict the next token
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none", ignore_index=-100)
    counted = (targets != -100).float()
    per_example = (per_token * counted).sum(1) / counted.sum(1).clamp(min=1)  # each example's own token mean
    loss = per_example.sum() / max(len(per_example), 1)     # then the mean over the batch
"""


def refuse_batch_mean_loss(module: nn.Module, training: Callable[[], bool]) -> list[RemovableHandle]:
    """Refuse a Hugging Face model's built-in loss (``labels=``) in a training step where it couples the examples.

    The built-in loss of language-model, token-classification and question-answering heads
    averages over every counted target of the batch, so one example's gradient is scaled
    by one over the batch's total count: removing one long example changes every other
    example's contribution, and per-example clipping bounds nothing. Heads in
    :data:`EXAMPLE_MEAN_HEADS` average one term per example and are allowed, unless their
    labels hold negative (ignored) entries, which make the mean run over the remaining
    examples only.

    Args:
        module: The LightningModule.
        training: Whether the strategy is inside ``training_step`` (validation may use ``labels=``).

    Returns:
        Handles of the hooks, to remove at teardown.

    Raises:
        ValueError: From the hook, before the model's forward runs, naming the per-example form.
    """
    hf = sys.modules.get("transformers")
    if hf is None:  # only models built with transformers can take this path
        return []

    def check(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        labels = kwargs.get("labels")
        if labels is None or not training():
            return
        name = type(layer).__name__
        if name.endswith(EXAMPLE_MEAN_HEADS):
            if not (isinstance(labels, Tensor) and not labels.is_floating_point() and bool((labels < 0).any())):
                return
            reason = "its labels hold ignored (negative) entries, so its mean runs over the other examples only"
        else:
            reason = "its built-in loss averages over all counted target tokens of the batch"
        raise ValueError(
            f"{name} was called with labels= in training_step: {reason}, so each example's gradient depends on the "
            "other examples and one example is no longer a privacy unit of bounded influence. Compute the loss per "
            f"example (each example's own mean), then average over the batch:\n{_PER_EXAMPLE_LM_LOSS}"
            "(dplightning.tasks.causal_lm.per_example_token_mean does this; see the per-example loss contract in "
            "docs/dp_sgd_core.md)."
        )

    pretrained = getattr(hf, "PreTrainedModel", ())
    outermost = [m for m in module.modules() if isinstance(m, pretrained)][:1]
    return [m.register_forward_pre_hook(check, with_kwargs=True) for m in outermost]
