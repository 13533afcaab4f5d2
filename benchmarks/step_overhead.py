"""Time per optimizer step of DP-SGD in dplightning vs no-DP Lightning, Opacus and plain PyTorch.

Run (the full benchmark whose table is in ``benchmarks/README.md``)::

    /tmp/venv/bin/python benchmarks/step_overhead.py --out benchmarks/results/step_overhead_cpu.json

Smoke run (a few seconds per runner)::

    /tmp/venv/bin/python benchmarks/step_overhead.py --quick --out /tmp/step_overhead_quick.json

Four runners train the same network (same init seed), data, SGD optimizer and batch size:
``plain`` (a hand-written PyTorch loop), ``lightning`` (``Trainer(strategy="auto")``),
``opacus`` (``PrivacyEngine.make_private`` with Poisson sampling driving the same loop) and
``dplightning`` (``DPStrategy``). Both DP runners use σ = 1, C = 1 and Poisson sampling with
q = B / N, so their batches have B rows on average; the others use fixed batches of B.

Timing: every runner records ``perf_counter`` when a step starts, i.e. once its batch has been
fetched (``Callback.on_train_batch_start`` for Lightning, the top of the loop body otherwise).
A step's time is the gap to the next start, so it covers data loading, forward, backward,
clipping, noise, the optimizer and every per-step hook (e.g. dplightning's ε progress callback),
but not Trainer setup (no sanity check runs: there is no validation loader). The first
``--warmup`` gaps are dropped; N holds enough rows that all timed steps fall in one epoch.

Memory: each runner runs in a fresh ``spawn`` process, so ``ru_maxrss`` (peak RSS) is its own;
``rss_growth_mib`` is the peak minus the peak just before training (model and data built).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import opacus
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.models import SmallCNN

RUNNERS = ("plain", "lightning", "opacus", "dplightning")
LABELS = {
    "plain": "plain PyTorch loop (no DP)",
    "lightning": "Lightning strategy='auto' (no DP)",
    "opacus": "Opacus make_private + plain loop",
    "dplightning": "dplightning DPStrategy",
}
RATIOS = (("dplightning", "lightning"), ("dplightning", "opacus"), ("opacus", "plain"), ("lightning", "plain"))
# (title, result key, format) of the printed table; "other CPU" is other processes' share (should be ~0).
COLUMNS = (
    ("median ms", "median_ms", ".1f"), ("mean ms", "mean_ms", ".1f"), ("stdev ms", "stdev_ms", ".1f"),
    ("mean rows", "mean_batch_rows", ".1f"), ("peak RSS", "peak_rss_mib", ".0f"),
    ("RSS growth", "rss_growth_mib", "+.0f"), ("other CPU%", "foreign_cpu_pct", ".0f"),
)  # fmt: skip
NOISE_MULTIPLIER, MAX_GRAD_NORM, LR, NUM_CLASSES = 1.0, 1.0, 0.05, 10


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


class StepClock(pl.Callback):
    """Records when each training batch starts and how many rows it has."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.rows: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.rows.append(len(batch[0]))


def _clock_loop(
    loader: Iterable[tuple[Tensor, Tensor]], net: nn.Module, opt: torch.optim.Optimizer, steps: int
) -> StepClock:
    """The hand-written loop: runs ``steps`` steps and records ``steps + 1`` starts like :class:`StepClock`."""
    clock = StepClock()
    for x, y in loader:
        clock.starts.append(time.perf_counter())
        clock.rows.append(len(x))
        if len(clock.starts) > steps:  # the last start only closes the previous step
            break
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return clock


def _fit(net: nn.Module, loader: DataLoader, steps: int, strategy: Any) -> StepClock:
    """``Trainer.fit`` for ``steps`` steps without logger, checkpoints, progress bar or summary."""
    clock = StepClock()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps + 1, logger=False, callbacks=[clock],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Classifier(net), loader)
    return clock


def _train(runner: str, net: nn.Module, loader: DataLoader, steps: int) -> StepClock:
    """Train ``steps`` (+1 to close the last gap) steps with ``runner``."""
    if runner == "lightning":
        return _fit(net, loader, steps, "auto")
    if runner == "dplightning":
        strategy = dplightning.DPStrategy(noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM)
        return _fit(net, loader, steps, strategy)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    if runner == "opacus":
        engine = opacus.PrivacyEngine(accountant="prv")
        net, opt, loader = engine.make_private(
            module=net, optimizer=opt, data_loader=loader, noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM, poisson_sampling=True,
        )  # fmt: skip
    return _clock_loop(loader, net, opt, steps)


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine incl. steal, CPU seconds of this process)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy, own.ru_utime + own.ru_stime


def measure(runner: str, workload: str, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    """Run one runner on one workload in this (fresh) process and summarise its step times."""
    warnings.filterwarnings("ignore")  # Lightning's num_workers hints etc.; they do not change timing
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    build, shape, batch = WORKLOADS[workload]
    n = batch * (warmup + steps + 2)  # one epoch outlasts every timed step (no epoch-boundary cost)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g))
    torch.manual_seed(0)
    net = build()
    rss_before, (busy, own), wall = _max_rss_mib(), _cpu_seconds(), time.perf_counter()
    clock = _train(runner, net, DataLoader(data, batch_size=batch, shuffle=True), warmup + steps)
    # Other processes' CPU use while we trained: a non-zero share means the timings are suspect.
    (busy_end, own_end), wall = _cpu_seconds(), time.perf_counter() - wall
    foreign = max(busy_end - busy - (own_end - own), 0.0) / (wall * (os.cpu_count() or 1))
    gaps = [1e3 * (b - a) for a, b in zip(clock.starts, clock.starts[1:])][warmup:]
    return {
        "median_ms": statistics.median(gaps),
        "mean_ms": statistics.fmean(gaps),
        "stdev_ms": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
        "mean_batch_rows": statistics.fmean(clock.rows[warmup : warmup + len(gaps)]),
        "peak_rss_mib": _max_rss_mib(),
        "rss_growth_mib": _max_rss_mib() - rss_before,
        "foreign_cpu_pct": 100 * foreign,
        "threads": torch.get_num_threads(),
        "step_ms": gaps,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _environment(threads: int) -> dict[str, Any]:
    return {
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "opacus": opacus.__version__, "dplightning": getattr(dplightning, "__version__", "editable"),
        "cpu": _cpu_model(), "logical_cpus": torch.multiprocessing.cpu_count(), "threads": threads,
        "platform": platform.platform(),
    }  # fmt: skip


def _ratios(results: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    return {f"{a}/{b}": results[a][key] / results[b][key] for a, b in RATIOS if a in results and b in results}


def _table(workload: str, results: dict[str, dict[str, Any]], steps: int, warmup: int, threads: int) -> str:
    _, shape, batch = WORKLOADS[workload]
    lines = [
        f"{workload}: input {'x'.join(map(str, shape))}, batch {batch}, {steps} timed steps after {warmup} "
        f"warm-up, {threads} threads",
        f"  {'runner':<35}" + "".join(title.rjust(11) for title, _, _ in COLUMNS),
    ]
    for runner, r in results.items():
        lines.append(f"  {LABELS[runner]:<35}" + "".join(format(r[key], fmt).rjust(11) for _, key, fmt in COLUMNS))
    median, mean = _ratios(results, "median_ms"), _ratios(results, "mean_ms")
    lines += [f"  {name:<24} x{median[name]:.2f} (median)  x{mean[name]:.2f} (mean)" for name in median]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per runner")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 steps after 2 warm-up")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_overhead_cpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 5, 2
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every runner on every workload, print one table per workload and write JSON."""
    args = _parse(argv)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in args.models:
        results[workload] = {}
        for runner in args.runners:
            # A fresh process per runner: a clean peak RSS, and no hooks or allocator state left by another.
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                job = pool.submit(measure, runner, workload, args.steps, args.warmup, args.threads)
                results[workload][runner] = job.result()
        print(_table(workload, results[workload], args.steps, args.warmup, args.threads), end="\n\n", flush=True)
    report = {
        "benchmark": "step_overhead", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "environment": _environment(args.threads), "steps": args.steps, "warmup": args.warmup,
        "noise_multiplier": NOISE_MULTIPLIER, "max_grad_norm": MAX_GRAD_NORM, "optimizer": f"SGD(lr={LR})",
        "results": results,
        "ratios": {w: {"median": _ratios(r, "median_ms"), "mean": _ratios(r, "mean_ms")} for w, r in results.items()},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
