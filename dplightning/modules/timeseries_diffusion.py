"""CSDI-style conditional diffusion for time-series imputation and forecasting; DP comes from the strategy."""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError
from typing_extensions import override

from dplightning.metrics import QuantileCRPS
from dplightning.models.ddpm import DDPMSchedule

Task = Literal["imputation", "forecasting"]
Batch = Tensor | tuple[Tensor, Tensor] | list[Tensor]


def forecast_mask(observed_mask: Tensor, horizon: int) -> Tensor:
    """M_c: the observed points, minus the last ``horizon`` time steps (``[B, L, K]``)."""
    cond = observed_mask.clone()
    cond[:, cond.shape[1] - horizon :] = 0
    return cond


def random_missing_mask(observed_mask: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """CSDI's "random" strategy: each example hides round(r·#observed) of its observed points, r ~ U(0, 1).

    Everything is drawn per example, so one example's mask never depends on another's.
    """
    b = observed_mask.shape[0]
    flat = observed_mask.flatten(1)  # works for empty Poisson batches too
    ratio = torch.rand(b, 1, generator=generator).to(flat.device)
    hidden = torch.round(ratio * flat.sum(1, keepdim=True))
    scores = torch.rand(flat.shape, generator=generator).to(flat.device) + (1 - flat) * 2  # unobserved: never hidden
    rank = scores.argsort(1).argsort(1)
    return (flat * (rank >= hidden)).reshape(observed_mask.shape)


def point_missing_mask(observed_mask: Tensor, ratio: float, generator: torch.Generator | None = None) -> Tensor:
    """Evaluation mask of TSLib's imputation protocol: each observed point is hidden with probability ``ratio``."""
    keep = torch.rand(observed_mask.shape, generator=generator).to(observed_mask.device) >= ratio
    return observed_mask * keep


def masked_mse_per_example(eps: Tensor, eps_hat: Tensor, target_mask: Tensor) -> Tensor:
    """Σ M_tgt (ε − ε̂)² / max(1, Σ M_tgt) of each example: normalised by its own targets only (``[B]``)."""
    sq = ((eps - eps_hat) ** 2 * target_mask).flatten(1).sum(1)
    return sq / target_mask.flatten(1).sum(1).clamp(min=1)


class DPTimeSeriesDiffusion(pl.LightningModule):
    """Conditional DDPM (CSDI) over ``[B, L, K]`` windows, with any ε-prediction network.

    The network is called as ``model((1 - M_c) ⊙ x_t, M_c ⊙ X, M_c, t)`` (e.g.
    :class:`dplightning.models.TimeSeriesDiT`). Training hides part of each window (the
    last ``horizon`` steps for forecasting; a random share r ~ U(0, 1) of the points for
    imputation), noises those points and regresses the noise on them only. Each example's
    loss is normalised by its own number of target points and the batch loss is their sum
    over ``max(B, 1)``, so per-example clipping sees exactly one window's gradient: the
    privacy unit is one training window (:class:`~dplightning.data.ETTDataModule` declares
    its length and stride, and how many windows one row lies in, to checkpoints and reports).

    Privacy contract: the training loss is logged as ``nonprivate/train_loss`` (it comes
    from the private batch). ``val_loss`` (denoising loss on fixed noise) and the test
    metrics come from held-out windows. Test metrics, on the hidden points only, in the
    data's (normalised) space: MSE, RMSE and MAE of the median of ``n_samples`` samples,
    CRPS and CRPS-sum (:class:`dplightning.metrics.QuantileCRPS`).

    Args:
        model: The ε-prediction network.
        task: ``"forecasting"`` or ``"imputation"``.
        horizon: Forecast horizon H (forecasting; the window is input + H steps).
        eval_missing_ratio: Share of points hidden in validation/test windows (imputation).
        diffusion_steps: DDPM steps T (CSDI: 50, "quad" schedule).
        n_samples: Samples per test window; the point forecast is their median.
        sample_chunk: Windows × samples denoised per network call while sampling (memory knob).
        clip_denoised: Clamp the sampler's implied x̂_0 to [−clip, clip] at every step (in the
            data's normalised units); ``None`` (CSDI) does not clamp.
        eval_seed: Seed of the evaluation masks and of the validation noise (public randomness).
        optimizer: Optimizer factory (``class_path`` in configs); default Adam, lr 1e-3.
    """

    def __init__(
        self,
        model: nn.Module,
        task: Task = "forecasting",
        horizon: int = 96,
        eval_missing_ratio: float = 0.25,
        diffusion_steps: int = 50,
        n_samples: int = 100,
        sample_chunk: int = 2048,
        clip_denoised: float | None = None,
        eval_seed: int = 0,
        optimizer: OptimizerCallable | None = None,
    ) -> None:
        super().__init__()
        if task not in ("forecasting", "imputation"):
            raise ValueError(f"task must be 'forecasting' or 'imputation', got {task!r}.")
        if not 0 < eval_missing_ratio < 1:
            raise ValueError(f"eval_missing_ratio must be in (0, 1), got {eval_missing_ratio}.")
        self.model = model
        self.task = task
        self.horizon = horizon
        self.eval_missing_ratio = eval_missing_ratio
        self.n_samples = n_samples
        self.sample_chunk = sample_chunk
        self.clip_denoised = clip_denoised
        self.eval_seed = eval_seed
        self.optimizer = optimizer
        self.schedule = DDPMSchedule(diffusion_steps)
        self.test_mse = MeanSquaredError()
        self.test_rmse = MeanSquaredError(squared=False)
        self.test_mae = MeanAbsoluteError()
        self.test_crps = QuantileCRPS()
        self.test_crps_sum = QuantileCRPS(sum_features=True)

    # ------------------------------------------------------------------ masks and loss

    @staticmethod
    def unpack(batch: Batch) -> tuple[Tensor, Tensor]:
        """``(X, M_obs)`` from a window tensor (fully observed) or an ``(X, M_obs)`` pair."""
        if isinstance(batch, Tensor):
            return batch, torch.ones_like(batch)
        x, observed = batch
        return x, observed.to(x.dtype)

    def conditioning_mask(self, observed_mask: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """M_c for training: the horizon hidden (forecasting) or a random share hidden (imputation)."""
        if self.task == "forecasting":
            return forecast_mask(observed_mask, self.horizon)
        return random_missing_mask(observed_mask, generator)

    def evaluation_mask(self, observed_mask: Tensor, batch_idx: int) -> Tensor:
        """M_c for validation/test, reproducible per batch (``eval_seed + batch_idx``)."""
        if self.task == "forecasting":
            return forecast_mask(observed_mask, self.horizon)
        generator = torch.Generator().manual_seed(self.eval_seed + batch_idx)
        return point_missing_mask(observed_mask, self.eval_missing_ratio, generator)

    def denoise(self, x_t: Tensor, x: Tensor, cond_mask: Tensor, t: Tensor) -> Tensor:
        """ε̂ from the noisy targets and the observed condition."""
        return self.model((1 - cond_mask) * x_t, cond_mask * x, cond_mask, t)

    def per_example_loss(
        self, x: Tensor, observed_mask: Tensor, cond_mask: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        """The masked ε-regression loss of every window (``[B]``), with t and ε drawn per example."""
        t = torch.randint(0, self.schedule.steps, (x.shape[0],), generator=generator).to(x.device)
        eps = torch.randn(x.shape, generator=generator).to(x.device)
        eps_hat = self.denoise(self.schedule.noise(x, t, eps), x, cond_mask, t)
        return masked_mse_per_example(eps, eps_hat, observed_mask - cond_mask)

    # ------------------------------------------------------------------ steps

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, observed = self.unpack(batch)
        losses = self.per_example_loss(x, observed, self.conditioning_mask(observed))
        loss = losses.sum() / max(len(losses), 1)  # Poisson batches can be empty
        self.log("nonprivate/train_loss", loss, batch_size=len(losses))
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, observed = self.unpack(batch)
        generator = torch.Generator().manual_seed(self.eval_seed + batch_idx)  # same t and ε every epoch
        losses = self.per_example_loss(x, observed, self.evaluation_mask(observed, batch_idx), generator)
        self.log("val_loss", losses.mean(), prog_bar=True, batch_size=len(losses))

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        x, observed = self.unpack(batch)
        cond = self.evaluation_mask(observed, batch_idx)
        samples = self.sample(x, cond)
        target_mask = observed - cond
        hidden = target_mask.bool()
        median = samples.median(dim=0).values
        for metric in (self.test_mse, self.test_rmse, self.test_mae):
            metric(median[hidden], x[hidden])
        self.test_crps.update(samples, x, target_mask)
        self.test_crps_sum.update(samples, x, target_mask)
        metrics = {"mse": self.test_mse, "rmse": self.test_rmse, "mae": self.test_mae}
        metrics |= {"crps": self.test_crps, "crps_sum": self.test_crps_sum}
        for name, metric in metrics.items():
            self.log(f"test_{name}", metric, batch_size=len(x))

    @override
    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, Tensor]:
        x, observed = self.unpack(batch)
        cond = self.evaluation_mask(observed, batch_idx)
        samples = self.sample(x, cond)
        return {"samples": samples, "median": samples.median(dim=0).values, "cond_mask": cond, "target": x}

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
    def sample(self, x: Tensor, cond_mask: Tensor, n_samples: int | None = None) -> Tensor:
        """``[S, B, L, K]`` samples of the windows, observed points kept and hidden points drawn.

        Args:
            x: Windows ``[B, L, K]`` (hidden entries are never read).
            cond_mask: M_c, 1 where the value is given.
            n_samples: Samples per window (default ``n_samples``).
        """
        s = n_samples or self.n_samples
        b = x.shape[0]
        xs, masks = x.repeat(s, 1, 1), cond_mask.repeat(s, 1, 1)  # [S*B, L, K], sample-major
        out = torch.empty_like(xs)
        for lo in range(0, len(xs), self.sample_chunk):
            xc, mc = xs[lo : lo + self.sample_chunk], masks[lo : lo + self.sample_chunk]
            drawn = self.schedule.sample(
                lambda x_t, t, xc=xc, mc=mc: self.denoise(x_t, xc, mc, t), xc.shape, x.device, None, self.clip_denoised
            )
            out[lo : lo + len(xc)] = mc * xc + (1 - mc) * drawn
        return out.view(s, b, *x.shape[1:])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return self.optimizer(self.parameters())
