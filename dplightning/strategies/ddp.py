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
        if self.world_size > 1 and self.private_step is not None:
            self._agree_on_leaving(module)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        for hook in _AGREED_HOOKS:
            if module is not None and getattr(module.__dict__.get(hook), "_dp_agreeing", False):
                del module.__dict__[hook]
        super().teardown()

    def _agree_on_leaving(self, module: Any) -> None:
        """Every rank leaves an epoch or the fit at the same batch, or every rank stops with an error.

        Lightning lets one rank leave alone: its module's ``on_train_batch_start`` returning -1
        ends that rank's epoch, and ``trainer.should_stop`` set on that rank (by a callback or
        the module, in ``on_train_batch_end``) ends its fit; neither is shared. Each release
        all-reduces every rank's clipped sum, so the others would wait in that all-reduce (or
        pair it with one of Lightning's own collectives) until the process group's timeout. The
        module's two hooks are wrapped: after each, one count of the ranks that leave, and a
        split count is an error on every rank at once (after a -1, before anything of that batch
        is released).
        """
        trainer = known(self._trainer, "the Trainer")
        if is_overridden("on_train_batch_start", module):
            own_start = module.on_train_batch_start

            def on_train_batch_start(batch: Any, batch_idx: int) -> Any:
                response = own_start(batch, batch_idx)
                what = "on_train_batch_start returned -1 (end the epoch)"
                self._refuse_leaving_alone(what, response == -1, batch_idx, "Nothing of this batch was released.")
                return response

            _install(module, "on_train_batch_start", on_train_batch_start)
        own_end = module.on_train_batch_end

        def on_train_batch_end(outputs: Any, batch: Any, batch_idx: int) -> Any:
            response = own_end(outputs, batch, batch_idx)  # after every callback's on_train_batch_end
            what, released = "trainer.should_stop was set (end the fit)", "This batch's release is in the ledger."
            self._refuse_leaving_alone(what, trainer.should_stop, batch_idx, released)
            return response

        _install(module, "on_train_batch_end", on_train_batch_end)

    def _refuse_leaving_alone(self, what: str, leaving: bool, batch_idx: int, spent: str) -> None:
        count = self._ranks_with(leaving)
        with decision("rank_agreement"):
            _refuse_lone_leave(what, count, self.world_size, leaving, batch_idx, spent)

    def _ranks_with(self, flag: bool) -> int:
        """How many ranks hold ``flag`` (one int all-reduce, on every rank)."""
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.root_device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return int(value.item())

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
        return self._ranks_with(flag) == self.world_size

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


_AGREED_HOOKS = ("on_train_batch_start", "on_train_batch_end")


def _install(module: Any, hook: str, wrapper: Any) -> None:
    wrapper._dp_agreeing = True
    module.__dict__[hook] = wrapper


def _refuse_lone_leave(what: str, leaving: int, world: int, this_rank: bool, batch_idx: int, spent: str) -> None:
    if 0 < leaving < world:
        raise RuntimeError(
            f"{what} on {leaving} of {world} ranks at batch {batch_idx} (this rank: {'yes' if this_rank else 'no'}). "
            "Under dp_ddp every rank takes every step: each release adds all ranks' clipped sums, and a rank that "
            "leaves alone would leave the others waiting for it until the process group's timeout. Decide once for "
            f"all ranks, e.g. stop = self.trainer.strategy.reduce_boolean_decision(stop, all=False). {spent}"
        )
