"""Per-example gradients for Hugging Face's ``Conv1D`` (GPT-2's linear layer).

``transformers.pytorch_utils.Conv1D`` computes ``y = x @ W + b`` with ``W`` stored as
``[in_features, out_features]`` (transposed with respect to ``nn.Linear``). Opacus has
no sampler for it, and the functorch fallback would re-run the layer per example.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def compute_conv1d_grad_sample(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-example ``[n, in, out]`` weight and ``[n, out]`` bias gradients of a ``Conv1D``.

    Args:
        layer: The ``Conv1D`` module.
        activations: Its captured inputs; ``activations[0]`` is ``[n, ..., in]``.
        backprops: Gradients of its output, ``[n, ..., out]``.
    """
    a = activations[0]
    a3 = a.reshape(a.shape[0], -1, a.shape[-1])  # [n, T, in]
    b3 = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])  # [n, T, out]
    grads: dict[nn.Parameter, Tensor] = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = torch.einsum("nti,nto->nio", a3, b3.to(a3.dtype))
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = b3.sum(dim=1)
    return grads


def register_conv1d() -> bool:
    """Register the sampler with Opacus if ``transformers`` is installed; return whether it is."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional at import time
        return False
    from opacus.grad_sample import register_grad_sampler

    register_grad_sampler(Conv1D)(compute_conv1d_grad_sample)
    return True
