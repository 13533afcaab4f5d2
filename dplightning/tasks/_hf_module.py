"""The LightningModule template shared by the Hugging Face task modules.

Subclasses name their ``AutoModel`` class and peft task type and implement the steps;
this base builds the model (pretrained or from a config, with optional LoRA), takes the
tokenizer from the DataModule, checks sequence lengths against the model's positions,
and keeps what an export needs (the model config and tokenizer) in every checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn

from dplightning.models.hf import LoraSettings, apply_lora, build_config, from_pretrained, lora_settings, max_positions

CLASS_KEY = "dplightning_hf_module"
CONFIG_KEY = "dplightning_hf_config"
TOKENIZER_KEY = "dplightning_hf_tokenizer"


class HFModule(pl.LightningModule):
    """Base of :class:`DPSequenceClassifier` and :class:`DPCausalLM` (see their docs).

    Args:
        pretrained: Hub name or local folder for ``from_pretrained`` (a local folder never
            touches the network).
        config: A ``transformers`` config, ``{"model_type": ..., **fields}`` or
            ``{"class_path": ..., "init_args": ...}``: random weights.
        lora: peft LoRA settings ``{r, alpha, dropout, target_modules}``; only the adapters
            (and the head, see ``train_head``) are trained.
        train_head: With LoRA, also train the task head (classifiers only).
        optimizer: Optimizer factory over the trainable parameters (default AdamW, lr 5e-4).
        model_kwargs: Extra keyword arguments for ``from_pretrained`` / the config.
    """

    auto_class: ClassVar[str]
    task_type: ClassVar[str]

    def __init__(
        self,
        pretrained: str | None = None,
        config: Any = None,
        lora: LoraSettings | Mapping[str, Any] | None = None,
        train_head: bool = True,
        optimizer: OptimizerCallable | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if (pretrained is None) == (config is None):
            raise ValueError("Give exactly one of `pretrained` (hub name or local folder) and `config`.")
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer = optimizer
        self.lora = lora_settings(lora)
        model = self._build(pretrained, config, dict(model_kwargs or {}))
        self.max_positions = max_positions(model.config)
        model.train()  # from_pretrained returns eval mode, and Lightning keeps submodules' modes: dropout on
        self.model = apply_lora(model, self.lora, self.task_type, train_head) if self.lora else model
        self.tokenizer: Any = None

    # ------------------------------------------------------------------ building

    def _model_overrides(self) -> dict[str, Any]:
        """Config fields the task fixes (e.g. ``num_labels``)."""
        return {}

    def _build(self, pretrained: str | None, config: Any, kwargs: dict[str, Any]) -> nn.Module:
        import transformers

        auto = getattr(transformers, self.auto_class)
        overrides = {**self._model_overrides(), **kwargs}
        if pretrained is not None:
            return from_pretrained(auto, pretrained, **overrides)
        built = build_config(config)
        for name, value in overrides.items():
            setattr(built, name, value)
        return auto.from_config(built)

    @property
    def base_model(self) -> nn.Module:
        """The ``transformers`` model without the peft wrapper."""
        return self.model.get_base_model() if self.lora else self.model

    # ------------------------------------------------------------------ data

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None:
            self.use_tokenizer(tokenizer)
        limit = getattr(datamodule, "max_length", None)
        if self.max_positions is not None and isinstance(limit, int) and limit > self.max_positions:
            raise ValueError(
                f"The DataModule's max_length {limit} exceeds the model's {self.max_positions} positions: longer "
                f"examples cannot be processed whole. Set data max_length <= {self.max_positions}."
            )

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Check ``tokenizer`` against the model's vocabulary and adopt its special tokens."""
        rows = self.base_model.get_input_embeddings().weight.shape[0]
        if len(tokenizer) > rows:
            raise ValueError(
                f"The tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows}: set the model "
                f"config's vocab_size to at least {len(tokenizer)} (or the DataModule's vocab_size lower)."
            )
        model = self.base_model
        from_config = self.hparams.get("pretrained") is None  # its special ids are defaults, not the tokenizer's
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            value = getattr(tokenizer, name, None)
            if value is not None and (from_config or getattr(model.config, name, None) is None):
                setattr(model.config, name, value)
                if getattr(model, "generation_config", None) is not None:
                    setattr(model.generation_config, name, value)
        self.tokenizer = tokenizer

    def check_length(self, input_ids: Tensor) -> None:
        """Refuse a batch longer than the model's positions (never truncate a privacy unit silently)."""
        if self.max_positions is not None and input_ids.shape[-1] > self.max_positions:
            raise ValueError(
                f"A batch of sequences of length {input_ids.shape[-1]} exceeds the model's {self.max_positions} "
                "positions. Filter or shorten the examples before training (the DataModule's max_length)."
            )

    # ------------------------------------------------------------------ optimizers and checkpoints

    def parameter_groups(self) -> list[nn.Parameter] | list[dict[str, Any]]:
        """What the optimizer gets: the trainable parameters (subclasses may split them into groups)."""
        return [p for p in self.parameters() if p.requires_grad]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameter_groups()
        if self.optimizer is None:
            return torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
        return self.optimizer(params)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CLASS_KEY] = f"{type(self).__module__}.{type(self).__qualname__}"
        checkpoint[CONFIG_KEY] = self.base_model.config.to_dict()
        if self.tokenizer is not None:
            checkpoint[TOKENIZER_KEY] = _tokenizer_files(self.tokenizer)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        files = checkpoint.get(TOKENIZER_KEY)
        if files and self.tokenizer is None:
            self.tokenizer = _tokenizer_from_files(files)

    def trainable_parameters(self) -> int:
        """Number of trained parameters (all of them, or the adapters and head under LoRA)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def _tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files of ``save_pretrained``, kept in the checkpoint so that exports carry the tokenizer."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {name: (Path(folder) / name).read_bytes() for name in os.listdir(folder)}


def _tokenizer_from_files(files: Mapping[str, bytes]) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
