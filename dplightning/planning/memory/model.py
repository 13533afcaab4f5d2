"""The module's model on the ``meta`` device (no weights, no memory), from its config, with its LoRA adapters."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dplightning.planning.memory.settings import (
    Settings,
)


def model_config(model_args: Mapping[str, Any]) -> tuple[Any, str]:
    """The ``transformers`` config of the module's model and where it came from."""
    from transformers import AutoConfig

    from dplightning.models.hf import build_config
    from dplightning.planning.published import published_config

    extra = dict(model_args.get("model_kwargs") or {})
    if model_args.get("config") is not None:
        return build_config(model_args["config"]), "config mapping in the YAML"
    name = model_args.get("pretrained")
    if name is None:
        raise ValueError("The model section has neither `pretrained` nor `config`: nothing to plan.")
    folder = os.path.expanduser(str(name))
    if os.path.isdir(folder):
        return AutoConfig.from_pretrained(folder, local_files_only=True, **extra), f"config.json in {folder}"
    known = published_config(str(name))
    if known is not None:
        return build_config(known[1]), f"published config of {known[0]} (dplightning.planning.published)"
    try:
        return AutoConfig.from_pretrained(str(name), local_files_only=True, **extra), "Hugging Face cache"
    except OSError as error:
        raise ValueError(
            f"{name!r} is not a local folder, not in the Hugging Face cache and not in the published table; "
            "pass `config: {model_type: ...}` or a local folder."
        ) from error


def meta_model(settings: Settings) -> tuple[Any, str]:
    """The module's model with its LoRA adapters, on the meta device, and the config's source."""
    import torch
    import transformers

    from dplightning.models.hf import apply_lora, lora_settings

    classifier = settings.model_class.rsplit(".", 1)[-1] == "DPSequenceClassifier"
    config, source = model_config(settings.model_args)
    if classifier:
        config.num_labels = int(settings.model_args.get("num_labels", 2))
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
        lora = lora_settings(settings.model_args.get("lora"))
        if lora is not None:
            train_head = bool(settings.model_args.get("train_head", True))
            model = apply_lora(model, lora, "SEQ_CLS" if classifier else "CAUSAL_LM", train_head)
    return model, source
