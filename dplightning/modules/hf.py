"""Moved to :mod:`dplightning.models.hf` (issue 26: model builders are not LightningModules); still importable here."""

from dplightning.models.hf import (
    LoraSettings,
    apply_lora,
    build_config,
    from_pretrained,
    lora_settings,
    max_positions,
    resolve_package_path,
)

__all__ = [
    "LoraSettings",
    "apply_lora",
    "build_config",
    "from_pretrained",
    "lora_settings",
    "max_positions",
    "resolve_package_path",
]
