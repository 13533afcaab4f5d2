"""``DPSequenceClassifier``: Hugging Face sequence classification (BERT, RoBERTa, MiniLM, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from dplightning.modules._hf_module import HFModule
from dplightning.modules.hf import LoraSettings


class DPSequenceClassifier(HFModule):
    """A ``transformers`` sequence classifier; DP comes from the strategy, not from this module.

    Batches are mappings with ``input_ids``, ``attention_mask`` and ``labels`` (as the text
    DataModules make them). The training loss is the batch mean of per-example
    cross-entropies, so one example's gradient depends on its own text only. It is logged
    as ``nonprivate/train_loss`` (computed from private data; not differentially private).

    Args:
        pretrained: Hub name or local folder (no network is touched for a local folder).
        config: A ``transformers`` config or mapping (random weights), instead of ``pretrained``.
        num_labels: Number of classes (a new head is initialised for a pretrained encoder).
        lora: peft LoRA ``{r, alpha, dropout, target_modules}``; the head stays trainable
            unless ``train_head=False``.
        train_head: With LoRA, train the classification head too.
        optimizer: Optimizer factory over the trainable parameters (default AdamW, lr 5e-4).
        model_kwargs: Extra keyword arguments for ``from_pretrained`` / the config.
    """

    auto_class = "AutoModelForSequenceClassification"
    task_type = "SEQ_CLS"

    def __init__(
        self,
        pretrained: str | None = None,
        config: Any = None,
        num_labels: int = 2,
        lora: LoraSettings | Mapping[str, Any] | None = None,
        train_head: bool = True,
        optimizer: OptimizerCallable | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.num_labels = num_labels
        super().__init__(pretrained, config, lora, train_head, optimizer, model_kwargs)
        self.val_acc = MulticlassAccuracy(num_labels, average="micro")  # plain accuracy, as GLUE reports it
        self.test_acc = MulticlassAccuracy(num_labels, average="micro")

    def _model_overrides(self) -> dict[str, Any]:
        return {"num_labels": self.num_labels}

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        self.check_length(batch["input_ids"])
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor | None:
        rows = len(batch["labels"])
        if rows == 0:
            return None  # an empty Poisson batch: the strategy still releases the noise of this step
        loss = F.cross_entropy(self(batch), batch["labels"], reduction="sum") / rows
        self.log("nonprivate/train_loss", loss, batch_size=rows)
        return loss

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self.val_acc(self(batch), batch["labels"])
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self.test_acc(self(batch), batch["labels"])
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        return self(batch).argmax(dim=-1)
