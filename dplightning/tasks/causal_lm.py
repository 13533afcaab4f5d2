"""``DPCausalLM``: Hugging Face causal language models (GPT-2, OPT, Llama-style) with generation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor
from torchmetrics.aggregation import MeanMetric

from dplightning.data.text import IGNORE
from dplightning.losses import training_loss
from dplightning.models.hf import LoraSettings
from dplightning.tasks._hf_module import HFModule


def per_example_token_mean(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Each example's next-token loss averaged over its own target tokens.

    Averaging per example (not over all tokens of the batch) keeps one example's
    gradient independent of the other examples' lengths, so that the per-example
    gradient, and its clipping, depend on that example alone.

    Args:
        logits: ``[B, T, V]`` next-token logits.
        labels: ``[B, T]`` token ids, :data:`IGNORE` where no loss is taken.

    Returns:
        ``([B] per-example mean losses, [B] target-token counts)``; an example with no
        target token has loss 0.
    """
    targets = labels[:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, reduction="none", ignore_index=IGNORE)
    counts = (targets != IGNORE).sum(1)
    return per_token.sum(1) / counts.clamp(min=1), counts


def left_padded(input_ids: Tensor, attention_mask: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """Move each row's padding to the left, as decoder-only generation needs."""
    order = torch.argsort(attention_mask, dim=1, stable=True)  # padding (0) first, tokens keep their order
    ids = torch.gather(input_ids, 1, order)
    mask = torch.gather(attention_mask, 1, order)
    return ids.masked_fill(mask == 0, pad_id), mask


class DPCausalLM(HFModule):
    """A ``transformers`` causal LM; DP comes from the strategy, not from this module.

    Batches are mappings with ``input_ids``, ``attention_mask`` and ``labels`` (``-100``
    at padding and, for prompt/completion data such as table-to-text, at the prompt). The
    training loss is, for each example, the mean next-token loss over its own target
    tokens, then the mean over the batch: one example's gradient does not depend on the
    other examples' lengths. It is logged as ``nonprivate/train_loss`` (not DP).

    ``predict`` generates completions of the prompts in the batch (greedy, or beam search
    with ``num_beams > 1``) and returns the decoded texts when a tokenizer is known.

    Args:
        pretrained: Hub name or local folder (no network is touched for a local folder).
        config: A ``transformers`` config or mapping (random weights), instead of ``pretrained``.
        lora: peft LoRA ``{r, alpha, dropout, target_modules}``; only adapters are trained.
        optimizer: Optimizer factory over the trainable parameters (default AdamW, lr 5e-4).
        max_new_tokens: Tokens generated per prompt in ``predict``.
        num_beams: Beam width in ``predict`` (1: greedy).
        model_kwargs: Extra keyword arguments for ``from_pretrained`` / the config.
    """

    auto_class = "AutoModelForCausalLM"
    task_type = "CAUSAL_LM"

    def __init__(
        self,
        pretrained: str | None = None,
        config: Any = None,
        lora: LoraSettings | Mapping[str, Any] | None = None,
        optimizer: OptimizerCallable | None = None,
        max_new_tokens: int = 64,
        num_beams: int = 1,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(pretrained, config, lora, False, optimizer, model_kwargs)
        self.max_new_tokens = max_new_tokens
        self.num_beams = num_beams
        self.val_loss = MeanMetric()
        self.val_token_loss = MeanMetric()

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        self.check_length(batch["input_ids"])
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor | None:
        rows = len(batch["input_ids"])
        if rows == 0:
            return None  # an empty Poisson batch: the strategy still releases the noise of this step
        return training_loss(self, per_example_token_mean(self(batch), batch["labels"])[0])

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        losses, counts = per_example_token_mean(self(batch), batch["labels"])
        self.val_loss.update(losses)
        self.val_token_loss.update(losses, weight=counts)  # token-weighted: exp() of it is the perplexity
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_token_loss", self.val_token_loss)

    def on_validation_epoch_end(self) -> None:
        self.log("val_ppl", torch.exp(self.val_token_loss.compute()))

    def generate(self, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Tensor:
        """Continuations of the prompts (``[B, new tokens]``), prompts right- or left-padded."""
        config = self.base_model.config
        pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
        ids, mask = left_padded(input_ids, attention_mask, pad)
        options = {"max_new_tokens": self.max_new_tokens, "num_beams": self.num_beams, "do_sample": False, **kwargs}
        out = self.model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **options)
        return out[:, ids.shape[1] :]

    def predict_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> list[str] | Tensor:
        prompts = "prompt_ids" in batch
        ids = batch["prompt_ids"] if prompts else batch["input_ids"]
        new = self.generate(ids, batch["prompt_mask"] if prompts else batch["attention_mask"])
        if self.tokenizer is None:
            return new
        return [text.strip() for text in self.tokenizer.batch_decode(new, skip_special_tokens=True)]
