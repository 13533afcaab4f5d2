"""``PrivateClipFraction``: a differentially private clip fraction, with its privacy cost accounted."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from dplightning._state import known
from dplightning.privacy.noise import GaussianNoise, derive_seed
from dplightning.protocols import RegistersStepReleases, StepReleaseSource, dp_state_of, require

RELEASE_NAME = "clip_count"
METRIC = "private/clip_fraction"


class PrivateClipFraction(Callback):
    """**private**: the fraction of clipped examples per step, released with Gaussian noise.

    At every optimizer step it releases the noisy count b̃ = Σ_i 1[‖g_i‖ > C] + N(0, σ_b²)
    over the step's Poisson sample (all ranks; the noise is added once, by rank 0, from its
    own generator) and logs ``private/clip_fraction`` = b̃ / (q·N), divided by the public
    expected batch size. One example changes the count by at most 1, and count and gradient
    are computed on the same sample in the same step, so together they are one Gaussian
    mechanism with σ_eff = (σ⁻² + σ_b⁻²)^(-1/2) (Andrew et al. 2021). The callback
    registers the count with the strategy (``register_step_release``) so that the ledger
    records σ_eff at every step: ε, ``PrivacyBudget`` and ``target_epsilon`` all include it.

    Trade-off: with ``target_epsilon`` the strategy raises the gradient's σ to
    (σ_eff⁻² − σ_b⁻²)^(-1/2); with a fixed ``noise_multiplier`` ε grows instead. Both effects
    are small when σ_b ≫ σ, because precisions add: σ_eff⁻² = σ⁻² + σ_b⁻². For example
    σ_b = q·N/20 (Andrew et al.'s suggestion) at q·N = 256 and σ_eff = 1 raises the gradient's
    σ by 0.3%, and the released fraction has noise std σ_b/(q·N) = 0.05. A smaller σ_b gives
    a more accurate fraction at a higher privacy cost.
    With multi-group clipping an example counts as clipped if any group is clipped.

    Args:
        noise_multiplier: σ_b, the std of the noise on the count (its sensitivity is 1).
        seed: FOR TESTS ONLY; the default draws the seed from OS entropy. The count noise of
            step t is then ``GaussianNoise(derive_seed(seed, "clip_count"), rank=0)`` at step t.
    """

    def __init__(self, noise_multiplier: float, seed: int | None = None) -> None:
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"noise_multiplier (σ_b) must be finite and > 0, got {noise_multiplier}.")
        self.noise_multiplier = float(noise_multiplier)
        self.seed = seed
        self.noisy_counts: list[float] = []
        """The released noisy counts b̃, one per optimizer step (identical on every rank)."""
        self._source: StepReleaseSource | None = None
        self._noise: GaussianNoise | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name = type(self).__name__
        self._source = require(dp_state_of(trainer.strategy), StepReleaseSource, name)
        # Before the strategy calibrates σ (when its train loader is set up), so target_epsilon includes the count.
        accounting = require(trainer.strategy, RegistersStepReleases, name)
        accounting.register_step_release(RELEASE_NAME, self.noise_multiplier)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        known(self._source, "the DP strategy (set in setup)")
        seed = None if self.seed is None else derive_seed(self.seed, RELEASE_NAME)
        # Never the global RNG (seed_everything makes it public and equal on every rank), never the gradient's stream.
        self._noise = GaussianNoise(seed, rank=0, secure_mode=self._source.secure_mode)
        self.noisy_counts = []

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        known(self._source, "the DP strategy (set in setup)")
        known(self._noise, "the noise source of the count")
        local = self._clipped_count().to(trainer.strategy.root_device)
        if trainer.is_global_zero:  # noise exactly once across ranks, before the sum
            self._noise.start_step(trainer.global_step)
            local = local + self._noise.sample(local, self.noise_multiplier)
        noisy = float(trainer.strategy.reduce(local, reduce_op="sum").item())
        self.noisy_counts.append(noisy)
        fraction = noisy / float(self._source.expected_batch_size or math.nan)
        pl_module.log(METRIC, fraction, on_step=True, on_epoch=False, logger=True, rank_zero_only=True)

    def _clipped_count(self) -> Tensor:
        """This rank's number of clipped examples in the step (raw: never logged or kept)."""
        known(self._source, "the DP strategy (set in setup)")
        bounds = torch.tensor([g.max_norm for g in self._source.clip_groups])
        count = sum(int((~(s.norms.cpu() <= bounds)).any(dim=1).sum()) for s in self._source.last_step_stats)
        return torch.tensor(float(count), dtype=torch.float64)
