"""Published architectures of the hub models the project targets, for planning without the network.

Each entry is a ``transformers`` config mapping (``model_type`` plus fields) with the
hyperparameters of the model's published ``config.json``: hidden size, layers, heads, FFN
width, vocabulary and positions. Only the shapes matter to the planner (weights are never
loaded); a local folder or a cached download always takes precedence over this table.
"""

from __future__ import annotations

from typing import Any

_OPT = {"model_type": "opt", "vocab_size": 50272, "max_position_embeddings": 2048, "dropout": 0.1}
_GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024}
_ROBERTA = {
    "model_type": "roberta",
    "vocab_size": 50265,
    "max_position_embeddings": 514,
    "type_vocab_size": 1,
    "pad_token_id": 1,
}


def _opt(hidden: int, layers: int, heads: int, proj: int | None = None, pre_ln: bool = True) -> dict[str, Any]:
    return {
        **_OPT,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "ffn_dim": 4 * hidden,
        "word_embed_proj_dim": proj or hidden,
        "do_layer_norm_before": pre_ln,
    }


PUBLISHED: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": _opt(768, 12, 12),
    "facebook/opt-350m": _opt(1024, 24, 16, proj=512, pre_ln=False),  # the one post-LN OPT, 512-wide embeddings
    "facebook/opt-1.3b": _opt(2048, 24, 32),
    "facebook/opt-2.7b": _opt(2560, 32, 32),
    "facebook/opt-6.7b": _opt(4096, 32, 32),
    "openai-community/gpt2": {**_GPT2, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "openai-community/gpt2-medium": {**_GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16},
    "openai-community/gpt2-large": {**_GPT2, "n_embd": 1280, "n_layer": 36, "n_head": 20},
    "FacebookAI/roberta-base": {
        **_ROBERTA,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "FacebookAI/roberta-large": {
        **_ROBERTA,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    },
    "google-bert/bert-base-uncased": {
        "model_type": "bert",
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
}

_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "roberta-base": "FacebookAI/roberta-base",
    "roberta-large": "FacebookAI/roberta-large",
    "bert-base-uncased": "google-bert/bert-base-uncased",
}


def published_config(name: str) -> tuple[str, dict[str, Any]] | None:
    """``(canonical hub name, config mapping)`` of a known hub model, or ``None``."""
    key = _ALIASES.get(name, name)
    if key in PUBLISHED:
        return key, dict(PUBLISHED[key])
    lowered = {k.lower(): k for k in PUBLISHED}
    if key.lower() in lowered:
        return lowered[key.lower()], dict(PUBLISHED[lowered[key.lower()]])
    return None
