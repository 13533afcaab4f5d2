"""Test helpers: a tiny LightningModule, synthetic data and a quiet Trainer."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.protocols import dp_state_of


def make_dataset(n: int = 64, features: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Gaussian features with labels from a random linear rule."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def mlp(features: int = 6, classes: int = 3, hidden: int = 5) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))


class Scale(nn.Module):
    """A layer with a direct parameter and no registered per-example sampler."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


class TinyModule(pl.LightningModule):
    """Cross-entropy on any network; records the batches it trained on.

    Args:
        net: The network.
        lr: SGD learning rate (1.0 makes the update equal to the released gradient).
        zero_loss: Use ``0 * output.sum()`` so that every data gradient is zero.
        optimizer: ``"sgd"`` or a factory ``params -> Optimizer``.
    """

    def __init__(
        self,
        net: nn.Module | None = None,
        lr: float = 1.0,
        zero_loss: bool = False,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        self.net = net if net is not None else mlp()
        self.lr = lr
        self.zero_loss = zero_loss
        self.make_optimizer = optimizer
        self.batches: list[tuple[Tensor, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return 0.0 * out.sum() if self.zero_loss else F.cross_entropy(out, y)

    def record(self, x: Tensor, y: Tensor) -> None:
        """Keep a batch trained on (on the CPU, where references run); not the coupling probe's replay."""
        trainer = self._trainer
        if trainer is None or not getattr(dp_state_of(trainer.strategy), "probing", False):
            self.batches.append((x.detach().cpu(), y.detach().cpu()))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.record(x, y)
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.make_optimizer is not None:
            return self.make_optimizer(self.parameters())
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ManualModule(TinyModule):
    """TinyModule with manual optimization: one ``manual_backward`` and ``opt.step()`` per batch."""

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__(lr=lr)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.record(x, y)
        loss = self.loss(self(x), y)
        self.manual_backward(loss)
        opt.step()
        return loss


def loader(dataset: TensorDataset, batch_size: int = 16, **kwargs: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, **kwargs)


ACCELERATOR = os.environ.get("DPL_TEST_ACCELERATOR", "cpu")
"""Accelerator of single-device tests; ``DPL_TEST_ACCELERATOR=gpu`` reruns them on a GPU."""
DEVICE = torch.device("cuda" if ACCELERATOR == "gpu" else "cpu")
"""Where those tests draw noise (regenerating a stream needs the generator's device)."""


def make_trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator=ACCELERATOR,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_steps=1,
    )
    if REPLAY and ACCELERATOR == "gpu":  # the replay refuses a backward pass that does not repeat bit for bit
        defaults["deterministic"] = "warn"
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


ENGINE = "auto"
"""Clipping engine of the strategies the helpers build; the invariant suites run with each one."""
REPLAY = False
"""Whether the strategies the helpers build clip by replaying the backward pass (``clip_replay``) from their
first step (verification, whose steps hold, off); the single-process invariants run with and without."""


def dp(**kwargs: Any) -> dplightning.DPStrategy:
    kwargs.setdefault("noise_multiplier", 0.0)
    kwargs.setdefault("clipping_engine", ENGINE)
    if REPLAY:
        kwargs.setdefault("clip_replay", True)
        kwargs.setdefault("verify_gradients", "never")
    kwargs.setdefault("max_grad_norm", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 warns by design
        return dplightning.DPStrategy(**kwargs)


def params_of(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


class DumpRankState(pl.Callback):
    """Writes what each rank ended with to ``folder/rank{r}.pt`` (spawned ranks cannot return it).

    Also counts ``torch.distributed.all_reduce`` calls on floating-point tensors made while training
    (gradient buckets; the ranks' integer agreements on a check's decision are not reductions of data).
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.all_reduce_calls = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch.distributed as dist

        original = dist.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else kwargs.get("tensor")
            self.all_reduce_calls += int(tensor is None or tensor.is_floating_point())
            return original(*args, **kwargs)

        dist.all_reduce = counting
        self._restore = lambda: setattr(dist, "all_reduce", original)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        s = trainer.strategy
        state = {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "batches": getattr(pl_module, "batches", []),
            "steps": s.steps,
            "history": s.ledger.history,
            "epsilon": s.get_epsilon(),
            "sample_rate": s.sample_rate,
            "buckets": len(s.private_step.privatizer.buckets) if s.private_step else 0,
            "all_reduce_calls": self.all_reduce_calls,
        }
        torch.save(state, f"{self.folder}/rank{trainer.global_rank}.pt")


def run_ddp(
    module: pl.LightningModule,
    data: DataLoader,
    folder: str,
    world: int = 2,
    ckpt_path: Any = None,
    save_to: str | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit on ``world`` spawned CPU/gloo ranks; return every rank's :class:`DumpRankState` record."""
    strategy_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _DP_ARGS}
    strategy_kwargs.setdefault("noise_multiplier", 0.0)
    strategy_kwargs.setdefault("clipping_engine", ENGINE)
    strategy_kwargs = {k: v for k, v in strategy_kwargs.items() if v is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = dplightning.DPDDPStrategy(start_method="spawn", **strategy_kwargs)
    callbacks = [DumpRankState(folder), *kwargs.pop("callbacks", [])]
    kwargs.setdefault("accelerator", "cpu")  # gloo ranks on CPU, also when single-device tests use a GPU
    trainer = make_trainer(strategy, devices=world, callbacks=callbacks, **kwargs)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return [torch.load(f"{folder}/rank{r}.pt", weights_only=False) for r in range(world)]


_DP_ARGS = {
    "noise_multiplier",
    "target_epsilon",
    "max_grad_norm",
    "delta",
    "accountant",
    "clipping",
    "seed",
    "noise_placement",
    "bucket_cap_mb",
    "poisson_sampling",
    "timeout",
    "clipping_engine",
    "clip_replay",
    "verify_gradients",
    "noise_mechanism",
    "bands",
    "blt_buffers",
    "cyclic_partitions",
}
