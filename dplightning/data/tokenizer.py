"""Tokenizers for text DataModules: a pretrained one, or a byte-level BPE trained offline."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

PAD, EOS = "<pad>", "<|endoftext|>"


def load_tokenizer(name_or_path: str) -> Any:
    """A pretrained tokenizer (local folder, cache or hub); a pad token is added if it has none."""
    from transformers import AutoTokenizer

    from dplightning.models.hf import from_pretrained

    tokenizer = from_pretrained(AutoTokenizer, name_or_path)
    if tokenizer.pad_token is None:  # GPT-2 and Llama ship without one; padding positions carry no loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int, folder: str | Path) -> Any:
    """Train a byte-level BPE tokenizer on ``texts`` and save it (``save_pretrained``) in ``folder``.

    Byte-level BPE covers any input (no unknown token), so models built from a config can
    be trained offline. Token ids: ``<pad>`` is 0, ``<|endoftext|>`` (end of text) is 1.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size must be at least 260 (256 bytes and special tokens), got {vocab_size}.")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=EOS)
    tokenizer.save_pretrained(str(folder))
    return tokenizer
