"""Time per optimizer step of DP-SGD in dplightning vs no-DP Lightning, Opacus and plain PyTorch.

Run (full; the tables in ``benchmarks/README.md``), or a smoke run (one repeat of 5 steps)::

    .venv/bin/python benchmarks/step_overhead.py --out benchmarks/results/step_overhead_cpu.json
    .venv/bin/python benchmarks/step_overhead.py --quick --out step_overhead_quick.json

Runners, all on the same network (same init), data, SGD optimizer and batch size B: ``plain``
(a hand-written PyTorch loop), ``lightning`` (``Trainer(strategy="auto")``), ``opacus``
(``PrivacyEngine.make_private`` driving the same loop) and ``dplightning`` (``DPStrategy``).
Both DP runners use σ = 1, C = 1 and Poisson sampling (q = B / N: B rows on average).

Timing: a step's time is the gap between two step starts, recorded by ``perf_counter`` once
the batch is fetched (``Callback.on_train_batch_start`` under Lightning, the loop body's top
otherwise). It covers data loading, forward, backward, clipping, noise, the optimizer and
every per-step hook (e.g. dplightning's ε progress callback), but not Trainer setup or a
sanity check (there is no validation loader). ``--warmup`` gaps are dropped; all timed steps
fall in the first epoch. ``--repeats`` interleaved repeats are pooled. Lightning is told to run
``--planned-steps`` steps and stopped early: dplightning spaces its ε progress bar's accountant
calls by ~1% of the planned run, so a tiny ``max_steps`` would put one in nearly every step.

Isolation: each repeat is a fresh ``spawn`` process, so its peak RSS (``ru_maxrss``) is its
own and no hooks or allocator state leak between runners. ``foreign_cpu_pct`` is the share of
the machine's CPU that other processes used meanwhile (``/proc/stat``); above
``--max-other-cpu`` the repeat is retried, as one busy core slows threaded steps many-fold.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import opacus
import torch
import torch.nn.functional as F
from _harness import StepClock, in_fresh_process, measured, quiet_trainer, summarise, write_report
from _outputs import default_result
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.models import SmallCNN

RUNNERS = {
    "plain": "plain PyTorch loop (no DP)",
    "lightning": "Lightning strategy='auto' (no DP)",
    "opacus": "Opacus make_private + plain loop",
    "dplightning": "dplightning DPStrategy",
    "dplightning_verified": "dplightning, verify_gradients=always",
}
RATIOS = (
    ("dplightning", "lightning"), ("dplightning", "opacus"), ("opacus", "plain"), ("lightning", "plain"),
    ("dplightning_verified", "dplightning"),
)  # fmt: skip
# (title, summary key, format) of the printed table.
COLUMNS = (
    ("median ms", "median_ms", ".1f"), ("mean ms", "mean_ms", ".1f"), ("stdev ms", "stdev_ms", ".1f"),
    ("mean rows", "mean_batch_rows", ".1f"), ("peak RSS", "peak_rss_mib", ".0f"),
    ("RSS growth", "rss_growth_mib", "+.0f"), ("other CPU%", "foreign_cpu_pct", ".0f"),
)  # fmt: skip
NOISE_MULTIPLIER, MAX_GRAD_NORM, LR, NUM_CLASSES = 1.0, 1.0, 0.05, 10
TRIES, RETRY_PAUSE_S = 6, 30.0
ENV_PREFIXES = ("MALLOC_", "OMP_", "MKL_", "LD_PRELOAD", "PYTHONPATH")  # settings that change the timings


def _mlp() -> nn.Module:
    # A transformer-sized dense stack (4 x 512x512) with a classifier head for cross-entropy.
    blocks = [m for _ in range(4) for m in (nn.Linear(512, 512), nn.Tanh())]
    return nn.Sequential(*blocks, nn.Linear(512, NUM_CLASSES))


# name -> (network builder, input shape of one example, batch size)
WORKLOADS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "cnn": (lambda: SmallCNN(in_channels=1, channels=32, num_classes=NUM_CLASSES), (1, 28, 28), 256),
    "mlp": (_mlp, (512,), 256),
}


class Classifier(pl.LightningModule):
    """Cross-entropy on ``net`` with SGD, logging nothing (the plain loops log nothing either)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _clock_loop(loader: Iterable[Any], net: nn.Module, opt: torch.optim.Optimizer, steps: int) -> StepClock:
    """The hand-written loop, timed like the Lightning runs by a :class:`StepClock`."""
    clock = StepClock(steps)
    for x, y in loader:
        if clock.tick(len(x)):
            break
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return clock


def _fit(net: nn.Module, loader: DataLoader, steps: int, planned: int, strategy: Any) -> StepClock:
    """``Trainer.fit`` told to run ``planned`` steps, stopped after ``steps``; no logger, checkpoints or bars."""
    clock = StepClock(steps)
    trainer = quiet_trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=max(planned, steps + 1), callbacks=[clock],
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Classifier(net), loader)
    return clock


def _train(runner: str, net: nn.Module, loader: DataLoader, steps: int, planned: int) -> StepClock:
    """Train ``steps`` steps (and one more start to close the last gap) with ``runner``."""
    if runner == "lightning":
        return _fit(net, loader, steps, planned, "auto")
    if runner.startswith("dplightning"):
        # The default checks gradients on the first steps only (warm-up here); the variant on every step.
        verify = "always" if runner == "dplightning_verified" else "first_steps"
        strategy = dplightning.DPStrategy(
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM, verify_gradients=verify
        )
        return _fit(net, loader, steps, planned, strategy)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    if runner == "opacus":
        net, opt, loader = opacus.PrivacyEngine(accountant="prv").make_private(
            module=net, optimizer=opt, data_loader=loader, noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM, poisson_sampling=True,
        )  # fmt: skip
    return _clock_loop(loader, net, opt, steps)


def measure(runner: str, workload: str, steps: int, warmup: int, threads: int, planned: int) -> dict[str, Any]:
    """Run one runner on one workload in this (fresh) process; return its timed steps and memory."""
    warnings.filterwarnings("ignore")  # Lightning's num_workers hints etc.; they do not change timing
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    build, shape, batch = WORKLOADS[workload]
    n = batch * (warmup + steps + 2)  # one epoch outlasts every timed step (no epoch-boundary cost)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g))
    torch.manual_seed(0)
    net = build()
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    return measured(lambda: (_train(runner, net, loader, warmup + steps, planned), warmup))


def _measure_quietly(runner: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    job = (runner, workload, args.steps, args.warmup, args.threads, args.planned_steps)
    return in_fresh_process(measure, job, args.max_other_cpu, runner)


def _ratios(results: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    return {f"{a}/{b}": results[a][key] / results[b][key] for a, b in RATIOS if a in results and b in results}


def _table(workload: str, results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    _, shape, batch = WORKLOADS[workload]
    lines = [
        f"{workload}: input {'x'.join(map(str, shape))}, batch {batch}, {args.repeats} x {args.steps} timed steps "
        f"(after {args.warmup} warm-up), {args.threads} threads",
        f"  {'runner':<35}" + "".join(title.rjust(11) for title, _, _ in COLUMNS),
    ]
    for runner, r in results.items():
        lines.append(f"  {RUNNERS[runner]:<35}" + "".join(format(r[key], fmt).rjust(11) for _, key, fmt in COLUMNS))
    median, mean = _ratios(results, "median_ms"), _ratios(results, "mean_ms")
    lines += [f"  {name:<24} x{median[name]:.2f} (median)  x{mean[name]:.2f} (mean)" for name in median]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per repeat")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    parser.add_argument(
        "--planned-steps", type=int, default=1000,
        help="max_steps the Trainer is told (it is stopped early); sets how often dplightning's ε progress bar "
        "calls the accountant (about 100 times per planned run)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per runner, interleaved")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--runners", nargs="+", choices=list(RUNNERS), default=[r for r in RUNNERS if r != "dplightning_verified"]
    )
    parser.add_argument("--max-other-cpu", type=float, default=5.0, help="retry a repeat above this %% (100 = never)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat of 5 steps after 2 warm-up")
    parser.add_argument("--out", type=Path, default=default_result("step_overhead_cpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 5, 2, 1
    args.runners = list(dict.fromkeys(args.runners))
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every runner on every workload, print one table per workload and write the JSON."""
    args = _parse(argv)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in args.models:
        runs: dict[str, list[dict[str, Any]]] = {runner: [] for runner in args.runners}
        for _ in range(args.repeats):
            for runner in args.runners:
                runs[runner].append(_measure_quietly(runner, workload, args))
        results[workload] = {runner: summarise(r) for runner, r in runs.items()}
        print(_table(workload, results[workload], args), end="\n\n", flush=True)
    ratios = {w: {"median": _ratios(r, "median_ms"), "mean": _ratios(r, "mean_ms")} for w, r in results.items()}
    settings = {"noise_multiplier": NOISE_MULTIPLIER, "max_grad_norm": MAX_GRAD_NORM, "optimizer": f"SGD(lr={LR})"}
    write_report(args.out, "step_overhead", args.threads, {**settings, **vars(args)}, results=results, ratios=ratios)


if __name__ == "__main__":
    main()
