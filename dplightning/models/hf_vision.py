"""A Hugging Face image classifier built from a config, as a plain network returning logits."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


class HFImageClassifier(nn.Module):
    """``AutoModelForImageClassification`` with random weights from a config; ``forward(images) -> logits``.

    Lets :class:`~dplightning.tasks.ImageClassifier` train a Hugging Face vision model (ViT)
    from a YAML config, e.g. ``config: {model_type: vit, image_size: 8, patch_size: 2,
    num_channels: 1, num_labels: 10, hidden_dropout_prob: 0.0}``. Per-example gradients of
    ViT's [CLS] token and position embeddings need ``hidden_dropout_prob: 0``.

    Args:
        config: A ``transformers`` config, ``{"model_type": ..., **fields}`` or
            ``{"class_path": ..., "init_args": ...}``.
    """

    def __init__(self, config: Any) -> None:
        from transformers import AutoModelForImageClassification  # imported lazily: transformers is slow to import

        from dplightning.models.hf import build_config

        super().__init__()
        self.model = AutoModelForImageClassification.from_config(build_config(config))

    def forward(self, images: Tensor) -> Tensor:
        return self.model(pixel_values=images).logits
