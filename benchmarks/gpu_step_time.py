"""Per-step time on one CUDA GPU: no DP, dplightning's ``DPStrategy``, and Opacus' own loop.

    python benchmarks/gpu_step_time.py                    # needs a CUDA GPU
    python benchmarks/gpu_step_time.py --precision bf16-mixed

Same network, synthetic data, SGD and batch size for all three; the DP runs use σ = 1,
C = 1 and Poisson sampling (q = B/N). A step's time is the gap between two step starts
(``_harness.StepClock``: ``on_train_batch_start`` under Lightning, the top of the loop body once
the batch is on the GPU for Opacus), read after ``torch.cuda.synchronize()``; the median after
``--warmup`` steps is reported, with peak GPU memory. CPU-side figures live in ``step_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import warnings
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
from dplightning.models import SmallCNN

WORKLOADS = {
    "mlp": (
        lambda: nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.Tanh())], nn.Linear(1024, 10)),
        (1024,),
    ),
    "cnn": (lambda: SmallCNN(in_channels=3, channels=64), (3, 32, 32)),
}


class _Module(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(shape: tuple[int, ...], n: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, *shape), torch.randint(0, 10, (n,)))


def _lightning(workload: str, strategy: Any, args: argparse.Namespace) -> StepClock:
    make, shape = WORKLOADS[workload]
    torch.manual_seed(0)
    clock = StepClock(args.warmup + args.steps, sync=torch.cuda.synchronize)
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision=args.precision,
        max_steps=args.warmup + args.steps + 1, callbacks=[clock],  # the last start only closes the last gap
    )  # fmt: skip
    trainer.fit(_Module(make()), DataLoader(_data(shape, args.batch * 400), batch_size=args.batch, shuffle=True))
    return clock


def _opacus(workload: str, args: argparse.Namespace) -> StepClock:
    make, shape = WORKLOADS[workload]
    torch.manual_seed(0)
    net = make().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loader = DataLoader(_data(shape, args.batch * 400), batch_size=args.batch, shuffle=True)
    net, opt, loader = opacus.PrivacyEngine().make_private(
        module=net, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True
    )
    clock = StepClock(args.warmup + args.steps, sync=torch.cuda.synchronize)
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)  # as Lightning's batch, on the GPU at the start
        if clock.tick(len(x)):
            break
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    return clock


def measure(runner: str, workload: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms/step and peak GPU memory (MiB) of one runner on one workload."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if runner == "opacus":
        clock = _opacus(workload, args)
    else:
        strategy = (
            dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0) if runner == "dplightning" else "auto"
        )
        clock = _lightning(workload, strategy, args)
    return {"ms": statistics.median(clock.step_ms(args.warmup)), "peak_mib": torch.cuda.max_memory_allocated() / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--out", default=str(default_result("gpu_step_time.json")))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for workload in WORKLOADS:
        results[workload] = {r: measure(r, workload, args) for r in ("lightning", "dplightning", "opacus")}
        row = results[workload]
        print(f"{workload}: batch {args.batch}, {args.precision}, {torch.cuda.get_device_name()}")
        for runner, m in row.items():
            print(f"  {runner:12s} {m['ms']:8.2f} ms/step  peak {m['peak_mib']:8.0f} MiB")
        print(f"  dplightning / no DP  = {row['dplightning']['ms'] / row['lightning']['ms']:.2f}x")
        print(f"  dplightning / Opacus = {row['dplightning']['ms'] / row['opacus']['ms']:.2f}x")
    record = {
        "results": results, "config": vars(args), "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__, "opacus": opacus.__version__,
                     "python": platform.python_version()},
        **provenance(torch.get_num_threads()),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
