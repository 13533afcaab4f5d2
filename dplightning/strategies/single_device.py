"""``DPStrategy``: DP-SGD on one device, registered as ``"dp"``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from dplightning.strategies._dp import _DPMixin


class DPStrategy(_DPMixin, SingleDeviceStrategy):
    """Differentially private training (DP-SGD) of any LightningModule on one device.

    Per optimizer step: Poisson-sampled batch, per-example gradients (Opacus hooks on
    the module's own layers), clipping in fp32, one draw of Gaussian noise
    N(0, (σΔ)²) on the clipped sum, division by the public expected batch size q·N,
    then the user's own optimizer. The accountant's ledger is saved in checkpoints.

    Privacy contract: the privacy unit is one row of the train loader's batches; ε is
    reported for (δ, the Poisson rate q = batch_size / N, σ, the steps taken). Metrics
    logged from ``training_step`` and gradients seen in ``on_after_backward`` are NOT
    private; the gradient seen from ``on_before_optimizer_step`` on is.

    Args:
        noise_multiplier: σ, the noise std in units of the sensitivity. Exactly one of
            ``noise_multiplier`` and ``target_epsilon``; 0 disables noise (ε = inf).
        target_epsilon: ε to reach at the end of training; σ is calibrated from
            ``max_epochs``/``max_steps``, q and δ when fit starts.
        max_grad_norm: Clipping bound C (the joint sensitivity for group clipping).
        delta: δ; default 1/(10·N) with N the training set size.
        accountant: ``"prv"`` (default), ``"rdp"`` or ``"gdp"`` (Opacus' accountants).
        clipping: ``"flat"`` (one norm over all parameters) or ``"per_layer"``.
        poisson_sampling: Replace the train loader's sampler by Poisson sampling with
            q = batch_size / N. ``False`` keeps the loader and reports ε = inf.
        secure_mode: Draw noise and sampling decisions from the OS CSPRNG (slow).
        loss_reduction: ``"mean"`` if ``training_step`` averages the loss over the
            batch (the usual case), ``"sum"`` if it sums it.
        grad_sample_mode: ``"hooks"`` (registered per-layer samplers only) or
            ``"functorch"`` (``torch.func`` for layers without a sampler).
        bucket_cap_mb: Size of the fp32 buckets the clipped sum is kept in.
        seed: FOR TESTS ONLY. Noise and sampling seeds otherwise come from OS entropy;
            a seed lets whoever knows it subtract the noise.
        verify_gradients: Check that autograd's gradient equals the sum of the per-example
            gradients, and refuse to train if not (a contribution escaped the per-example
            hooks): ``"first_steps"`` (default: the first steps with data, and again after
            the trainable parameters change), ``"always"`` or ``"never"``.
        device: The device; by default the Trainer's (``accelerator``/``devices``).
    """

    strategy_name = "dp"

    def __init__(
        self,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        max_grad_norm: float = 1.0,
        delta: float | None = None,
        accountant: str = "prv",
        clipping: str = "flat",
        poisson_sampling: bool = True,
        secure_mode: bool = False,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "hooks",
        bucket_cap_mb: float = 25.0,
        seed: int | None = None,
        verify_gradients: str = "first_steps",
        device: str | torch.device | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(device=device or "cpu", checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._explicit_device = device is not None
        # Lightning's accelerator connector fills `parallel_devices` from `devices=`.
        self.parallel_devices: list[torch.device] | None = None
        self._dp_init(
            noise_multiplier, target_epsilon, max_grad_norm, delta, accountant, clipping,
            poisson_sampling, secure_mode, loss_reduction, grad_sample_mode, bucket_cap_mb, seed,
            verify_gradients=verify_gradients,
        )  # fmt: skip

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
