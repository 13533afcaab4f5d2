"""``DPStrategy``: DP-SGD on one device, registered as ``"dp"``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from dplightning.strategies._dp import _DPHooks
from dplightning.strategies.config import DPConfig, dp_arguments


@dp_arguments(exclude=("noise_placement",))
class DPStrategy(_DPHooks, SingleDeviceStrategy):
    """Differentially private training (DP-SGD) of any LightningModule on one device.

    Per optimizer step: Poisson-sampled batch, per-example gradients (hooks on the
    module's own layers, a clipping engine per layer), clipping in fp32, one draw of
    Gaussian noise N(0, (σΔ)²) on the clipped sum, division by the public expected batch
    size q·N, then the user's own optimizer. The accountant's ledger is saved in checkpoints.

    Privacy contract: the privacy unit is one row of the train loader's batches (or
    ``dp_rows_per_unit`` forward rows, see :class:`dplightning.protocols.MultiRowUnits`);
    ε is reported for (δ, the Poisson rate q = batch_size / N, σ, the steps taken).
    Metrics logged from ``training_step`` and gradients seen in ``on_after_backward`` are
    NOT private; the gradient seen from ``on_before_optimizer_step`` on is.

    Args:
        device: The device; by default the Trainer's (``accelerator``/``devices``).
        checkpoint_io: Lightning's argument.
        precision_plugin: Lightning's argument.
    """

    strategy_name = "dp"

    def __init__(
        self,
        device: str | torch.device | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **dp: Any,
    ) -> None:
        super().__init__(device=device or "cpu", checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._explicit_device = device is not None
        # Lightning's accelerator connector fills `parallel_devices` from `devices=`.
        self.parallel_devices: list[torch.device] | None = None
        self._dp_init(DPConfig(**dp))

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._explicit_device and self.parallel_devices:
            if len(self.parallel_devices) > 1:
                raise ValueError(
                    f"strategy='dp' runs on one device, got devices={len(self.parallel_devices)}; "
                    "use strategy='dp_ddp' for several."
                )
            return self.parallel_devices[0]
        return self._root_device

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # No super(): SingleDeviceStrategy would re-register its own name. The bare name gets
        # σ = 1 so that `Trainer(strategy="dp")` runs; ε is reported either way.
        strategy_registry.register(
            cls.strategy_name, cls, description="DP-SGD on one device, σ = 1, C = 1 (dplightning)", noise_multiplier=1.0
        )
