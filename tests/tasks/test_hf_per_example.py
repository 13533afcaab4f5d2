"""Per-example gradients of Hugging Face models, with every engine, equal a per-example backward loop.

The reference runs each example alone, without its padding: so the comparison also shows
that padded positions contribute exactly nothing. Models are tiny random GPT-2 (tied
embeddings, default position ids of shape [1, T]), OPT (learned positions from the
attention mask), Llama-style (RMSNorm, rotary), BERT and RoBERTa, each with and without LoRA,
and the encoders with mean pooling too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from dplightning.data.text import PadCollate
from dplightning.privacy.grad_sample import PerExampleHooks, available_engines
from dplightning.tasks import DPCausalLM, DPSequenceClassifier
from dplightning.tasks.causal_lm import per_example_token_mean
from tests.helpers import dp, make_trainer, params_of
from tests.tasks import hf_tiny

MODELS = [*hf_tiny.CAUSAL, *hf_tiny.ENCODERS, *(f"{name}:mean" for name in hf_tiny.ENCODERS)]


def _module(name: str, with_lora: bool) -> DPCausalLM | DPSequenceClassifier:
    torch.manual_seed(0)
    name, _, pooling = name.partition(":")
    lora = hf_tiny.lora(name) if with_lora else None
    if name in hf_tiny.CAUSAL:
        module = DPCausalLM(config=hf_tiny.config(name), lora=lora)
    else:
        module = DPSequenceClassifier(config=hf_tiny.config(name), num_labels=2, lora=lora, pooling=pooling or "model")
    if with_lora:  # peft starts B at zero, which would make the adapters' A gradients trivially zero
        for n, p in module.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.5)
    return module


def _pad_id(module: DPCausalLM | DPSequenceClassifier) -> int:
    pad = module.base_model.config.pad_token_id
    return 0 if pad is None else int(pad)


def _losses(module: DPCausalLM | DPSequenceClassifier, batch: dict[str, Tensor]) -> Tensor:
    if isinstance(module, DPCausalLM):
        return per_example_token_mean(module(batch), batch["labels"])[0]
    return F.cross_entropy(module(batch), batch["labels"], reduction="none")


def _hooked(module, batch: dict[str, Tensor], engine: str) -> dict[str, Tensor]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    hooks = PerExampleHooks(module, [p for _, p in named], engine=engine)
    try:
        with hooks.capture(len(batch["input_ids"])):
            losses = _losses(module, batch)
        losses.sum().backward()
        grads = hooks.pop()
    finally:
        hooks.close()
        module.zero_grad(set_to_none=True)
    return {n: grads[p].instantiate() for n, p in named}


def _loop(module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    rows = []
    for i in range(len(batch["input_ids"])):
        grads = torch.autograd.grad(_losses(module, hf_tiny.unpadded(batch, i)).sum(), [p for _, p in named],
                                    allow_unused=True)  # fmt: skip
        rows.append([torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)])
    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(named)}


@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", MODELS)
def test_per_example_gradients_equal_a_per_example_loop(name: str, with_lora: bool) -> None:
    module = _module(name, with_lora)
    module.train()
    batch = hf_tiny.padded_batch(_pad_id(module), causal=name in hf_tiny.CAUSAL)
    reference = _loop(module, batch)
    assert any(v.abs().sum() > 0 for v in reference.values())
    if with_lora:
        trained = set(reference)
        assert trained and all("lora_" in n or "modules_to_save" in n for n in trained)  # only adapters and head
    rigged = hf_tiny.rigged_padding(batch)
    for engine in available_engines():
        got = _hooked(module, batch, engine)
        assert set(got) == set(reference)
        for n, value in reference.items():
            torch.testing.assert_close(got[n], value, rtol=1e-5, atol=1e-6, msg=f"{engine}: {n}")
        if engine == "auto":  # other ids under the padding: the same gradients (the loop already shows it)
            for n, value in _hooked(module, rigged, engine).items():
                torch.testing.assert_close(value, got[n], rtol=1e-5, atol=1e-7, msg=f"{engine} (padding): {n}")


class _Once(torch.utils.data.Dataset):
    def __init__(self, batch: dict[str, Tensor]) -> None:
        self.items = [
            {"input_ids": batch["input_ids"][i, : int(batch["attention_mask"][i].sum())].tolist(),
             "labels": (batch["labels"][i, : int(batch["attention_mask"][i].sum())].tolist()
                        if batch["labels"].dim() == 2 else int(batch["labels"][i]))}
            for i in range(len(batch["input_ids"]))
        ]  # fmt: skip

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


@pytest.mark.parametrize("name", ["gpt2", "opt", "roberta"])
def test_noiseless_unclipped_step_is_the_plain_step_on_summed_per_example_losses(name: str) -> None:
    module = _module(name, with_lora=False)
    module.optimizer = lambda params: torch.optim.SGD(params, lr=0.5)
    plain = copy.deepcopy(module)
    batch = hf_tiny.padded_batch(_pad_id(module), causal=name in hf_tiny.CAUSAL)
    data = DataLoader(_Once(batch), batch_size=hf_tiny.N, collate_fn=PadCollate(_pad_id(module)))  # q = 1
    before = params_of(module)
    make_trainer(dp(max_grad_norm=1e6)).fit(module, data)
    make_trainer("auto").fit(plain, data)
    moved = False
    for n, p in plain.named_parameters():
        torch.testing.assert_close(params_of(module)[n], p.detach(), rtol=1e-4, atol=1e-6, msg=n)
        moved |= not torch.equal(p.detach(), before[n])
    assert moved
