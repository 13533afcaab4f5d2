"""CSDI-style conditional diffusion for time-series imputation and forecasting; DP comes from the strategy."""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError, SumMetric
from typing_extensions import override

from dplightning.losses import training_loss
from dplightning.metrics import QuantileCRPS
from dplightning.models.ddpm import DDPMSchedule

Task = Literal["imputation", "forecasting"]
CRPSSpace = Literal["original", "normalised"]
Centering = Literal["none", "context_mean"]
Parameterization = Literal["eps", "v"]
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


def context_mean(x: Tensor, cond_mask: Tensor) -> Tensor:
    """Each window's per-channel mean over its own conditioning points, ``[B, 1, K]`` (0 for a channel with none)."""
    return (cond_mask * x).sum(1, keepdim=True) / cond_mask.sum(1, keepdim=True).clamp(min=1)


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

    A batch may also be an ``(X, M_obs, Y)`` triple (:class:`~dplightning.data.faults.FaultedWindows`):
    the model is given ``X`` (with faults in its context) and its targets are taken from the clean ``Y``,
    in training, validation and test alike.

    Privacy contract: the training loss is logged as ``nonprivate/train_loss`` (it comes
    from the private batch). ``val_loss`` (denoising loss on fixed noise) and the test
    metrics come from held-out windows. Test metrics, on the hidden points only: MSE, RMSE
    and MAE of the median of ``n_samples`` samples in the data's normalised space (TSLib's
    convention), and CRPS and CRPS-sum (:class:`dplightning.metrics.QuantileCRPS`) on
    de-normalised values (CSDI's convention; ``crps_space``), plus ``test_windows``, the
    number of windows scored. How many test windows there are is the data's choice (e.g.
    ``ETTDataModule(max_test_windows=512)``); ``n_samples`` sets the samples per window.

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
        crps_space: ``"original"`` (CSDI): CRPS and CRPS-sum of ``x·std + mean`` per channel,
            with the scaler from ``data_mean``/``data_std`` or else the datamodule's ``mean``
            and ``std`` (as :class:`~dplightning.data.ETTDataModule` has); ``"normalised"``:
            of the values as the network sees them.
        data_mean: Per-channel means of the scaler, for ``crps_space="original"``.
        data_std: Per-channel standard deviations of the scaler, given with ``data_mean``.
        center: ``"none"`` (CSDI) or ``"context_mean"``: every window is shifted by minus its own
            per-channel mean over the conditioning points before noising and denoising, and the
            samples are shifted back (a per-example map, like RevIN without the scaling: the
            network then models deviations from the context's level, which carries over to
            the level shifts of ETT's later months). It also removes a constant offset of a
            channel's whole context, so level faults of that kind no longer reach the network.
        parameterization: What the network predicts and the loss regresses: ``"eps"`` (CSDI,
            the noise ε) or ``"v"`` (v = √ᾱ_t·ε − √(1−ᾱ_t)·x_0, Salimans & Ho 2022). With CSDI's
            schedule ᾱ_t falls to ~1e-5, and an ε-network's implied x̂_0 = (x_t − √(1−ᾱ_t)·ε̂)/√ᾱ_t
            multiplies its error by up to ~300 at the first sampling steps: the ε loss hardly
            asks for the conditional level there. v is x_0's negative at high noise and ε at
            low noise. The sampler turns either into ε̂; the loss stays per example.
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
        crps_space: CRPSSpace = "original",
        data_mean: list[float] | None = None,
        data_std: list[float] | None = None,
        center: Centering = "none",
        parameterization: Parameterization = "eps",
    ) -> None:
        super().__init__()
        if task not in ("forecasting", "imputation"):
            raise ValueError(f"task must be 'forecasting' or 'imputation', got {task!r}.")
        if not 0 < eval_missing_ratio < 1:
            raise ValueError(f"eval_missing_ratio must be in (0, 1), got {eval_missing_ratio}.")
        if crps_space not in ("original", "normalised"):
            raise ValueError(f"crps_space must be 'original' or 'normalised', got {crps_space!r}.")
        if center not in ("none", "context_mean"):
            raise ValueError(f"center must be 'none' or 'context_mean', got {center!r}.")
        if parameterization not in ("eps", "v"):
            raise ValueError(f"parameterization must be 'eps' or 'v', got {parameterization!r}.")
        if (data_mean is None) != (data_std is None):
            raise ValueError("Give both data_mean and data_std (the scaler of the data), or neither.")
        self.crps_space = crps_space
        self.center = center
        self.parameterization = parameterization
        self.data_mean = None if data_mean is None else torch.tensor(data_mean, dtype=torch.float64)
        self.data_std = None if data_std is None else torch.tensor(data_std, dtype=torch.float64)
        self._scaler: tuple[Tensor, Tensor] | None = None
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
        self.test_windows = SumMetric()

    # ------------------------------------------------------------------ masks and loss

    @staticmethod
    def unpack(batch: Batch) -> tuple[Tensor, Tensor]:
        """``(X, M_obs)`` from a window tensor (fully observed), an ``(X, M_obs)`` pair or a faulted triple."""
        x, observed, _ = DPTimeSeriesDiffusion.unpack_windows(batch)
        return x, observed

    @staticmethod
    def unpack_windows(batch: Batch) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(X, M_obs, Y)``: the values the model is given, their mask and the clean values it is scored on.

        ``Y`` is ``None`` (score on ``X``) for a window tensor or an ``(X, M_obs)`` pair; an
        ``(X, M_obs, Y)`` triple (:class:`~dplightning.data.faults.FaultedWindows`) has faults in ``X``
        and the clean window in ``Y``, so that the targets stay clean.
        """
        if isinstance(batch, Tensor):
            return batch, torch.ones_like(batch), None
        if len(batch) == 3:
            x, observed, target = batch
            return x, observed.to(x.dtype), target
        x, observed = batch
        return x, observed.to(x.dtype), None

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

    def offset(self, x: Tensor, cond_mask: Tensor) -> Tensor | None:
        """What ``center`` subtracts from each window (``[B, 1, K]``), or ``None`` for ``center="none"``."""
        return context_mean(x, cond_mask) if self.center == "context_mean" else None

    def denoise(self, x_t: Tensor, x: Tensor, cond_mask: Tensor, t: Tensor) -> Tensor:
        """The network's prediction (ε̂, or v̂ with ``parameterization="v"``) from the noisy targets and the condition."""
        return self.model((1 - cond_mask) * x_t, cond_mask * x, cond_mask, t)

    def predict_eps(self, x_t: Tensor, x: Tensor, cond_mask: Tensor, t: Tensor) -> Tensor:
        """ε̂ for the sampler: the network's output, or √ᾱ_t·v̂ + √(1−ᾱ_t)·x_t from v̂."""
        out = self.denoise(x_t, x, cond_mask, t)
        if self.parameterization == "eps":
            return out
        a = self.schedule.alpha_bars[t].view(-1, *[1] * (x_t.dim() - 1))
        return a.sqrt() * out + (1 - a).sqrt() * x_t

    def per_example_loss(
        self,
        x: Tensor,
        observed_mask: Tensor,
        cond_mask: Tensor,
        generator: torch.Generator | None = None,
        target: Tensor | None = None,
    ) -> Tensor:
        """The masked ε-regression loss of every window (``[B]``), with t and ε drawn per example.

        Args:
            x: The windows as given to the model (the conditioning values; faulted, if faults are on).
            observed_mask: M_obs.
            cond_mask: M_c.
            generator: Draws t and ε (``None``: the global generator).
            target: Clean windows, whose values the target points (M_obs − M_c) take (``None``: ``x``'s own).
        """
        if target is not None:
            # The targets (observed, not given) clean; every other point as the data has it (a missing
            # channel keeps its fill value: its clean values must not reach the model through x_t).
            x = torch.where((observed_mask - cond_mask).bool(), target, x)
        offset = self.offset(x, cond_mask)
        if offset is not None:
            x = x - offset
        t = torch.randint(0, self.schedule.steps, (x.shape[0],), generator=generator).to(x.device)
        eps = torch.randn(x.shape, generator=generator).to(x.device)
        prediction = self.denoise(self.schedule.noise(x, t, eps), x, cond_mask, t)
        if self.parameterization == "v":
            a = self.schedule.alpha_bars[t].view(-1, *[1] * (x.dim() - 1))
            eps = a.sqrt() * eps - (1 - a).sqrt() * x  # the regression target v (named eps to share the loss)
        return masked_mse_per_example(eps, prediction, observed_mask - cond_mask)

    # ------------------------------------------------------------------ steps

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, observed, target = self.unpack_windows(batch)
        cond = self.conditioning_mask(observed)
        return training_loss(self, self.per_example_loss(x, observed, cond, target=target))

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, observed, target = self.unpack_windows(batch)
        generator = torch.Generator().manual_seed(self.eval_seed + batch_idx)  # same t and ε every epoch
        cond = self.evaluation_mask(observed, batch_idx)
        losses = self.per_example_loss(x, observed, cond, generator, target)
        self.log("val_loss", losses.mean(), prog_bar=True, batch_size=len(losses))

    def scaler(self) -> tuple[Tensor, Tensor] | None:
        """The per-channel ``(mean, std)`` the CRPS de-normalises with; ``None`` for ``crps_space="normalised"``.

        Raises:
            ValueError: If ``crps_space="original"`` and neither ``data_mean``/``data_std`` nor
                the datamodule's ``mean``/``std`` are there.
        """
        if self.crps_space == "normalised":
            return None
        if self.data_mean is not None and self.data_std is not None:
            return self.data_mean, self.data_std
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        mean, std = getattr(datamodule, "mean", None), getattr(datamodule, "std", None)
        if isinstance(mean, Tensor) and isinstance(std, Tensor):
            return mean, std
        raise ValueError(
            "crps_space='original' scores CRPS on de-normalised values and needs the data's per-channel scaler: "
            "pass data_mean/data_std, test with a datamodule that has .mean and .std (ETTDataModule), "
            "or set crps_space='normalised'."
        )

    @override
    def on_test_start(self) -> None:
        self._scaler = self.scaler()

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        given, observed, target = self.unpack_windows(batch)
        cond = self.evaluation_mask(observed, batch_idx)
        samples = self.sample(given, cond)
        x = given if target is None else target  # scored on the clean values (faulted test windows)
        target_mask = observed - cond
        hidden = target_mask.bool()
        median = samples.median(dim=0).values
        for metric in (self.test_mse, self.test_rmse, self.test_mae):
            metric(median[hidden], x[hidden])  # normalised space (TSLib)
        mean, std = self._scaler if self._scaler is not None else (None, None)
        self.test_crps.update(samples, x, target_mask, mean, std)  # de-normalised (CSDI) unless told otherwise
        self.test_crps_sum.update(samples, x, target_mask, mean, std)
        self.test_windows.update(torch.tensor(float(len(x))))
        metrics = {"mse": self.test_mse, "rmse": self.test_rmse, "mae": self.test_mae}
        metrics |= {"crps": self.test_crps, "crps_sum": self.test_crps_sum, "windows": self.test_windows}
        for name, metric in metrics.items():
            self.log(f"test_{name}", metric, batch_size=len(x))

    @override
    def predict_step(self, batch: Batch, batch_idx: int) -> dict[str, Tensor]:
        given, observed, target = self.unpack_windows(batch)
        cond = self.evaluation_mask(observed, batch_idx)
        samples = self.sample(given, cond)
        clean = given if target is None else target
        return {"samples": samples, "median": samples.median(dim=0).values, "cond_mask": cond, "target": clean}

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
        offset = self.offset(x, cond_mask)
        if offset is None:
            return self._sample(x, cond_mask, s)
        drawn = self._sample(x - offset, cond_mask, s) + offset  # deviations from the context's level, level back
        return cond_mask * x + (1 - cond_mask) * drawn  # the observed points exactly, not (x - m) + m

    def _sample(self, x: Tensor, cond_mask: Tensor, s: int) -> Tensor:
        b = x.shape[0]
        xs, masks = x.repeat(s, 1, 1), cond_mask.repeat(s, 1, 1)  # [S*B, L, K], sample-major
        out = torch.empty_like(xs)
        for lo in range(0, len(xs), self.sample_chunk):
            xc, mc = xs[lo : lo + self.sample_chunk], masks[lo : lo + self.sample_chunk]
            drawn = self.schedule.sample(
                lambda x_t, t, xc=xc, mc=mc: self.predict_eps(x_t, xc, mc, t),
                xc.shape,
                x.device,
                None,
                self.clip_denoised,
            )
            out[lo : lo + len(xc)] = mc * xc + (1 - mc) * drawn
        return out.view(s, b, *x.shape[1:])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return self.optimizer(self.parameters())
