"""Per-step cost of ``dp_ddp`` against Lightning's plain ``ddp``, measured side by side.

    python benchmarks/ddp_overhead.py                 # 2 CPU processes (gloo), 1 thread each
    python benchmarks/ddp_overhead.py --quick         # smoke run

Four runs of the same model, data and per-process batch size, each in fresh spawned
processes: plain single-process Lightning, ``dp`` (one process), ``ddp`` and ``dp_ddp``
(``--world`` processes). Rank 0 times every step with ``_harness.StepClock``, the gap between
two step starts (forward, backward, clipping, all-reduce, noise, optimizer step and the next
batch's fetch; Trainer setup and sanity checks excluded), and reports the median after
``--warmup`` steps. Every process runs with ``--threads`` intra-op threads so that the
processes do not fight over the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import opacus
import torch
import torch.nn.functional as F
from _harness import StepClock, provenance, quiet_trainer
from _outputs import default_result
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning


class _Net(pl.LightningModule):
    """An MLP (Linear 512 -> 512 with Tanh, x depth) classifier on synthetic data."""

    def __init__(self, width: int, depth: int, threads: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))
        self.threads = threads

    def setup(self, stage: str) -> None:
        torch.set_num_threads(self.threads)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _RankZeroClock(StepClock):
    """A step clock whose rank 0 writes its step times (ms) to ``path``: spawned ranks hand nothing else back."""

    def __init__(self, steps: int, path: str) -> None:
        super().__init__(steps)
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.step_ms(0)))


def _strategy(name: str, world: int) -> Any:
    if name == "single":
        return "auto"
    if name == "dp":
        return dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    if name == "ddp":
        return pl.strategies.DDPStrategy(start_method="spawn")
    return dplightning.DPDDPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, start_method="spawn")


def measure(name: str, args: argparse.Namespace) -> float:
    """Median milliseconds per step of one configuration."""
    world = args.world if name in ("ddp", "dp_ddp") else 1
    data = TensorDataset(torch.randn(args.samples, args.width), torch.randint(0, 10, (args.samples,)))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "times.json")
        trainer = quiet_trainer(
            accelerator="cpu", devices=world, strategy=_strategy(name, world), num_sanity_val_steps=0,
            max_steps=args.warmup + args.steps + 1,  # the last start only closes the last gap
            callbacks=[_RankZeroClock(args.warmup + args.steps, path)],
        )  # fmt: skip
        trainer.fit(_Net(args.width, args.depth, args.threads), loader)
        step_ms = json.loads(Path(path).read_text())
    return statistics.median(step_ms[args.warmup :])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="processes for ddp and dp_ddp")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="(expected) batch size per process")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    parser.add_argument("--out", default=str(default_result("ddp_overhead_cpu.json")))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 5, 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned ranks

    results = {name: measure(name, args) for name in ("single", "dp", "ddp", "dp_ddp")}
    layout = f"{args.world} processes, {args.threads} thread(s) each"
    print(f"MLP {args.depth}x{args.width}, batch {args.batch}/process, {layout}, CPU")
    for name, ms in results.items():
        print(f"  {name:8s} {ms:8.2f} ms/step")
    print(f"  dp_ddp / ddp    = {results['dp_ddp'] / results['ddp']:.2f}x")
    print(f"  dp / single     = {results['dp'] / results['single']:.2f}x")
    print(f"  dp_ddp / dp     = {results['dp_ddp'] / results['dp']:.2f}x  (same per-process batch, twice the examples)")
    record = {
        "benchmark": "ddp_overhead",
        "ms_per_step": results,
        "ratio_dp_ddp_over_ddp": results["dp_ddp"] / results["ddp"],
        "config": vars(args),
        "versions": {
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "opacus": opacus.__version__,
            "dplightning": dplightning.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "hardware": {"cpu": _cpu_model(), "cores": os.cpu_count(), "device": "cpu"},
        **provenance(args.threads),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
