"""Checks that a model can be trained with per-example clipping, naming what cannot."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn
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


def owns_trainable(module: nn.Module) -> bool:
    """Whether ``module`` has trainable parameters of its own, not aliases of a child's.

    Opacus' ``DPLSTM`` re-registers its ``RNNLinear`` children's weights under
    ``nn.LSTM``'s names; those children, not the wrapper, compute them.
    """
    children = {id(p) for child in module.children() for p in child.parameters()}
    return any(p.requires_grad and id(p) not in children for p in module.parameters(recurse=False))


def modules_without_sampler(module: nn.Module, has_sampler: Callable[[nn.Module], bool]) -> list[str]:
    """Names (and types) of modules owning trainable parameters that no sampler handles."""
    return [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if owns_trainable(m) and not has_sampler(m)
    ]


def check_embeddings(module: nn.Module) -> None:
    """Refuse trainable embeddings whose gradient couples the examples or is sparse.

    ``scale_grad_by_freq`` divides each token's gradient by its count in the whole batch,
    so one example's gradient depends on the others; ``sparse`` gradients bypass the
    dense buckets the noise is added to.
    """
    for name, m in module.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or not m.weight.requires_grad:
            continue
        if m.scale_grad_by_freq:
            raise ValueError(
                f"Embedding '{name}' has scale_grad_by_freq=True: each example's gradient would depend on the token "
                "counts of the whole batch, so per-example clipping does not bound one example. Set it to False."
            )
        if m.sparse:
            raise ValueError(f"Embedding '{name}' has sparse=True; DP training needs dense gradients. Set it to False.")


def warn_on_batch_mean_loss(module: nn.Module, training: Callable[[], bool]) -> list[RemovableHandle]:
    """Warn once if a Hugging Face model computes its own loss (``labels=``) while DP training.

    Hugging Face's built-in loss averages over all target tokens of the batch, so one
    example's gradient depends on the other examples' lengths: rows are then not
    independent privacy units. The warning names the per-example form to use instead.

    Args:
        module: The LightningModule.
        training: Whether the strategy is inside ``training_step`` (validation may use ``labels=``).

    Returns:
        Handles of the hooks, to remove at teardown.
    """
    hf = sys.modules.get("transformers")
    if hf is None:  # only models built with transformers can take this path
        return []
    warned = False

    def check(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal warned
        if warned or kwargs.get("labels") is None or not training():
            return
        warned = True
        warnings.warn(
            f"{type(layer).__name__} was called with labels=: Hugging Face's built-in loss averages over all tokens "
            "of the batch, so each example's gradient depends on the other examples' lengths and one example is "
            "no longer one privacy unit of bounded influence. Compute the loss per example (the mean over each "
            "example's own target tokens), then average over the batch: see dplightning's per-example loss "
            "contract in docs/dp_sgd_core.md.",
            stacklevel=2,
        )

    pretrained = getattr(hf, "PreTrainedModel", ())
    outermost = [m for m in module.modules() if isinstance(m, pretrained)][:1]
    return [m.register_forward_pre_hook(check, with_kwargs=True) for m in outermost]
