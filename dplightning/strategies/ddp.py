"""``DPDDPStrategy``: DP-SGD across processes (GPUs, CPUs with gloo, nodes).

No ``DistributedDataParallel`` wrapper: it would all-reduce the raw, unclipped gradient
(wasted, and not private). Instead the ranks start from rank 0's weights and, once per
optimizer step, all-reduce their clipped sums bucket by bucket, with the Gaussian noise
added exactly once globally. Registered as ``"dp_ddp"`` (subprocess launch, also used
under ``torchrun`` and SLURM) and ``"dp_ddp_spawn"``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from dplightning._state import known
from dplightning.privacy.mechanism import BucketReducer
from dplightning.privacy.release import decision
from dplightning.strategies._dp import _DPHooks
from dplightning.strategies.config import DPConfig, dp_arguments


@dp_arguments()
class DPDDPStrategy(_DPHooks, DDPStrategy):
    """Differentially private training (DP-SGD) over several processes, one device each.

    The guarantee is that of single-process DP-SGD on the union of the ranks' batches:
    each rank Poisson-samples its own disjoint shard of the training set at the global
    rate q = batch_size x world_size / N (``batch_size`` is per process, as in Lightning),
    clips its examples, and the clipped sums are added across ranks together with one
    draw of N(0, (σΔ)²). Every rank takes the same number of steps (empty local batches
    included) and holds the same ledger, so ε is one number for the run.

    Args:
        accelerator: Lightning's argument.
        parallel_devices: Lightning's argument.
        cluster_environment: Lightning's argument.
        checkpoint_io: Lightning's argument.
        precision_plugin: Lightning's argument.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; default from the device.
        timeout: Timeout of collective operations.
        start_method: ``"popen"`` (the script is re-run per rank) or ``"spawn"``.
    """

    strategy_name = "dp_ddp"

    def __init__(
        self,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **dp: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._dp_init(DPConfig(**dp))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = known(self.lightning_module, "the LightningModule")
        if self.world_size > 1 and self.private_step is not None and is_overridden("on_train_batch_start", module):
            self._agree_on_epoch_ends(module)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and getattr(module.__dict__.get("on_train_batch_start"), "_dp_agreeing", False):
            del module.__dict__["on_train_batch_start"]
        super().teardown()

    def _agree_on_epoch_ends(self, module: Any) -> None:
        """Wrap the module's ``on_train_batch_start``: every rank ends an epoch at the same batch, or all stop.

        Its -1 ends the epoch on the rank that returned it; Lightning does not share that
        decision. Each release all-reduces every rank's clipped sum, so a rank that leaves
        alone leaves the others waiting in that all-reduce (or pairs it with one of Lightning's
        own collectives) until the process group's timeout. One count of the ranks that end,
        taken after the hook on every rank, turns that into an error on every rank at once.
        """
        own = module.on_train_batch_start

        def on_train_batch_start(batch: Any, batch_idx: int) -> Any:
            response = own(batch, batch_idx)
            ending = torch.tensor([int(response == -1)], dtype=torch.int32, device=self.root_device)
            dist.all_reduce(ending, op=dist.ReduceOp.SUM)
            with decision("epoch_end_agreement"):
                _refuse_lone_epoch_end(int(ending.item()), self.world_size, response == -1, batch_idx)
            return response

        on_train_batch_start._dp_agreeing = True  # type: ignore[attr-defined]
        module.__dict__["on_train_batch_start"] = on_train_batch_start

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel: start every rank from rank 0's parameters and buffers.
        _sync_module_states(known(self.model, "the model"))

    @override
    def _check_same_on_every_rank(self, dataloader: DataLoader, **values: int) -> None:
        if self.world_size == 1:
            return
        if not isinstance(dataloader.sampler, DistributedSampler):
            rank_zero_warn(
                "The train loader has no DistributedSampler (use_distributed_sampler=False?). dplightning shards the "
                "training set itself (example i goes to rank i mod W) and takes N = len(dataset) for q and δ, so "
                "every rank must be given the whole training set, not a shard of its own."
            )
        local = torch.tensor(list(values.values()), dtype=torch.float64, device=self.root_device)
        high, low = local.clone(), -local
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MAX)
        differ = [name for name, h, lo in zip(values, high.tolist(), (-low).tolist()) if h != lo]
        if differ:
            raise ValueError(
                f"The ranks' train loaders disagree on {differ} (this rank: {values}). Every rank must be given the "
                "same whole training set and batch size: dplightning shards the data itself and needs one N and "
                "one q for the accountant. Pass the full data set on every rank (pre-sharded data is not supported)."
            )

    @override
    def _all_ranks_agree(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.root_device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    @override
    def _bucket_reducer(self) -> BucketReducer | None:
        if self.world_size == 1:
            return None

        def all_reduce(bucket: Tensor) -> dist.Work | None:
            return dist.all_reduce(bucket, op=dist.ReduceOp.SUM, async_op=True)

        return all_reduce

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # No super(): DDPStrategy would re-register "ddp" and raise.
        for name, start_method in (("dp_ddp", "popen"), ("dp_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DP-SGD across processes ({start_method}), σ = 1, C = 1 (dplightning)",
                start_method=start_method,
                noise_multiplier=1.0,
            )


def _refuse_lone_epoch_end(ending: int, world: int, this_rank: bool, batch_idx: int) -> None:
    if 0 < ending < world:
        raise RuntimeError(
            f"on_train_batch_start returned -1 (end the epoch) on {ending} of {world} ranks at batch {batch_idx} "
            f"(this rank: {'-1' if this_rank else 'continue'}). Under dp_ddp every rank takes every step: each "
            "release adds all ranks' clipped sums, and a rank that leaves alone would leave the others waiting "
            "for it until the process group's timeout. Decide once for all ranks, e.g. "
            "return self.trainer.strategy.broadcast(-1 if stop else 0). Nothing of this batch was released."
        )
