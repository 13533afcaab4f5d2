"""Step time of DP-Muon and DP-MuonBC relative to DP-Adam, side by side in one run.

The small GPT-2 of ``configs/finetune/e2e_gpt2_small_cpu.yaml`` on E2E, each arm that config
plus its ``configs/muon/`` overlay, σ = 1 fixed and the strategy's seed fixed, so that every arm
trains on the same Poisson batches from the same initial weights. Arms are interleaved within
each repeat. Per step: wall time (``perf_counter``, ``_harness.StepClock``) and this process's
CPU time (``process_time``, less sensitive to other jobs on a shared machine), both from one
``on_train_batch_start`` to the next, and the optimizer's own update (``step`` minus its
closure, where the per-example gradients, clipping and noise happen). Targets (issue 11):
DP-Muon ≤ 1.15x and DP-MuonBC ≤ 1.5x DP-Adam.

    OMP_NUM_THREADS=1 python benchmarks/muon_step_time.py \\
        --out benchmarks/results/muon_step_time_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import StepClock, provenance

ARMS = {"DP-Adam": "dpadam", "DP-Muon": "dpmuon", "DP-MuonBC": "dpmuonbc", "DP-MuonBC no guard": "dpmuonbc"}
# BC on every matrix. A null cannot be a command-line override of a callable's argument (jsonargparse): a YAML overlay.
NO_GUARD_YAML = "model:\n  init_args:\n    optimizer:\n      init_args:\n        max_noise_ratio: null\n"
EXTRA = {"DP-MuonBC no guard": ["--config", "{root}/no_guard.yaml"]}
BASE = "configs/finetune/e2e_gpt2_small_cpu.yaml"


class Clock(StepClock):
    """The harness's clock, plus CPU time at each step start and the time in ``optimizer.step`` past its closure."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.cpu: list[float] = []
        self.update: list[float] = []
        self.corrected = (0, 0)

    def tick(self, rows: int) -> bool:
        self.cpu.append(time.process_time())
        return super().tick(rows)

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        step = opt.step

        def timed(closure: Any = None, **kwargs: Any) -> Any:
            spent = [0.0]

            def inner() -> Any:
                t = time.process_time()
                out = closure()
                spent[0] += time.process_time() - t
                return out

            start = time.process_time()
            out = step(closure=inner if closure is not None else None, **kwargs)
            self.update.append(time.process_time() - start - spent[0])
            return out

        opt.step = timed  # type: ignore[method-assign]

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.corrected = getattr(trainer.optimizers[0], "corrected_fraction", (0, 0))


def measure(arm: str, steps: int, args: argparse.Namespace) -> dict[str, list[float]]:
    from dplightning.cli import build_cli

    cli = build_cli(
        run=False,
        args=[
            "--config",
            BASE,
            "--config",
            f"configs/muon/e2e_gpt2_small_cpu_{ARMS[arm]}.yaml",
            "--seed_everything=0",
            "--trainer.strategy.init_args.target_epsilon=null",
            "--trainer.strategy.init_args.noise_multiplier=1.0",
            "--trainer.strategy.init_args.seed=0",  # the same Poisson batches for every arm
            f"--trainer.max_steps={steps + 1}",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[]",  # the base config's ModelCheckpoint contradicts the line above
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={args.root}",
            f"--data.init_args.batch_size={args.batch_size}",
            f"--data.init_args.tokenizer_dir={Path(args.root) / 'tokenizer'}",
            *[a.format(root=args.root) for a in EXTRA.get(arm, [])],
        ],
    )
    clock = Clock(steps)
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # One update per timed gap (the last batch only closes the last gap).
    update = [1e3 * u for u in clock.update][: len(clock.starts) - 1]
    return {
        "wall_ms": clock.step_ms(0),
        "cpu_ms": [1e3 * (b - a) for a, b in zip(clock.cpu, clock.cpu[1:])],
        "update_ms": update,
        "corrected": [*clock.corrected],
    }


def update_only(repeats: int, steps: int, warmup: int) -> dict[str, Any]:
    """CPU ms of ``optimizer.step`` alone on the config's GPT-2 parameters, from synthetic releases (no DP step)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from dplightning.optim import DPMuon
    from dplightning.protocols import DPRelease

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, n_positions=160, vocab_size=2048)  # as the CPU config
    named = list(AutoModelForCausalLM.from_config(config).named_parameters())
    params = [p for _, p in named]
    g = torch.Generator().manual_seed(1)
    grads = [[1e-3 * torch.randn(p.shape, generator=g) for p in params] for _ in range(4)]
    kinds = {
        "AdamW": lambda: torch.optim.AdamW(params, lr=2e-3),
        "DPMuon": lambda: DPMuon(params),
        "DPMuon BC": lambda: DPMuon(params, bias_correction=True),
        "DPMuon BC no guard": lambda: DPMuon(params, bias_correction=True, max_noise_ratio=None),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    applied: dict[str, list[int]] = {}
    for _ in range(repeats):
        for kind, make in kinds.items():
            opt = make()
            if isinstance(opt, DPMuon):
                opt.dp_plan(named, 0.1)
            for k in range(warmup + steps):
                for p, grad in zip(params, grads[k % 4]):
                    p.grad = grad
                if isinstance(opt, DPMuon):
                    opt.dp_release(DPRelease(dict(zip(params, grads[k % 4])), 7e-4, [], k))
                start = time.process_time()
                opt.step()
                if k >= warmup:
                    times[kind].append(1e3 * (time.process_time() - start))
            if isinstance(opt, DPMuon):
                applied[kind] = [*opt.corrected_fraction]
    return {"median_ms": {k: statistics.median(v) for k, v in times.items()}, "bc_applied": applied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--root", default="lightning_logs/muon_step_time")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--update-only", action="store_true", help="time optimizer.step alone on synthetic releases (about 30 s)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.update_only:
        result = update_only(3, 10, 2)
        for kind, ms in result["median_ms"].items():
            print(f"{kind:20s} {ms:6.1f} ms  BC applied on {result['bc_applied'].get(kind, '-')} matrix-steps")
        if args.out:
            Path(args.out).write_text(json.dumps({**result, **provenance(1)}, indent=1))
        return
    Path(args.root).mkdir(parents=True, exist_ok=True)
    (Path(args.root) / "no_guard.yaml").write_text(NO_GUARD_YAML)
    keys = ("wall_ms", "cpu_ms", "update_ms", "corrected")
    pooled: dict[str, dict[str, list[float]]] = {arm: {k: [] for k in keys} for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:  # interleaved: drifts in the machine's load hit every arm alike
            times = measure(arm, args.warmup + args.steps, args)
            for key, values in times.items():
                pooled[arm][key] += values if key == "corrected" else values[args.warmup :]
    corrected = {arm: pooled[arm].pop("corrected") for arm in ARMS}  # (corrected, BC-on) matrix-steps per repeat
    med = {arm: {k: statistics.median(v) for k, v in t.items()} for arm, t in pooled.items()}
    print(f"small GPT-2, E2E, batch {args.batch_size} (Poisson), {args.repeats} x {args.steps} steps, 1 thread")
    print(
        "arm                 wall ms   CPU ms   update ms   CPU / DP-Adam   wall / DP-Adam   (CPU + update diff) / CPU"
    )
    adam = med["DP-Adam"]
    for arm, m in med.items():
        ratio_cpu, ratio_wall = m["cpu_ms"] / adam["cpu_ms"], m["wall_ms"] / adam["wall_ms"]
        # The same batches go through the same mechanism in every arm; only the update differs.
        by_update = (adam["cpu_ms"] + m["update_ms"] - adam["update_ms"]) / adam["cpu_ms"]
        print(
            f"{arm:18s} {m['wall_ms']:8.0f} {m['cpu_ms']:8.0f} {m['update_ms']:11.1f}   x{ratio_cpu:.3f}"
            f"          x{ratio_wall:.3f}           x{by_update:.3f}"
        )
    if args.out:
        result = {"args": vars(args), "median": med, "pooled": pooled, "bc_corrected_matrix_steps": corrected,
                  **provenance(1)}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))
    for arm, c in corrected.items():
        if c[1::2] and sum(c[1::2]):
            print(f"{arm}: BC applied on {sum(c[0::2])} of {sum(c[1::2])} matrix-steps (warm-up included)")


if __name__ == "__main__":
    main()
