"""All DP-SGD logic and state shared by the single-device and multi-process strategies.

Per optimizer step (see ``docs/mechanism.md``)::

    training_step -> backward -> on_after_backward (raw, NOT private) -> post_backward   (x k)
        post_backward: per-example grads (x k), fp32 norms, clip, add to buckets, drop p.grad
    optimizer_step: closure() -> privatize (noise once, reduce, / qN, p.grad) ->
        on_before_optimizer_step -> gradient clipping -> optimizer.step -> ledger step

The LightningModule is never wrapped: Opacus' hooks attach to its own submodules, so
``state_dict`` keys are unchanged.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader
from typing_extensions import override

from dplightning.data.poisson import PoissonDataLoader, batch_rows, check_poisson_compatible
from dplightning.privacy.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    check_accountant,
    combined_noise_multiplier,
    compute_epsilon,
    split_noise_multiplier,
)
from dplightning.privacy.clipping import ClipGroup, available_clipping, make_clip_groups
from dplightning.privacy.grad_sample import available_grad_sample_modes, make_grad_sample_backend
from dplightning.privacy.grad_sample.backend import GradSampleBackend
from dplightning.privacy.grad_sample.validation import warn_on_batch_mean_loss
from dplightning.privacy.mechanism import BucketReducer, GradientPrivatizer, MicroBatchStats, verify_per_example_sum
from dplightning.privacy.noise import GaussianNoise
from dplightning.strategies._progress import _EpsilonProgress

CHECKPOINT_KEY = "dplightning"
VERIFY_GRADIENTS = {
    "first_steps": "the first steps with data, and the first steps after the trainable parameters change",
    "always": "every backward pass",
    "never": "no check",
}
_VERIFIED_STEPS = 2
"""Steps with a non-empty batch that ``verify_gradients="first_steps"`` checks after each (re)planning."""
NOISE_PLACEMENTS = {
    "rank0": "rank 0 adds N(0, (σΔ)²); the other ranks add none",
    "split": "every rank adds N(0, (σΔ)²/W) from its own generator; the variances sum to (σΔ)²",
}


class _DPMixin:
    """DP-SGD state and Lightning hooks; mixed in before a Lightning ``Strategy``."""

    # Provided by the Strategy this class is mixed into.
    lightning_module: pl.LightningModule | None
    optimizers: list[Optimizer]
    global_rank: int
    world_size: int
    root_device: torch.device

    def _dp_init(
        self,
        noise_multiplier: float | None,
        target_epsilon: float | None,
        max_grad_norm: float,
        delta: float | None,
        accountant: str,
        clipping: str,
        poisson_sampling: bool,
        secure_mode: bool,
        loss_reduction: str,
        grad_sample_mode: str,
        bucket_cap_mb: float,
        seed: int | None,
        noise_placement: str = "rank0",
        verify_gradients: str = "first_steps",
    ) -> None:
        _check_noise_arguments(noise_multiplier, target_epsilon, poisson_sampling)
        if not max_grad_norm > 0 or not math.isfinite(max_grad_norm):
            raise ValueError(f"max_grad_norm (the clipping bound C) must be finite and > 0, got {max_grad_norm}.")
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {delta}.")
        if clipping not in available_clipping():
            raise ValueError(f"Unknown clipping {clipping!r}; choose one of {available_clipping()}.")
        if grad_sample_mode not in available_grad_sample_modes():
            raise ValueError(
                f"Unknown grad_sample_mode {grad_sample_mode!r}; choose one of {available_grad_sample_modes()}."
            )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        if noise_placement not in NOISE_PLACEMENTS:
            raise ValueError(f"Unknown noise_placement {noise_placement!r}; choose one of {sorted(NOISE_PLACEMENTS)}.")
        if verify_gradients not in VERIFY_GRADIENTS:
            raise ValueError(
                f"Unknown verify_gradients {verify_gradients!r}; choose one of {sorted(VERIFY_GRADIENTS)}."
            )
        self.verify_gradients = verify_gradients
        self.noise_placement = noise_placement
        self._trainer: pl.Trainer | None = None
        self.target_epsilon = target_epsilon
        self.max_grad_norm = float(max_grad_norm)
        self.accountant = check_accountant(accountant)
        self.clipping = clipping
        self.poisson_sampling = poisson_sampling
        self.secure_mode = secure_mode
        self.loss_reduction = loss_reduction
        self.grad_sample_mode = grad_sample_mode
        self.bucket_cap_mb = bucket_cap_mb
        self.seed = seed
        self._noise_multiplier = noise_multiplier
        self._delta = delta
        self._sample_rate: float | None = None
        self._num_samples: int | None = None
        self._expected_batch_size: float | None = None
        self.ledger = PrivacyLedger(accountant)
        self._step_releases: dict[str, float] = {}
        self._backend: GradSampleBackend | None = None
        self._privatizer: GradientPrivatizer | None = None
        self._noise: GaussianNoise | None = None
        self._resume_state: dict[str, Any] | None = None
        self._resumed_sampling: tuple[float | None, int | None] | None = None
        self._batch_rows: int | None = None
        self._batches_since_release = 0
        self._closure_calls = 0
        self._pending: dict[nn.Parameter, Tensor] = {}
        """Manual optimization: per-example gradients summed over the backward passes of one batch."""
        self._plan_signature: tuple[int, ...] = ()
        self._verify_steps = 0
        self._verified_rows = False
        self._extra_handles: list[Any] = []
        self._step_stats: list[MicroBatchStats] = []
        self.last_step_stats: list[MicroBatchStats] = []
        """Per-backward statistics of the last optimizer step (raw norms: NOT private)."""
        self.nonfinite_examples = 0
        """Examples whose per-example gradient was not finite (they contributed zero)."""

    # ------------------------------------------------------------------ public API

    @property
    def noise_multiplier(self) -> float | None:
        """σ; ``None`` until calibrated from ``target_epsilon`` (at the start of fit)."""
        return self._noise_multiplier

    @property
    def accounted_noise_multiplier(self) -> float | None:
        """σ the ledger records per step: σ_eff of the gradient and every registered step release.

        Equals :attr:`noise_multiplier` when nothing else is released (see :meth:`register_step_release`).
        """
        if self._noise_multiplier is None or not self._step_releases:
            return self._noise_multiplier
        return combined_noise_multiplier([self._noise_multiplier, *self._step_releases.values()])

    @property
    def step_releases(self) -> dict[str, float]:
        """Registered per-step releases besides the gradient: name -> noise multiplier."""
        return dict(self._step_releases)

    def register_step_release(self, name: str, noise_multiplier: float) -> None:
        """Account one more Gaussian release made at every step from the step's Poisson sample.

        The caller releases, once per optimizer step, a statistic of the examples in that
        step with sensitivity 1 (e.g. a count of clipped examples) plus N(0, σ_r²) noise,
        added exactly once across ranks. Gradient and statistic together form one Gaussian
        mechanism, so from now on the ledger records σ_eff = (σ⁻² + Σ_r σ_r⁻²)^(-1/2) per step
        (whether or not the caller releases at that step), and ``target_epsilon`` calibration
        aims at σ_eff, giving the gradient σ = (σ_eff⁻² − Σ_r σ_r⁻²)^(-1/2).

        Args:
            name: Name of the release (registering a name again replaces its σ_r).
            noise_multiplier: σ_r, the noise std of the release in units of its sensitivity.

        Raises:
            ValueError: If ``noise_multiplier`` is not finite and > 0.
            RuntimeError: If σ was already calibrated for ``target_epsilon`` without this release:
                register in ``Callback.setup``, before fit starts.
        """
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"Step release {name!r} needs a finite noise multiplier > 0, got {noise_multiplier}.")
        calibrated = self.target_epsilon is not None and self._noise_multiplier is not None
        if calibrated and self._step_releases.get(name) != float(noise_multiplier):
            raise RuntimeError(
                f"σ was already calibrated for target_epsilon={self.target_epsilon} without step release {name!r}; "
                "register step releases before fit starts (in Callback.setup)."
            )
        self._step_releases[name] = float(noise_multiplier)

    @property
    def sample_rate(self) -> float | None:
        """Poisson sampling rate q (global), known once the train loader is set up."""
        return self._sample_rate

    @property
    def expected_batch_size(self) -> float | None:
        """Public expected batch size q·N that the noisy sum is divided by."""
        return self._expected_batch_size

    @property
    def delta(self) -> float | None:
        """δ: as given, or 1/(10·N) once the training set size N is known."""
        if self._delta is None and self._num_samples:
            return 1.0 / (10 * self._num_samples)
        return self._delta

    @property
    def steps(self) -> int:
        """Noisy optimizer steps taken (and accounted), including resumed ones."""
        return self.ledger.steps

    @property
    def noise_std(self) -> float:
        """Std of the noise added to the clipped sum: σ·Δ (Δ = joint sensitivity, C for flat)."""
        sensitivity = self._privatizer.sensitivity if self._privatizer else self.max_grad_norm
        return (self._noise_multiplier or 0.0) * sensitivity

    @property
    def clip_groups(self) -> list[ClipGroup]:
        """The clipping groups (names, bounds, parameters) in :class:`MicroBatchStats` column order."""
        return list(self._privatizer.groups) if self._privatizer else []

    @property
    def privatized_parameter_names(self) -> list[str]:
        """Names of the privatized parameters in :attr:`MicroBatchStats.param_sq_norms` column order."""
        if self._privatizer is None or self.lightning_module is None:
            return []
        names = {p: n for n, p in self.lightning_module.named_parameters()}
        return [names[p] for p in self._privatizer.params]

    def get_epsilon(self, delta: float | None = None) -> float:
        """Exact ε spent so far at ``delta`` (default: the strategy's δ).

        Returns ``inf`` when ``poisson_sampling=False``: the accountant's guarantee
        assumes Poisson sampling.
        """
        if not self.poisson_sampling:
            return math.inf
        delta = delta if delta is not None else self.delta
        if delta is None:
            raise RuntimeError("δ is unknown until the training set size is known; pass delta explicitly.")
        return self.ledger.get_epsilon(delta)

    def epsilon_bound(self, delta: float | None = None) -> float:
        """Cheap upper bound on ε for progress bars (see :meth:`PrivacyLedger.epsilon_bound`)."""
        if not self.poisson_sampling:
            return math.inf
        delta = delta if delta is not None else self.delta
        return self.ledger.epsilon_bound(delta) if delta is not None else math.nan

    def dp_state_dict(self) -> dict[str, Any]:
        """Public privacy state for checkpoints (never any seed or generator state)."""
        return {
            "ledger": self.ledger.state_dict(),
            "noise_multiplier": self._noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "max_grad_norm": self.max_grad_norm,
            "sample_rate": self._sample_rate,
            "num_samples": self._num_samples,
            "delta": self.delta,
            "clipping": self.clipping,
            "poisson_sampling": self.poisson_sampling,
            "step_releases": dict(self._step_releases),
        }

    # ------------------------------------------------------------------ Lightning hooks
    # The mixin comes first in the MRO, so these wrap the Strategy's own hooks.

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._dp_check_trainer(trainer)
        super().setup(trainer)  # type: ignore[misc]
        self._dp_setup(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._dp_process_dataloader(super().process_dataloader(dataloader))  # type: ignore[misc]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        batch = args[0] if args else kwargs.get("batch")
        parent = super()
        return self._dp_training_step(lambda: parent.training_step(*args, **kwargs), batch)  # type: ignore[misc]

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)  # type: ignore[misc]
        self._dp_post_backward()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        self._closure_calls = 0
        return super().optimizer_step(optimizer, self._wrap_closure(closure), model, **kwargs)  # type: ignore[misc]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        self._dp_on_save(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self._dp_on_load(checkpoint)
        return checkpoint

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._check_one_train_loader()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        self._dp_report()

    @override
    def teardown(self) -> None:
        self._dp_teardown()
        super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------ setup phase

    def _dp_check_trainer(self, trainer: pl.Trainer) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None:
            raise ValueError(
                "precision='16-mixed' uses a GradScaler, which scales per-example gradients and skips steps on "
                "overflow (a data-dependent channel). Use precision='bf16-mixed' or '32-true'."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                "GradientAccumulationScheduler changes the micro-batch split during training; set a constant "
                "Trainer(accumulate_grad_batches=k) instead (k splits one Poisson batch, it does not change q)."
            )
        if trainer.gradient_clip_val:
            rank_zero_warn(
                "gradient_clip_val clips the already-private (noisy) gradient: harmless post-processing, but it "
                f"is not per-example clipping. The per-example bound is max_grad_norm={self.max_grad_norm}."
            )
        module = trainer.lightning_module
        if is_overridden("on_after_backward", module):
            rank_zero_warn(
                "on_after_backward sees the raw, non-private gradient; do not log or release anything from it. "
                "Use on_before_optimizer_step to see the private gradient."
            )

    def _dp_setup(self, trainer: pl.Trainer) -> None:
        """Attach per-example hooks, lay out buckets and restore the ledger (fit only)."""
        self._trainer = trainer
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._plan()
        module = self.lightning_module
        assert module is not None
        capturing = lambda: self._backend is not None and self._backend.capturing  # noqa: E731
        self._extra_handles = warn_on_batch_mean_loss(module, capturing)
        self._noise = GaussianNoise(self.seed, rank=self.global_rank, secure_mode=self.secure_mode)
        self._restore_dp_state(trainer)
        # A callback with `shows_epsilon = True` (e.g. dplightning.callbacks.PrivacyBudget) logs ε itself.
        if not any(getattr(cb, "shows_epsilon", False) for cb in trainer.callbacks):
            trainer.callbacks.append(_EpsilonProgress())

    def _plan(self) -> None:
        """Hook the layers of the trainable parameters and lay out their buckets.

        Runs at setup and again at the start of any step where the optimizer's trainable
        parameters differ from the planned ones (e.g. a callback unfreezing a backbone).
        """
        optimizer = self._single_optimizer()
        named = self._privatized_parameters(optimizer)
        module = self.lightning_module
        assert module is not None
        if self._backend is not None:
            self._backend.close()
        self._backend = make_grad_sample_backend(self.grad_sample_mode, module, self.loss_reduction)
        self._backend.capturing = False
        groups = make_clip_groups(self.clipping, named, self.max_grad_norm)
        self._privatizer = GradientPrivatizer(groups, bucket_cap_mb=self.bucket_cap_mb)
        self._plan_signature = self._trainable_signature(optimizer)
        self._verify_steps = _VERIFIED_STEPS if self.verify_gradients == "first_steps" else 0

    @staticmethod
    def _trainable_signature(optimizer: Optimizer) -> tuple[int, ...]:
        return tuple(id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad)

    def _replan_if_trainable_changed(self) -> None:
        optimizer = self._single_optimizer()
        if self._trainable_signature(optimizer) == self._plan_signature:
            return
        before = len(self._plan_signature)
        self._plan()
        rank_zero_info(
            f"The trainable parameters changed at step {self.ledger.steps} ({before} -> "
            f"{len(self._plan_signature)} tensors): per-example hooks and buckets re-planned."
        )

    def _single_optimizer(self) -> Optimizer:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"DP training supports exactly one optimizer, got {len(self.optimizers)}. Put all parameter "
                "groups into one optimizer (one noisy step must release all of them at once)."
            )
        optimizer = self.optimizers[0]
        if isinstance(optimizer, LBFGS):
            raise ValueError("LBFGS re-evaluates its closure; each evaluation would need fresh noise. Use SGD/Adam.")
        return optimizer

    def _privatized_parameters(self, optimizer: Optimizer) -> list[tuple[str, nn.Parameter]]:
        module = self.lightning_module
        assert module is not None
        names = {p: n for n, p in module.named_parameters()}
        in_optimizer = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        foreign = [p for p in in_optimizer if p not in names]
        if foreign:
            raise ValueError(
                f"The optimizer holds {len(foreign)} trainable tensors that are not parameters of the module."
            )
        left_out = sorted(n for p, n in names.items() if p.requires_grad and p not in set(in_optimizer))
        if left_out:
            rank_zero_warn(f"Trainable parameters not in the optimizer get no gradient under DP: {left_out[:5]}...")
        return [(names[p], p) for p in dict.fromkeys(in_optimizer)]

    def _restore_dp_state(self, trainer: pl.Trainer) -> None:
        state, self._resume_state = self._resume_state, None
        if state is None:
            if trainer.ckpt_path is not None:
                raise ValueError(
                    f"The checkpoint {trainer.ckpt_path} has no privacy ledger ('{CHECKPOINT_KEY}' entry): it was not "
                    "written by a DP strategy, so ε cannot continue. To fine-tune from its weights, load them with "
                    "`model.load_state_dict(torch.load(path)['state_dict'])` and start a new run."
                )
            return
        self.ledger.load_state_dict(state["ledger"])
        self._resumed_sampling = (state.get("sample_rate"), state.get("num_samples"))
        if self.target_epsilon is not None and state.get("noise_multiplier") is not None:
            self._noise_multiplier = float(state["noise_multiplier"])  # keep the σ the run was calibrated with
        if self._delta is None and state.get("delta") is not None:
            self._delta = float(state["delta"])
        rank_zero_info(f"Resumed privacy ledger: {self.ledger.steps} steps, history {list(self.ledger.history)}.")

    def _dp_teardown(self) -> None:
        if self._backend is not None:
            self._backend.close()
        for handle in self._extra_handles:
            handle.remove()
        self._extra_handles = []
        self._backend = None
        self._privatizer = None
        self._step_stats = []
        self._pending = {}

    # ------------------------------------------------------------------ data

    def _dp_process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"DP training needs a torch DataLoader as train loader, got {type(dataloader).__name__}.")
        n = len(dataloader.dataset)  # type: ignore[arg-type]
        k = trainer.accumulate_grad_batches
        self._check_same_on_every_rank(dataloader, num_samples=n, batch_size=dataloader.batch_size or 0)
        if not self.poisson_sampling:
            self._set_sampling(n, dataloader.batch_size * self.world_size / n)  # type: ignore[operator]
            return dataloader
        check_poisson_compatible(dataloader)
        q = dataloader.batch_size * self.world_size / n  # type: ignore[operator]
        self._set_sampling(n, q)
        loader = PoissonDataLoader.from_dataloader(
            dataloader,
            sample_rate=q,
            micro_batches=k,
            rank=self.global_rank,
            world_size=self.world_size,
            seed=self.seed,
            secure_mode=self.secure_mode,
        )
        per_epoch = steps_per_epoch_run(trainer, len(loader))
        self._check_resumed_sampling()
        if self._noise_multiplier is None:
            self._calibrate(trainer, per_epoch)
        elif self.target_epsilon is not None and self.ledger.steps:
            self._warn_if_resumed_run_overspends(trainer, per_epoch)
        if _finite_run(trainer):  # ε for the progress bar: about 100 accountant calls per run, not one per step
            self.ledger.grid_min_gap = max(1, planned_steps(trainer, per_epoch) // 100)
        return loader

    def _check_same_on_every_rank(self, dataloader: DataLoader, **values: int) -> None:
        """Raise on every rank if the ranks disagree on ``values`` (a multi-process strategy checks)."""

    def _check_one_train_loader(self) -> None:
        trainer = self._trainer
        if trainer is None or self._privatizer is None:
            return
        loaders, _ = tree_flatten(trainer.train_dataloader)
        if len(loaders) > 1:
            raise ValueError(
                f"DP training takes exactly one train loader, got {len(loaders)} (a list, dict or CombinedLoader). "
                "Each loader would be a separate Poisson sample with its own q, N and δ, and the ledger accounts "
                "one. Concatenate the data sets into one (torch.utils.data.ConcatDataset) instead."
            )

    def _check_resumed_sampling(self) -> None:
        resumed, self._resumed_sampling = self._resumed_sampling, None
        if resumed is None:
            return
        old_q, old_n = resumed
        if old_q is None or (old_q == self._sample_rate and old_n == self._num_samples):
            return
        change = (
            f"This run resumes a checkpoint that sampled at q = {old_q:.4g} from N = {old_n} examples; now "
            f"q = {self._sample_rate:.4g} from N = {self._num_samples} (another world size, batch size or data set)."
        )
        if self.target_epsilon is not None:
            raise ValueError(
                f"{change} σ = {self._noise_multiplier:.4g} was calibrated for target_epsilon = {self.target_epsilon} "
                "at the old q, so the budget would be overspent. Resume with the same world size, batch size and "
                "data set, or continue with an explicit noise_multiplier (ε is then accounted at the new q)."
            )
        rank_zero_warn(f"{change} The ledger accounts the new q from here on; ε stays exact.")

    def _warn_if_resumed_run_overspends(self, trainer: pl.Trainer, per_epoch: int) -> None:
        assert self.target_epsilon is not None and self._sample_rate is not None
        remaining = planned_steps(trainer, per_epoch) - self.ledger.steps
        if remaining <= 0 or self.delta is None:
            return
        segment = (self.accounted_noise_multiplier, self._sample_rate, remaining)
        projected = compute_epsilon([*self.ledger.history, segment], self.delta, self.accountant)
        if projected > self.target_epsilon:
            rank_zero_warn(
                f"The resumed run keeps σ = {self._noise_multiplier:.4g}, calibrated for target_epsilon = "
                f"{self.target_epsilon} over the original run, but now plans {remaining} more steps: it will end at "
                f"ε = {projected:.4g} > {self.target_epsilon}. The reported ε stays exact; add "
                "dplightning.callbacks.PrivacyBudget to stop at the budget, or keep max_steps / max_epochs."
            )

    def _set_sampling(self, num_samples: int, sample_rate: float) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(
                f"Sampling rate q = batch_size x world_size / N = {sample_rate:.4g} must lie in (0, 1]; "
                f"lower the train loader's batch_size (N = {num_samples})."
            )
        self._num_samples, self._sample_rate = num_samples, sample_rate
        self._expected_batch_size = sample_rate * num_samples
        if self.delta is not None and self.delta >= 1.0 / num_samples:
            rank_zero_warn(
                f"delta = {self.delta:.3g} >= 1/N = {1 / num_samples:.3g}: a mechanism that releases one random "
                "example satisfies this δ. Use δ << 1/N (default 1/(10N))."
            )

    def _calibrate(self, trainer: pl.Trainer, per_epoch: int) -> None:
        assert self.target_epsilon is not None and self._sample_rate is not None
        total = planned_steps(trainer, per_epoch)
        rank_zero_info(f"Calibrating σ for ε = {self.target_epsilon} over {total} steps ({self.accountant})...")
        effective = calibrate_noise_multiplier(
            self.target_epsilon,
            self.delta,
            self._sample_rate,
            total,
            self.accountant,  # type: ignore[arg-type]
        )
        # The ledger records σ_eff of everything released per step; the gradient gets what the releases leave.
        self._noise_multiplier = split_noise_multiplier(effective, self._step_releases.values())
        shared = f" (σ_eff = {effective:.4f} with step releases {self.step_releases})" if self._step_releases else ""
        rank_zero_info(f"Calibrated noise multiplier σ = {self._noise_multiplier:.4f}{shared}.")

    # ------------------------------------------------------------------ the step

    def _dp_training_step(self, run: Callable[[], Any], batch: Any) -> Any:
        if self._privatizer is None or self._backend is None:
            return run()
        module = self.lightning_module
        assert module is not None
        if self._batches_since_release == 0:
            self._replan_if_trainable_changed()
        if self._pending:
            raise RuntimeError(
                "Under DP, manual optimization must call opt.step() exactly once per training batch, after its "
                "backward passes; the previous batch ran manual_backward without an opt.step() after it."
            )
        self._batch_rows = batch_rows(batch)
        self._batches_since_release += 1
        # Empty Poisson batches run training_step too: under dp_ddp every rank must reach the same
        # collectives (self.log(sync_dist=True), all_gather, metric syncs) whatever its local batch.
        try:
            with self._backend.capture(self._batch_rows):
                return run()
        except Exception as err:
            if self._batch_rows == 0:
                raise RuntimeError(
                    "training_step failed on an empty batch (0 rows). Poisson sampling makes empty batches (each "
                    "example joins with probability q), and every rank runs training_step on them so that the "
                    "ranks stay in lock-step. Make the step cope with zero rows, e.g. reduce the loss as "
                    "sum / max(n, 1)."
                ) from err
            raise

    def _dp_post_backward(self) -> None:
        if self._privatizer is None or self._backend is None:
            return
        module = self.lightning_module
        assert module is not None
        grads = self._backend.pop(self._privatizer.params)
        if self.verify_gradients == "always" or self._verify_steps > 0:
            self._verify(grads)
        for p in module.parameters():
            if p.requires_grad:
                p.grad = None  # the raw sum is not private; only the released gradient may reach the optimizer
        if module.automatic_optimization:
            self._accumulate(grads)  # one backward pass per micro-batch: its examples are complete
        else:
            # Several backward passes over one batch: sum each example's gradient before clipping it once.
            for p, gs in grads.items():
                self._pending[p] = self._pending[p] + gs if p in self._pending else gs

    def _accumulate(self, grads: dict[nn.Parameter, Tensor]) -> None:
        assert self._privatizer is not None and self._trainer is not None
        module = self.lightning_module
        assert module is not None
        scale = float(self._trainer.accumulate_grad_batches) if module.automatic_optimization else 1.0
        stats = self._privatizer.accumulate(grads, scale=scale)
        rows = stats.norms.shape[0]
        if grads and self._batch_rows is not None and rows != self._batch_rows:
            raise RuntimeError(
                f"Per-example gradients have {rows} rows but the batch has {self._batch_rows} examples: is a layer "
                "fed sequence-first (batch_first=False) input? The privacy unit must be the batch's first dimension."
            )
        self.nonfinite_examples += stats.nonfinite
        self._step_stats.append(stats)

    def _verify(self, grads: dict[nn.Parameter, Tensor]) -> None:
        """Refuse to train if autograd's gradient is not the sum of the per-example gradients.

        A contribution that bypasses the per-example hooks (a weight used outside its layer's
        forward, a layer the hooks pair wrongly) would otherwise be dropped silently.
        """
        assert self._privatizer is not None
        rows = self._batch_rows or 0
        mismatched = verify_per_example_sum(self._privatizer.params, grads, self._per_row_factor(rows))
        if rows:
            self._verified_rows = True
        if mismatched:
            names = {p: n for n, p in self.lightning_module.named_parameters()}  # type: ignore[union-attr]
            listed = ", ".join(f"{names.get(p, '?')} (relative error {err:.2g})" for p, err in mismatched[:8])
            raise RuntimeError(
                f"Autograd's gradient differs from the sum of the per-example gradients for: {listed}. Part of these "
                "parameters' gradient bypasses the per-example hooks, so it could not be clipped per example: a "
                "weight used outside its own module's forward (F.linear(h, emb.weight), a penalty on a weight in "
                "training_step), or a custom autograd path. Use the weight through its module (tie it to an "
                "nn.Linear), move weight penalties into the optimizer (weight_decay), or freeze it. "
                "(verify_gradients='never' turns this check off.)"
            )

    def _per_row_factor(self, rows: int) -> float:
        """Factor from the per-example gradients' sum to autograd's gradient of one backward pass."""
        return 1.0 / rows if self.loss_reduction == "mean" and rows else 1.0

    def _wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        if self._privatizer is None:
            return closure

        def private_closure() -> Any:
            self._closure_calls += 1
            if self._closure_calls > 1:
                raise RuntimeError(
                    "The optimizer evaluated its closure a second time within one step (SAM, extragradient, line "
                    "searches do). Each evaluation would release a fresh noisy gradient of the same Poisson batch, "
                    "which the accountant charges as one step. Use an optimizer that evaluates the closure once."
                )
            result = closure()
            self._privatize()
            return result

        return private_closure

    def _bucket_reducer(self) -> BucketReducer | None:
        """Cross-rank sum of one bucket; ``None`` on one process."""
        return None

    def _local_noise_std(self) -> float:
        """Std of the noise this rank adds, so that the ranks' noise sums to N(0, (σΔ)²) exactly once."""
        assert self._privatizer is not None and self._noise_multiplier is not None
        std = self._noise_multiplier * self._privatizer.sensitivity
        if self.noise_placement == "split":
            return std / math.sqrt(self.world_size)
        return std if self.global_rank == 0 else 0.0

    def _check_one_batch_per_release(self) -> None:
        # The accountant charges one Poisson(q) batch per noisy step. Lightning enforces that for
        # automatic optimization (k micro-batches = one Poisson batch); a manual loop must step once per batch.
        module = self.lightning_module
        assert module is not None
        batches, self._batches_since_release = self._batches_since_release, 0
        if not module.automatic_optimization and batches != 1:
            raise RuntimeError(
                f"Under DP, manual optimization must call opt.step() exactly once per training batch; this step "
                f"covers {batches} batches. Several batches per step would sample at a higher rate than the "
                "accountant charges, and several steps per batch release the same examples twice. To accumulate, "
                "use automatic optimization with Trainer(accumulate_grad_batches=k)."
            )

    def _privatize(self) -> None:
        assert self._privatizer is not None and self._noise is not None
        assert self._noise_multiplier is not None and self._expected_batch_size is not None
        self._check_one_batch_per_release()
        if self._pending:
            pending, self._pending = self._pending, {}
            self._accumulate(pending)
        if self._verify_steps and self._verified_rows:
            self._verify_steps -= 1
        self._verified_rows = False
        self._noise.start_step(self.ledger.steps)
        self._privatizer.release(
            self._noise, self._local_noise_std(), self._expected_batch_size, self._bucket_reducer()
        )
        if self.poisson_sampling:
            self.ledger.step(self.accounted_noise_multiplier, self._sample_rate)  # type: ignore[arg-type]
        self.last_step_stats, self._step_stats = self._step_stats, []

    # ------------------------------------------------------------------ checkpoints

    def _dp_on_save(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.dp_state_dict()

    def _dp_on_load(self, checkpoint: dict[str, Any]) -> None:
        self._resume_state = checkpoint.get(CHECKPOINT_KEY)

    def _dp_report(self) -> None:
        if not self.ledger.steps:
            return
        eps = self.get_epsilon()
        releases = self._step_releases
        shared = f"; σ_eff = {self.accounted_noise_multiplier:.4g} with {releases}" if releases else ""
        rank_zero_info(
            f"DP-SGD: (ε = {eps:.4g}, δ = {self.delta:.3g}) after {self.ledger.steps} steps "
            f"[σ = {self._noise_multiplier:.4g}, q = {self._sample_rate:.4g}, C = {self.max_grad_norm}, "
            f"clipping = {self.clipping}, accountant = {self.accountant}{shared}]"
        )


def _check_noise_arguments(noise_multiplier: float | None, target_epsilon: float | None, poisson: bool) -> None:
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError(
            "Pass exactly one of noise_multiplier (σ) or target_epsilon (the ε to reach at the end of training), "
            f"got noise_multiplier={noise_multiplier}, target_epsilon={target_epsilon}."
        )
    if noise_multiplier is not None:
        if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}.")
        if noise_multiplier == 0:
            warnings.warn("noise_multiplier=0 adds no noise: ε is infinite (use it only for debugging).", stacklevel=3)
    if target_epsilon is not None:
        if not target_epsilon > 0 or not math.isfinite(target_epsilon):
            raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon}.")
        if not poisson:
            raise ValueError("target_epsilon needs poisson_sampling=True: the accountant assumes Poisson sampling.")


def _finite_run(trainer: pl.Trainer) -> bool:
    epochs, steps = trainer.max_epochs, trainer.max_steps
    return (epochs is not None and epochs >= 0) or (steps is not None and steps >= 0)


def steps_per_epoch_run(trainer: pl.Trainer, batches: int) -> int:
    """Optimizer steps Lightning runs per epoch of a loader of ``batches`` batches (k micro-batches each).

    Raises:
        ValueError: If ``limit_train_batches`` leaves a partial accumulation at the end of an epoch:
            Lightning would step on it, releasing part of one Poisson batch as if it were a whole one.
    """
    limit, k = trainer.limit_train_batches, trainer.accumulate_grad_batches
    run = min(batches, limit) if isinstance(limit, int) else int(batches * limit)  # as Lightning counts them
    if run % k:
        whole = run // k * k
        raise ValueError(
            f"limit_train_batches={limit} runs {run} batches per epoch, which is not a multiple of "
            f"accumulate_grad_batches={k}: Lightning would take an optimizer step on the last {run % k} micro-batches "
            "alone, a part of one Poisson batch that the accountant does not cover. Use "
            f"limit_train_batches={whole or k} or {whole + k} (a multiple of {k})."
        )
    return run // k


def planned_steps(trainer: pl.Trainer, per_epoch: int) -> int:
    """Optimizer steps the run will take: ``min(max_steps, max_epochs x steps per epoch)``."""
    epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else math.inf
    max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else math.inf
    total = min(max_steps, epochs * per_epoch)
    if not math.isfinite(total):
        raise ValueError("target_epsilon needs a finite training length: set max_epochs or max_steps.")
    return int(total)
