"""Tiny random Hugging Face models and padded token batches for the module tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

VOCAB, N, T = 48, 5, 9

CAUSAL: dict[str, dict[str, Any]] = {
    "gpt2": dict(model_type="gpt2", n_layer=1, n_head=2, n_embd=16, n_positions=32, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),  # tied input/output embeddings, position ids [1, T]
    "opt": dict(model_type="opt", num_hidden_layers=1, num_attention_heads=2, hidden_size=16, ffn_dim=32,
                max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0),
    "llama": dict(model_type="llama", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  hidden_size=16, intermediate_size=32, max_position_embeddings=32),  # RMSNorm, rotary
}  # fmt: skip
ENCODERS: dict[str, dict[str, Any]] = {
    "bert": dict(model_type="bert", num_hidden_layers=1, num_attention_heads=2, hidden_size=16,
                 intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
    "roberta": dict(model_type="roberta", num_hidden_layers=1, num_attention_heads=2, hidden_size=16,
                    intermediate_size=32, max_position_embeddings=34, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pad_token_id=1),
}  # fmt: skip
LORA = {"r": 2, "alpha": 4, "target_modules": None}
LORA_TARGETS = {"gpt2": ["c_attn"], "opt": ["q_proj", "v_proj"], "llama": ["q_proj", "v_proj"],
                "bert": ["query", "value"], "roberta": ["query", "value"]}  # fmt: skip


def config(name: str) -> dict[str, Any]:
    return {**(CAUSAL.get(name) or ENCODERS[name]), "vocab_size": VOCAB}


def lora(name: str) -> dict[str, Any]:
    return {**LORA, "target_modules": LORA_TARGETS[name]}


def padded_batch(pad_id: int, causal: bool, seed: int = 0) -> dict[str, Tensor]:
    """``N`` sequences of different lengths, right-padded to ``T``; causal labels mask padding and a prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (N, T), generator=g)
    lengths = torch.tensor([T, T - 3, 4, T - 1, 6])
    mask = (torch.arange(T) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_id)
    batch = {"input_ids": ids, "attention_mask": mask}
    if causal:
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :2] = -100  # a two-token prompt carries no loss
        batch["labels"] = labels
    else:
        batch["labels"] = torch.arange(N) % 2
    return batch


def unpadded(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Example ``i`` alone, without its padding."""
    length = int(batch["attention_mask"][i].sum())
    return {k: (v[i : i + 1, :length] if v.dim() == 2 else v[i : i + 1]) for k, v in batch.items()}


def rigged_padding(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch with other token ids (and labels) at the padded positions."""
    out = dict(batch)
    pad = batch["attention_mask"] == 0
    out["input_ids"] = torch.where(pad, (batch["input_ids"] + 7) % VOCAB, batch["input_ids"])
    if batch["labels"].dim() == 2:
        out["labels"] = batch["labels"].masked_fill(pad, -100)
    return out
