"""DPDM: a class-conditional EDM diffusion model with noise multiplicity; DP comes from the strategy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.func import functional_call
from typing_extensions import override

from dplightning.data.synthetic import save_grid
from dplightning.losses import training_loss
from dplightning.models.edm import EMA, Denoiser, Parameterization
from dplightning.models.edm_samplers import guided, sample

Batch = tuple[Tensor, Tensor] | list[Tensor]


class DPDiffusion(pl.LightningModule):
    """DPDM (Dockhorn et al. 2023): EDM denoising loss averaged over K noise draws per image.

    Each training image x_i is repeated K times in one forward batch of B·K rows (its rows
    consecutive) with K independent draws of (σ, n). The privacy unit is one training image;
    ``dp_rows_per_unit = K`` tells the DP strategy that its K forward rows are one unit, whose
    gradient is summed over its rows before clipping. The loss is Σ_i mean_k ℓ_ik / B, so
    each unit's gradient is the MEAN of its K per-draw gradients, clipped once: the
    sensitivity (C) and ε do not depend on K.
    The classifier-free-guidance label drop is decided once per image and shared by its rows.

    Images arrive in [0, 1] (as :class:`~dplightning.data.DigitsDataModule` and
    :class:`~dplightning.data.IDXImageDataModule` give them) and are scaled to [−1, 1].
    Sampling uses the EMA weights (DPDM's warm-up, :func:`dplightning.models.edm.ema_decay`).

    Privacy contract: ``nonprivate/train_loss`` comes from the private batch. ``val_loss``
    (EMA weights, fixed σ and noise) comes from held-out images. Samples are private (post-
    processing of the DP weights).

    Args:
        net: The network F(x, c_noise, labels), e.g. :class:`dplightning.models.NCSNppUNet`.
        noise_multiplicity: K, noise draws per image (DPDM: 32 for MNIST).
        parameterization: ``"edm"`` (DPDM for ε ≥ 1) or ``"v"`` (ε = 0.2).
        num_classes: Classes (0: unconditional); the "no class" label is ``num_classes``.
        label_dropout: Probability that an image's label is replaced by "no class" (CFG training).
        ema_max_decay: The EMA decay cap (DPDM: 0.999).
        sampler: ``"ddim"``, ``"heun"`` or ``"edm"`` (see :mod:`dplightning.models.edm_samplers`).
        sampling_steps: Steps N of the σ grid.
        guidance: Classifier-free guidance weight w.
        sampler_options: Extra sampler arguments (``s_churn``, ``s_min``, ``s_max``, ``stochastic``).
        sample_batch_size: Images sampled per network call.
        grid_every_n_epochs: Every N epochs, sample 10 images per class and save them as a PNG
            under ``<log_dir or default_root_dir>/samples/`` (and as a logger image when the
            logger can); 0 disables.
        eval_seed: Seed of the validation σ/noise and of the grid samples (public randomness).
        optimizer: Optimizer factory; default Adam, lr 3e-4 (DPDM).
    """

    def __init__(
        self,
        net: nn.Module,
        noise_multiplicity: int = 32,
        parameterization: Parameterization = "edm",
        num_classes: int = 10,
        label_dropout: float = 0.1,
        ema_max_decay: float = 0.999,
        sampler: str = "ddim",
        sampling_steps: int = 50,
        guidance: float = 0.0,
        sampler_options: dict[str, Any] | None = None,
        sample_batch_size: int = 1000,
        grid_every_n_epochs: int = 0,
        eval_seed: int = 0,
        optimizer: OptimizerCallable | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(noise_multiplicity, int) or noise_multiplicity < 1:
            raise ValueError(f"noise_multiplicity (K) must be an int >= 1, got {noise_multiplicity!r}.")
        if not 0 <= label_dropout < 1:
            raise ValueError(f"label_dropout must be in [0, 1), got {label_dropout}.")
        self.denoiser = Denoiser(net, parameterization)
        self.ema = EMA(self.denoiser, ema_max_decay)
        self.noise_multiplicity = noise_multiplicity
        self.num_classes = num_classes
        self.label_dropout = label_dropout
        self.sampler = sampler
        self.sampling_steps = sampling_steps
        self.guidance = guidance
        self.sampler_options = dict(sampler_options or {})
        self.sample_batch_size = sample_batch_size
        self.grid_every_n_epochs = grid_every_n_epochs
        self.eval_seed = eval_seed
        self.optimizer = optimizer
        self._ema_step = -1

    @property
    def dp_rows_per_unit(self) -> int:
        """K: each privacy unit (one image) spans K consecutive forward rows (a ``MultiRowUnits``)."""
        return self.noise_multiplicity

    # ------------------------------------------------------------------ loss

    def drop_labels(self, labels: Tensor, generator: torch.Generator | None = None) -> Tensor | None:
        """Replace each label by "no class" with probability ``label_dropout`` (one decision per image)."""
        if self.num_classes == 0:
            return None
        drop = torch.rand(labels.shape, generator=generator).to(labels.device) < self.label_dropout
        return torch.where(drop, torch.full_like(labels, self.num_classes), labels)

    def draw_noise(self, rows: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """One (σ, n) draw per row: σ from the training distribution, n ~ N(0, I)."""
        sigma = self.denoiser.precond.sample_sigma(len(rows), generator, rows.device).to(rows.dtype)
        noise = torch.randn(rows.shape, generator=generator, dtype=rows.dtype).to(rows.device)
        return sigma, noise

    def per_example_loss(
        self,
        x: Tensor,
        labels: Tensor | None,
        generator: torch.Generator | None = None,
        params: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Each image's loss, the mean over its K (σ, n) draws (``[B]``); ``x`` in [−1, 1], labels already dropped.

        Args:
            x: Images ``[B, C, H, W]`` in [−1, 1].
            labels: ``[B]`` labels (``num_classes`` = no class), or ``None``.
            generator: Source of σ and n (default: the global one).
            params: Weights to use instead of the module's (e.g. the EMA shadow).
        """
        k = self.noise_multiplicity
        xk = x.repeat_interleave(k, 0)  # image i's rows are i·K … i·K + K − 1
        yk = None if labels is None else labels.repeat_interleave(k, 0)
        sigma, noise = self.draw_noise(xk, generator)
        denoise = None if params is None else self._with(params)
        rows = self.denoiser.loss_per_row(xk, yk, sigma, noise, denoise)
        return rows.view(len(x), k).mean(1)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        return training_loss(self, self.per_example_loss(x * 2 - 1, self.drop_labels(y)))  # one loss per image

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if step != self._ema_step:  # an optimizer step happened (not every batch under accumulation)
            self._ema_step = step
            self.log("ema_decay", self.ema.update(self.denoiser))

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        generator = torch.Generator().manual_seed(self.eval_seed + batch_idx)  # same σ and n every epoch
        labels = y if self.num_classes else None
        losses = self.per_example_loss(x * 2 - 1, labels, generator, params=self._ema_params())
        self.log("val_loss", losses.mean(), prog_bar=True, batch_size=len(losses))

    @override
    def on_validation_epoch_end(self) -> None:
        every = self.grid_every_n_epochs
        if every and not self.trainer.sanity_checking and (self.current_epoch + 1) % every == 0:
            self.log_sample_grid()

    # ------------------------------------------------------------------ sampling

    def _ema_params(self) -> dict[str, Tensor]:
        return self.ema.shadow()

    def _with(self, params: dict[str, Tensor]) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
        """The denoiser's forward with ``params`` in place of its weights (no copy of the network)."""

        def denoise(x: Tensor, sigma: Tensor, labels: Tensor | None) -> Tensor:
            return functional_call(self.denoiser, params, (x, sigma, labels), strict=False, tie_weights=False)

        return denoise

    def ema_denoise(self, x: Tensor, sigma: Tensor, labels: Tensor | None) -> Tensor:
        """D(x; σ, y) with the EMA weights."""
        return self._with(self._ema_params())(x, sigma, labels)

    @torch.no_grad()
    def generate(
        self,
        labels: Tensor,
        image_shape: tuple[int, ...] | None = None,
        generator: torch.Generator | None = None,
        use_ema: bool = True,
    ) -> Tensor:
        """One image per label, in [0, 1] (``[B, C, H, W]``), with the configured sampler and guidance."""
        shape = image_shape or self.image_shape
        denoiser = self.ema_denoise if use_ema else self.denoiser
        out = []
        for chunk in labels.split(self.sample_batch_size):
            chunk = chunk.to(self.device)
            fn = guided(denoiser, chunk if self.num_classes else None, self.guidance, self.num_classes)
            x = sample(
                fn,
                (len(chunk), *shape),
                self.sampler,
                self.sampling_steps,
                generator,
                self.device,
                **self.sampler_options,
            )
            out.append(((x + 1) / 2).clamp(0, 1))
        return torch.cat(out)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """``(C, H, W)`` of the training images, taken from the network's input conv and size."""
        net = self.denoiser.net
        size = getattr(net, "image_size", None)
        channels = getattr(net, "in_channels", None)
        if size is None or channels is None:
            raise ValueError("Pass image_shape: the network does not expose image_size and in_channels.")
        return (channels, size, size)

    def log_sample_grid(self) -> Path:
        """Sample 10 images per class (fixed seed) and save ``samples/epoch=<e>.png``; returns its path."""
        generator = torch.Generator().manual_seed(self.eval_seed)
        labels = torch.arange(max(self.num_classes, 1)).repeat_interleave(10)  # one class per grid row
        images = self.generate(labels, generator=generator)
        root = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        path = save_grid(images, root / "samples" / f"epoch={self.current_epoch}.png", nrow=10, scale=4)
        experiment = getattr(self.logger, "experiment", None)
        if hasattr(experiment, "add_images"):
            experiment.add_images("samples", images, self.current_epoch)
        return path

    @override
    def predict_step(self, batch: Batch | Tensor, batch_idx: int) -> dict[str, Tensor]:
        """Generate one image per label of the batch (``(labels,)``, a labels tensor, or ``(x, labels)``)."""
        if isinstance(batch, Tensor):
            labels = batch
        else:
            labels = batch[-1]
        return {"images": self.generate(labels).cpu(), "labels": labels.cpu()}

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.denoiser.parameters()
        if self.optimizer is None:
            return torch.optim.Adam(params, lr=3e-4)
        return self.optimizer(params)
