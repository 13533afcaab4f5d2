"""The Lightning hooks of the DP strategies: a thin layer over three composed parts.

* :class:`~dplightning.strategies.config.DPConfig`: the validated DP arguments.
* :class:`~dplightning.strategies.accounting.PrivacyAccounting`: σ, q, N, δ, the ledger and
  its checkpoint state (no Trainer).
* :class:`~dplightning.strategies.private_step.PrivateStep`: per-example gradients, clipping,
  noise and the release (built at setup, when the module and optimizer are known).

What callbacks and users read of the run is one read-only object,
:class:`~dplightning.strategies.state.DPState` (``strategy.dp_state``).

Per optimizer step (``docs/dp_sgd_core.md``, "The mechanism, step by step")::

    (training_step -> backward -> on_after_backward -> post_backward: clip into buckets)  x k micro-batches
    optimizer_step: closure() { the k micro-batches above; release: noise once, / qN, p.grad; ledger step }
        -> on_before_optimizer_step (private) -> gradient clipping (private) -> optimizer.step

The ledger counts the step inside the closure, when the noisy gradient is released and
before any update can be observed. The LightningModule is never wrapped: the hooks attach
to its own submodules, so ``state_dict`` keys are unchanged.
"""

from __future__ import annotations

import math
import pickle
import secrets
import uuid
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader
from typing_extensions import override

from dplightning._state import known
from dplightning.privacy.accounting import PrivacyLedger
from dplightning.privacy.correlated_noise import CorrelatedBucketNoise, marginal_std_factors
from dplightning.privacy.grad_sample.validation import refuse_batch_mean_loss
from dplightning.privacy.matrix_mechanism import Strategy as NoiseStrategy
from dplightning.privacy.mechanism import BucketReducer, MicroBatchStats
from dplightning.privacy.noise import GaussianNoise, derive_seed
from dplightning.privacy.poisson import (
    CyclicPoissonBatchSampler,
    PoissonBatchSampler,
    PoissonDataLoader,
    batch_rows,
    check_poisson_compatible,
    loader_batch_size,
)
from dplightning.privacy.provenance import data_provenance
from dplightning.privacy.record import CHECKPOINT_KEY, PrivacyRecord
from dplightning.privacy.release import ReleaseSpec, decision, observers
from dplightning.protocols import CountsExamples, ShowsEpsilon
from dplightning.strategies._trainer import trainer_callbacks
from dplightning.strategies.accounting import PrivacyAccounting, mechanism_of
from dplightning.strategies.checkpoint import DPCheckpointIO
from dplightning.strategies.config import DPConfig
from dplightning.strategies.correlated import build_strategy, describe_workload, strategy_sensitivity, workload_of
from dplightning.strategies.coupling import (
    AloneProbe,
    CouplingProbe,
    evaluating,
    probe_batch,
    quietly,
    rng_state,
    row_shapes_differ,
    step_loss,
)
from dplightning.strategies.engine_report import report_engines
from dplightning.strategies.journal import PrivacyJournal
from dplightning.strategies.private_logging import watch_private_logs
from dplightning.strategies.private_step import PrivateStep
from dplightning.strategies.state import CorrelatedPlan, DPState, FitParts
from dplightning.strategies.verification import VERIFIED_STEPS


def _state_alias(name: str) -> Any:
    """A read-only property of the strategy that returns ``dp_state.<name>``: a deprecated alias.

    The strategy used to forward each of these values itself; they now live on
    :class:`~dplightning.strategies.state.DPState`, and the alias keeps code that reads them on
    the strategy working. Each read warns with a ``DeprecationWarning`` attributed to the reading
    line (``stacklevel=2``: the getter is one frame below it), so users find their own code.
    """

    def read(self: _DPHooks) -> Any:
        warnings.warn(
            f"strategy.{name} is deprecated; read strategy.dp_state.{name} "
            "(or dplightning.protocols.dp_state_of(strategy)) instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self.dp_state, name)

    summary = (getattr(DPState, name).__doc__ or "").strip().splitlines()[0]
    return property(read, doc=f"{summary}\n\nDeprecated alias: read ``dp_state.{name}`` (:class:`DPState`).")


class _DPHooks(Strategy):
    """DP-SGD's Lightning hooks, placed before a concrete Strategy in the MRO (``super()`` is that Strategy)."""

    if TYPE_CHECKING:  # given by that concrete Strategy (an attribute of SingleDeviceStrategy, a property of DDP's)
        global_rank: int
        world_size: int

    def _dp_init(self, config: DPConfig) -> None:
        self.dp_config = config
        self.accounting = PrivacyAccounting(config)
        self._fit = FitParts()
        self.dp_state = DPState(config, self.accounting, self._fit)
        """The run's public DP state (σ, q, δ, ledger, ε, the last step's raw statistics), read-only."""
        self._trainer: pl.Trainer | None = None
        self._resume_record: PrivacyRecord | None = None
        self._batches_since_release = 0
        self._accumulating_epoch = 0  # the epoch of the micro-batches accumulated since the last release
        self._closure_calls = 0
        self._extra_handles: list[Any] = []
        self._engines: dict[str, str] = {}  # layer -> engine, kept after teardown for the checkpoint
        self._engine_table: str | None = None  # the last setup's, kept after teardown
        self._rows_per_unit = 1
        self._run_id = uuid.uuid4().hex  # names this run's privacy journal; kept in its checkpoints
        self._warned_nonfinite = False
        self._nonfinite_seen = 0  # the count at the last release (examples are counted when clipped)
        self._probes_compared = 0  # steps of this fit whose coupling probe compared examples on every rank
        self._probe_compared_step = False  # whether this step's probe compared two units or more here
        self._partition_seed: int | None = None  # secret seed of the cyclic sampler's split, one per run
        self._cyclic_dataset: tuple[object, int] | None = None  # the data set the split was drawn over, and its N
        self._sampler: PoissonBatchSampler | None = None  # the train loader's Poisson sampler
        self._train_loader: DataLoader | None = None
        self._batch_indices: list[int] = []  # the data set indices of the batch in training_step now

    # ------------------------------------------------------------------ public API

    @property
    def private_step(self) -> PrivateStep | None:
        """The running fit's private step (``None`` outside a fit)."""
        return self._fit.step

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
        self.accounting.register_step_release(name, noise_multiplier)

    # Deprecated aliases of dp_state's values, kept because the docs, scripts and tests read them on the strategy.
    noise_multiplier: float | None = _state_alias("noise_multiplier")
    accounted_noise_multiplier: float | None = _state_alias("accounted_noise_multiplier")
    ledger: PrivacyLedger = _state_alias("ledger")
    poisson_sampling: bool = _state_alias("poisson_sampling")
    max_grad_norm: float = _state_alias("max_grad_norm")
    target_epsilon: float | None = _state_alias("target_epsilon")
    sample_rate: float | None = _state_alias("sample_rate")
    expected_batch_size: float | None = _state_alias("expected_batch_size")
    delta: float | None = _state_alias("delta")
    steps: int = _state_alias("steps")
    noise_mechanism: str = _state_alias("noise_mechanism")
    noise_strategy: NoiseStrategy | None = _state_alias("noise_strategy")
    noise_sensitivity: float = _state_alias("noise_sensitivity")
    noise_std: float = _state_alias("noise_std")
    last_step_stats: list[MicroBatchStats] = _state_alias("last_step_stats")
    nonfinite_examples: int = _state_alias("nonfinite_examples")
    probing: bool = _state_alias("probing")

    def engine_table(self) -> str:
        """The clipping engine of every hooked layer, as a table (setup prints a one-line summary).

        Also written to ``dp_engines.txt`` in the trainer's log folder when it has a logger.

        Raises:
            RuntimeError: Before the first fit has set up the per-example hooks.
        """
        if self.private_step is not None:
            return self.private_step.summary()  # current: re-planned if the trainable parameters changed
        if self._engine_table is None:
            raise RuntimeError("No engine table yet: the per-example hooks are set up at the start of fit.")
        return self._engine_table

    def get_epsilon(self, delta: float | None = None) -> float:
        """Exact ε spent so far at ``delta`` (default: the strategy's δ); ``inf`` without Poisson sampling."""
        return self.dp_state.get_epsilon(delta)

    def epsilon_bound(self, delta: float | None = None) -> float:
        """Cheap upper bound on ε for progress bars (see :meth:`PrivacyLedger.epsilon_bound`)."""
        return self.dp_state.epsilon_bound(delta)

    def privacy_record(self) -> PrivacyRecord:
        """The run's privacy record, as every checkpoint stores it (never any seed or generator state).

        Besides the accounting's part (:meth:`PrivacyAccounting.record`: the ledger, σ, q, δ, the
        exact ε at the run's δ now, the library versions) it holds what ``dplightning
        privacy-report`` shows of the run: the engine of every layer, the privacy unit (as the
        data declares it, :mod:`dplightning.privacy.provenance`), what the data computed outside
        the DP steps and the world size.
        """
        record = self.accounting.record()
        mechanism = dict(record.noise_mechanism or {})
        if self._fit.correlated is not None:  # public: C depends on the planned steps and the optimizer only
            mechanism["sensitivity"] = self._fit.correlated.sensitivity
        return replace(
            record,
            noise_mechanism=mechanism,
            world_size=self.world_size,
            rows_per_unit=self._rows_per_unit,
            **data_provenance(self._trainer, self._rows_per_unit),  # the data's privacy unit, not covered
            layer_engines=dict(self._engines),  # the count of non-finite examples stays out: a raw count of the data
            run_id=self._run_id,
        )

    def dp_state_dict(self) -> dict[str, Any]:
        """:meth:`privacy_record` as the checkpoint stores it (plain values)."""
        return self.privacy_record().to_dict()

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_trainer(trainer)
        # Known before super().setup(): configure_optimizers may build the train loader there
        # (trainer.estimated_stepping_batches), and it must be Poisson-wrapped like any other.
        self._trainer = trainer
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_fit(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not _building_train_loader(trainer):
            return dataloader
        loader = self._private_loader(trainer, dataloader)
        # The batches' indices (and, cyclic, their release steps) come from a Poisson loader's sampler.
        self._sampler, self._train_loader = None, None
        if isinstance(loader, PoissonDataLoader):
            self._sampler, self._train_loader = loader.batch_sampler, loader
        return loader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._check_one_train_loader()
        if self.dp_config.correlated and self.private_step is not None:
            self._build_noise_strategy()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        step, parent_step = self.private_step, super().training_step
        if step is None:
            return parent_step(*args, **kwargs)
        return self._private_training_step(step, lambda: parent_step(*args, **kwargs), args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        step = self.private_step
        if step is None or not step.replaying:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Strategy.backward with the clip replay between the two halves: the first pass keeps the graph
        # (the precision plugin's post_backward detaches the loss, so the replay must come before it).
        module = known(self.lightning_module, "the LightningModule")
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **{**kwargs, "retain_graph": True})
        first = closure_loss
        step.replay(lambda: first.backward())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        if self.private_step is not None:
            try:
                self.private_step.after_backward()  # the checks that refuse a step run here
            except (RuntimeError, ValueError) as err:
                steps = self.dp_state.steps
                if not steps or type(err) not in (RuntimeError, ValueError):
                    raise
                # A refusal after a release does not undo it: say what the run had already spent.
                raise type(err)(
                    f"{err}\nThis step was not released, but the run had already released {steps} noisy step(s) "
                    f"before this check refused; they stay spent (ε = {self.get_epsilon():.4g} at δ = "
                    f"{self.dp_state.delta:.3g}, in the ledger and in any checkpoint written)."
                ) from err

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        self._closure_calls = 0
        return super().optimizer_step(optimizer, self._private_closure(closure), model, **kwargs)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's checkpoint I/O (its default, or the one given), held inside a :class:`DPCheckpointIO`.

        Every checkpoint Lightning writes through the strategy then carries the privacy record,
        and a local one is written atomically (``strategies/checkpoint.py``).
        """
        io = super().checkpoint_io  # Lightning's default, set up as Lightning sets it up
        if not isinstance(io, DPCheckpointIO):
            io = DPCheckpointIO(self.privacy_record, io)
            self._checkpoint_io = io
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io  # wrapped when next read (the Trainer sets the one given as a plugin)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume_record = PrivacyRecord.find(checkpoint)
        return checkpoint

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.accounting.ledger.steps:
            clipping = self.private_step.clipping if self.private_step is not None else None
            rank_zero_info(self.accounting.report(self.dp_config.clipping_engine, clipping))
        if nonfinite := self.dp_state.nonfinite_examples:
            warnings.warn(
                f"{nonfinite} example(s) of this run had a non-finite per-example gradient and "
                "contributed zero to their step.",
                stacklevel=2,
            )

    @override
    def teardown(self) -> None:
        step = self._fit.step
        if step is not None:
            self._fit.final_stats, self._fit.final_nonfinite = step.last_step_stats, step.nonfinite_examples
            step.close()
        for handle in self._extra_handles:
            handle.remove()
        self._extra_handles = []
        self._fit.step = None
        super().teardown()

    # ------------------------------------------------------------------ setup

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "precision='16-mixed' uses a GradScaler, which scales per-example gradients and skips steps on "
                "overflow (a data-dependent channel). Use precision='bf16-mixed' or '32-true'."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer_callbacks(trainer)):
            raise ValueError(
                "GradientAccumulationScheduler changes the micro-batch split during training; set a constant "
                "Trainer(accumulate_grad_batches=k) instead (k splits one Poisson batch, it does not change q)."
            )
        if trainer.gradient_clip_val:
            rank_zero_warn(
                "gradient_clip_val clips the already-private (noisy) gradient: harmless post-processing, but it "
                f"is not per-example clipping. The per-example bound is max_grad_norm={self.dp_config.max_grad_norm}."
            )
        if self.dp_config.clip_replay:
            self._check_clip_replay(trainer)
        if is_overridden("on_after_backward", trainer.lightning_module):
            rank_zero_warn(
                "on_after_backward sees the raw, non-private gradient; do not log or release anything from it. "
                "Use on_before_optimizer_step to see the private gradient."
            )

    def _check_clip_replay(self, trainer: pl.Trainer) -> None:
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "clip_replay=True replays the backward pass that Lightning runs under automatic optimization; under "
                "manual optimization the backward passes are yours. Leave clip_replay off."
            )
        if self.root_device.type != "cpu" and not torch.are_deterministic_algorithms_enabled():
            rank_zero_warn(
                "clip_replay=True checks that the replayed backward pass repeats the first bit for bit and refuses a "
                f"step where it does not; kernels on {self.root_device.type} with atomic adds may not repeat. "
                "Trainer(deterministic=True) rules that out."
            )

    def _setup_fit(self, trainer: pl.Trainer) -> None:
        """Hook the module, lay out the buckets and restore the ledger."""
        module = known(self.lightning_module, "the LightningModule")
        if len(self.optimizers) != 1:
            raise ValueError(
                f"DP training supports exactly one optimizer, got {len(self.optimizers)}. For one model, put all "
                "parameter groups into one optimizer (one noisy step must release all of them at once). GANs and "
                "other multi-optimizer setups are not supported: a DP-GAN would privatize the discriminator's step "
                "alone and has to prove that the generator's step never sees a private batch, which dplightning "
                "does not check. For a private generative model, see DPDiffusion (docs/dpdm.md)."
            )
        if isinstance(self.optimizers[0], LBFGS):
            raise ValueError("LBFGS re-evaluates its closure; each evaluation would need fresh noise. Use SGD/Adam.")
        noise: GaussianNoise | CorrelatedBucketNoise
        if self.dp_config.correlated:
            self._check_correlated_fit(trainer)
            noise = CorrelatedBucketNoise(self.dp_config.seed, self.global_rank, self.dp_config.secure_mode)
        else:
            noise = GaussianNoise(self.dp_config.seed, rank=self.global_rank, secure_mode=self.dp_config.secure_mode)
        step = self._fit.step = PrivateStep(self.dp_config, module, self.optimizers[0], noise, _compute_dtype(trainer))
        step.agree = self._all_ranks_agree
        self._engines = step.engines()
        self._engine_table = step.summary()
        report_engines(self._engine_table, list(self._engines.values()), trainer, self.is_global_zero)
        self._rows_per_unit = _rows_per_unit(module)
        capturing = lambda: self._fit.step is not None and self._fit.step.capturing  # noqa: E731
        self._extra_handles = [*refuse_batch_mean_loss(module, capturing), watch_private_logs(trainer)]
        self._nonfinite_seen, self._warned_nonfinite = 0, False
        self._probes_compared, self._probe_compared_step = 0, False  # the coupling probe runs anew in every fit
        self._batches_since_release = 0  # a fit that ended mid-accumulation left its count; its buckets are gone
        self._restore_dp_state(trainer)
        self._init_from(trainer, module)
        # Not at import: dplightning.callbacks loads the data package, which `import dplightning` does not need.
        from dplightning.callbacks.progress import EpsilonProgress, NonfiniteCount, OptimizerMetrics

        if not any(isinstance(cb, ShowsEpsilon) and cb.shows_epsilon for cb in trainer_callbacks(trainer)):
            trainer_callbacks(trainer).append(EpsilonProgress())
        if not any(isinstance(cb, NonfiniteCount) for cb in trainer_callbacks(trainer)):
            trainer_callbacks(trainer).append(NonfiniteCount())
        if not any(isinstance(cb, OptimizerMetrics) for cb in trainer_callbacks(trainer)):
            trainer_callbacks(trainer).append(OptimizerMetrics())

    def _check_correlated_fit(self, trainer: pl.Trainer) -> None:
        """Refuse what a correlated-noise run's accounting does not cover, before any step."""
        name = self.dp_config.noise_mechanism
        if trainer.ckpt_path is not None or self._resume_record is not None:
            raise ValueError(
                f"Resuming is not supported with noise_mechanism={name!r}: the noise of every step depends on secret "
                "buffers carried from the previous steps, which are never written into a checkpoint (whoever holds "
                "them can subtract the noise). Start the run again from step 0, or train with the gaussian mechanism."
            )
        if self.accounting.released_steps:
            raise ValueError(
                f"A noise_mechanism={name!r} run cannot continue in a second fit: its strategy matrix and secret "
                "noise state belong to the first one. Build a new Trainer and strategy for a new run."
            )
        from dplightning.callbacks.privacy_budget import PrivacyBudget  # not at import: callbacks import strategies

        if any(isinstance(cb, PrivacyBudget) for cb in trainer_callbacks(trainer)):
            raise ValueError(
                f"PrivacyBudget is not supported with noise_mechanism={name!r}: its stopping rule charges one "
                "composition per step. Use target_epsilon= (σ is calibrated for the planned run) instead."
            )

    def _build_noise_strategy(self) -> None:
        """Build C for the planned steps and the optimizer's workload (public; seconds at 10⁴ steps on a CPU)."""
        mechanism = self.accounting.mechanism
        steps = self.accounting.planned_steps
        if steps is None:
            raise ValueError(
                f"noise_mechanism={mechanism.name!r} needs the planned number of steps (max_steps or max_epochs)."
            )
        workload = workload_of(self.optimizers[0])
        strategy = build_strategy(mechanism, steps, workload)
        if self._fit.correlated is not None and strategy != self._fit.correlated.strategy:
            raise RuntimeError("The strategy matrix of this run changed between its train loaders.")
        plan = CorrelatedPlan(strategy, strategy_sensitivity(mechanism, strategy), marginal_std_factors(strategy))
        self._fit.correlated = plan
        rank_zero_info(
            f"Correlated noise: {mechanism.describe()}; strategy matrix for {steps} steps and the workload of "
            f"{describe_workload(workload)} (sensitivity {plan.sensitivity:.4g} x Δ; {strategy.buffers} "
            "secret buffer(s) of the noised size per noising rank)."
        )

    def _restore_dp_state(self, trainer: pl.Trainer) -> None:
        record, self._resume_record = self._resume_record, None
        if record is None:
            if trainer.ckpt_path is not None:
                raise ValueError(
                    f"The checkpoint {trainer.ckpt_path} has no privacy ledger ('{CHECKPOINT_KEY}' entry): it was not "
                    "written by a DP strategy, so ε cannot continue. To fine-tune from its weights, load them with "
                    "`model.load_state_dict(torch.load(path)['state_dict'])` and start a new run."
                )
            return
        mechanism = mechanism_of(record)
        if mechanism.correlated:
            raise ValueError(
                f"The checkpoint {trainer.ckpt_path} was trained with noise_mechanism={mechanism.name!r}, which "
                "cannot be resumed: its secret noise state is not in the checkpoint. Start again from step 0. Fine-"
                "tuning from its weights in a new run starts a new ledger, and on the same data the new run's ε does "
                "not include the first run's: start it with init_from=<this checkpoint> (its ledger becomes the "
                "prior segment of the new run's, so ε, privacy-report and export cover both)."
            )
        self.accounting.restore(record)
        self._run_id = record.run_id or self._run_id
        self._charge_journaled_steps()

    def _init_from(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Start from an earlier run's checkpoint: its weights, and its ledger as a prior segment of this one.

        Fine-tuning a private model on the same data is a composition of the two runs: the new
        ledger must begin with the earlier one's steps, or the new checkpoint would claim only
        its own ε. Skipped when resuming (the resumed ledger holds the prior already).
        """
        path = self.dp_config.init_from
        if path is None or trainer.ckpt_path is not None or self.accounting.ledger.steps:
            return
        try:  # never a full unpickle: the file may come from someone else
            checkpoint = self.checkpoint_io.load_checkpoint(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"init_from={path!r} pickles objects other than tensors and plain containers, and it is loaded "
                "without running code from the file (torch.load weights_only=True). Save the earlier run's module "
                f"without such hyperparameters. ({err})"
            ) from err
        try:
            record = PrivacyRecord.from_checkpoint(checkpoint)
        except ValueError as err:
            raise ValueError(
                f"init_from={path!r} has no privacy record: it was not written by a DP strategy, so there is no ledger "
                "to carry. Load public weights with model.load_state_dict(...) instead (no prior privacy cost)."
            ) from err
        if record.poisson_sampling is False:
            raise ValueError(f"init_from={path!r} was trained without Poisson sampling (ε = ∞): nothing to compose.")
        module.load_state_dict(checkpoint["state_dict"])
        for sigma, q, steps in record.history:
            self.accounting.ledger.step(sigma, q, steps)
        rank_zero_info(
            f"init_from={path}: weights loaded; its ledger ({record.steps} step(s), history {list(record.history)}) "
            "is the prior segment of this run's, so ε covers both runs."
        )

    def _journal(self) -> PrivacyJournal | None:
        folder = self.dp_config.privacy_journal
        return PrivacyJournal(folder, self._run_id) if folder is not None else None

    def _charge_journaled_steps(self) -> None:
        """Charge the steps a killed attempt released after the checkpoint (see strategies/journal.py)."""
        journal = self._journal()
        if journal is None:
            return
        # Rank 0 reads (the folder need not be shared); every rank charges the same steps.
        released = journal.released_after(self.accounting.ledger.steps) if self.is_global_zero else None
        lost = cast(list[tuple[float, float]], self.broadcast(released))  # rank 0's list, on every rank
        for sigma, q in lost:
            self.accounting.ledger.step(sigma, q)
        if lost:
            rank_zero_warn(
                f"The privacy journal {journal.path} holds {len(lost)} noisy step(s) released after the checkpoint "
                "by the run that was killed; they are charged to the ledger too (ε covers them; global_step does not "
                f"count them): now {self.accounting.ledger.steps} steps."
            )

    # ------------------------------------------------------------------ data

    def _private_loader(self, trainer: pl.Trainer, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"DP training needs a torch DataLoader as train loader, got {type(dataloader).__name__}.")
        if self.dp_config.poisson_sampling:
            check_poisson_compatible(dataloader)  # before len(): an IterableDataset has none
        n, batch_size = _dataset_size(dataloader), loader_batch_size(dataloader)
        self._check_same_on_every_rank(dataloader, num_samples=n, batch_size=batch_size)
        k, poisson = trainer.accumulate_grad_batches, self.dp_config.poisson_sampling
        # Under Poisson sampling k splits one sampled batch (q does not depend on k); without it the
        # loader is Lightning's own and a step sums k whole batches, so the mean is over k of them.
        logical = batch_size * self.world_size * (1 if poisson else k)
        q = logical / n
        if self.dp_config.correlated:
            return self._cyclic_loader(trainer, dataloader, n, logical)
        self.accounting.set_sampling(n, q)
        rank_zero_info(_logical_batch(logical, batch_size, self.world_size, k, q, poisson))
        if not poisson:
            return dataloader
        loader = PoissonDataLoader.from_dataloader(
            dataloader,
            sample_rate=q,
            micro_batches=trainer.accumulate_grad_batches,
            rank=self.global_rank,
            world_size=self.world_size,
            seed=self.dp_config.seed,
            secure_mode=self.dp_config.secure_mode,
        )
        per_epoch = steps_per_epoch_run(trainer, len(loader))
        self.accounting.plan(planned_steps(trainer, per_epoch))
        return loader

    def _cyclic_loader(self, trainer: pl.Trainer, dataloader: DataLoader, n: int, logical: int) -> DataLoader:
        """Cyclic Poisson sampling over the partitions of a correlated mechanism (``data/poisson.py``)."""
        partitions, name = self.dp_config.partitions, self.dp_config.noise_mechanism
        rate = partitions * logical / n  # within a partition: the expected batch stays `logical`
        if rate > 1:
            raise ValueError(
                f"noise_mechanism={name!r} samples one of {partitions} partitions of about {n / partitions:.4g} "
                f"examples per step, at rate {partitions} x {logical} / {n} = {rate:.4g} > 1 for an expected batch of "
                f"{logical}: lower the batch size or cyclic_partitions (at most N / expected batch = "
                f"{n // logical})."
            )
        if self._partition_seed is None:  # secret (never saved), the same on every rank and for every reload
            local = derive_seed(self.dp_config.seed, "partitions") if self.dp_config.seed is not None else None
            self._partition_seed = int(self.broadcast(local if local is not None else secrets.randbits(63)))
        self._check_same_on_every_rank(dataloader, partitions=partitions, partition_seed=self._partition_seed)
        self._check_same_data_set(dataloader.dataset, n)
        self.accounting.set_sampling(n, rate)
        loader = PoissonDataLoader.from_dataloader(
            dataloader,
            sample_rate=rate,
            partitions=partitions,
            partition_seed=self._partition_seed,
            micro_batches=trainer.accumulate_grad_batches,
            rank=self.global_rank,
            world_size=self.world_size,
            seed=self.dp_config.seed,
            secure_mode=self.dp_config.secure_mode,
            position=lambda: self.dp_state.steps,
        )
        per_epoch = steps_per_epoch_run(trainer, len(loader))
        if per_epoch % partitions:
            raise ValueError(
                f"Lightning runs {per_epoch} steps per epoch, not a multiple of cyclic_partitions={partitions}: the "
                "next epoch would restart the cycle early and sample a partition again before its turn, breaking the "
                f"minimum separation the accounting of noise_mechanism={name!r} relies on. Set limit_train_batches to "
                f"a multiple of {partitions} x accumulate_grad_batches (or leave it unset)."
            )
        self.accounting.plan(planned_steps(trainer, per_epoch))
        rank_zero_info(
            f"Logical batch: cyclic Poisson sampling over {partitions} fixed partitions of the {n} examples, step t "
            f"samples partition t mod {partitions} at rate q = {rate:.4g} (expected batch {logical}); an epoch is "
            f"{per_epoch} steps."
        )
        return loader

    def _check_same_data_set(self, dataset: object, n: int) -> None:
        """Refuse a reloaded train loader over another data set under a correlated mechanism.

        The cyclic split assigns examples to parts by position in the data set, so a reload that
        reorders or resizes it (a curriculum) moves examples between parts mid-run, and an example
        could return before ``p`` releases have passed. The same data set object is kept as is.
        """
        if self._cyclic_dataset is None:
            self._cyclic_dataset = (dataset, n)
            return
        first, first_n = self._cyclic_dataset
        if dataset is not first or n != first_n:
            raise ValueError(
                f"The reloaded train loader holds another data set (N = {n}, was {first_n}; or the same size in "
                f"another object, e.g. reordered) than the run started with. noise_mechanism="
                f"{self.dp_config.noise_mechanism!r} assigns each example to a fixed part by its position, so a new "
                "data set would move examples between parts and break the separation its sensitivity relies on. "
                "Return a loader over the same data set object at every reload (or do not reload)."
            )

    def _check_same_on_every_rank(self, dataloader: DataLoader, **values: int) -> None:
        """Raise on every rank if the ranks disagree on ``values`` (a multi-process strategy checks)."""

    def _check_one_train_loader(self) -> None:
        trainer = self._trainer
        if trainer is None or self.private_step is None:
            return
        loaders, _ = tree_flatten(trainer.train_dataloader)
        if len(loaders) > 1:
            raise ValueError(
                f"DP training takes exactly one train loader, got {len(loaders)} (a list, dict or CombinedLoader). "
                "Each loader would be a separate Poisson sample with its own q, N and δ, and the ledger accounts "
                "one. Concatenate the data sets into one (torch.utils.data.ConcatDataset) instead."
            )

    # ------------------------------------------------------------------ the step

    def _private_training_step(
        self, step: PrivateStep, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        module = known(self.lightning_module, "the LightningModule")
        trainer = known(self._trainer, "the Trainer")
        if self._batches_since_release and trainer.current_epoch != self._accumulating_epoch:
            self._drop_partial_step(step)
        if self._batches_since_release == 0:
            self._accumulating_epoch = trainer.current_epoch
            step.restore_weight_grads()
            if self.dp_config.correlated and step.trainables_changed():
                raise RuntimeError(
                    f"The trainable parameters changed at step {self.dp_state.steps}: the correlated noise of "
                    f"noise_mechanism={self.dp_config.noise_mechanism!r} runs over fixed buckets for the whole run. "
                    "Keep the trainable parameters fixed, or use the gaussian mechanism."
                )
            step.replan_if_changed(self.dp_state.steps)
        if step.pending:
            raise RuntimeError(
                "Under DP, manual optimization must call opt.step() exactly once per training batch, after its "
                "backward passes; the previous batch ran manual_backward without an opt.step() after it."
            )
        self._take_sampled_batch()
        units = _batch_units(module, args[0] if args else kwargs.get("batch"))
        self._batches_since_release += 1
        # Empty Poisson batches run training_step too: under dp_ddp every rank must reach the same
        # collectives (self.log(sync_dist=True), all_gather, metric syncs) whatever its local batch.
        automatic = module.automatic_optimization
        # Lightning divides the loss by k under automatic optimization; a manual step's loss is as written.
        divisor = trainer.accumulate_grad_batches if automatic else 1
        probe = self._coupling_probe(units, args, kwargs)
        try:
            with step.batch(units, _rows_per_unit(module), automatic, divisor, probe):
                return run()
        except Exception as err:
            if units == 0:
                raise RuntimeError(
                    "training_step failed on an empty batch (0 rows). Poisson sampling makes empty batches (each "
                    "example joins with probability q), and every rank runs training_step on them so that the "
                    "ranks stay in lock-step. Make the step cope with zero rows, e.g. reduce the loss as "
                    "sum / max(n, 1)."
                ) from err
            raise

    def _take_sampled_batch(self) -> None:
        """Learn which examples the batch holds; refuse one the cyclic sampler drew for another release."""
        sampler = self._sampler
        if sampler is None:
            self._batch_indices = []
            return
        drawn, self._batch_indices = sampler.take()
        if isinstance(sampler, CyclicPoissonBatchSampler) and drawn is not None:
            with decision("cyclic_position"):
                self._refuse_other_release(sampler, drawn)

    def _refuse_other_release(self, sampler: CyclicPoissonBatchSampler, drawn: int) -> None:
        joins = self.dp_state.steps
        if drawn != joins:
            raise RuntimeError(
                f"This batch was sampled from part {drawn % sampler.partitions} for release {drawn}, but it joins "
                f"release {joins} (part {joins % sampler.partitions}): an example could participate twice within "
                f"{sampler.partitions} releases, beyond what noise_mechanism={self.dp_config.noise_mechanism!r} "
                "accounts. Nothing of this batch was released."
            )

    def _drop_partial_step(self, step: PrivateStep) -> None:
        """Drop the micro-batches of an accumulation that the previous epoch ended in the middle of.

        Lightning ends an epoch when ``on_train_batch_start`` returns -1, also between the
        micro-batches of one Poisson batch, and then adds the next epoch's micro-batches to the
        same gradient: an example in both would contribute two clipped gradients to one release
        charged as one. Nothing of the cut batch was released, so dropping it spends nothing.
        """
        dropped, self._batches_since_release = self._batches_since_release, 0
        step.discard()
        rank_zero_warn(
            f"Epoch {self._accumulating_epoch} ended in the middle of an accumulation (after {dropped} of "
            f"accumulate_grad_batches={known(self._trainer, 'the Trainer').accumulate_grad_batches} micro-batches, "
            "e.g. on_train_batch_start returned -1): its clipped gradients were dropped, not released; the ledger "
            "is unchanged."
        )

    def _coupling_probe(self, units: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CouplingProbe | None:
        """The coupling probe of this batch, on the first steps of a fit under automatic optimization.

        Every rank probes on the same steps (a ``training_step`` with collectives must stay in
        lock-step), even with fewer than two examples, where there is nothing to compare.
        """
        module, verify = known(self.lightning_module, "the LightningModule"), self.dp_config.verify_gradients
        if not module.automatic_optimization or verify == "never":
            return None
        if verify == "first_steps" and self._probes_compared >= VERIFIED_STEPS:
            return None
        if units < 2 and self.world_size == 1:
            return None
        self._probe_compared_step |= units >= 2
        original_args, original_kwargs = args, kwargs
        if args:
            probe, kept = probe_batch(args[0], units)
            args = (probe, *args[1:])
        else:
            probe, kept = probe_batch(kwargs["batch"], units)
            kwargs = {**kwargs, "batch": probe}
        parent_step = super().training_step
        alone = self._alone_probe(units, original_args, original_kwargs)

        def run() -> Tensor | None:
            with quietly(module):
                return step_loss(parent_step(*args, **kwargs))

        return CouplingProbe(run, kept, rng_state(), alone)

    def _alone_probe(self, units: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AloneProbe | None:
        """The shape probe of a batch: its first unit whose shape changes when collated alone, if any.

        Needs the data set indices of the batch (a Poisson loader's) and one row per unit. A batch
        whose every unit keeps its shape alone (fixed-size data) cannot couple through its shape.
        """
        module, loader = known(self.lightning_module, "the LightningModule"), self._train_loader
        if loader is None or len(self._batch_indices) != units or units < 2 or _rows_per_unit(module) != 1:
            return None
        batch = args[0] if args else kwargs["batch"]
        # The unit whose shape alone is the smallest: the farther from the batch's, the larger a shape coupling.
        shapes = []
        for position, index in enumerate(self._batch_indices):
            single = loader.collate_fn([loader.dataset[index]])
            if row_shapes_differ(batch, single, units):
                shapes.append((_numel(single), position, single))
        if not shapes:
            return None
        _, position, single = min(shapes, key=lambda item: item[:2])
        alone = self.batch_to_device(single)
        parent_step = super().training_step
        alone_args, alone_kwargs = ((alone, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": alone})

        def in_batch() -> Tensor | None:
            with quietly(module), evaluating(module):
                return step_loss(parent_step(*args, **kwargs))

        def by_itself() -> Tensor | None:
            with quietly(module), evaluating(module):
                return step_loss(parent_step(*alone_args, **alone_kwargs))

        return AloneProbe(in_batch, by_itself, position)

    def _private_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        if self.private_step is None:
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
            self._release()
            return result

        return private_closure

    def _count_compared_probe(self) -> None:
        """Count this step's probe toward the probed steps if it compared units on every rank.

        A batch of fewer than two units compares nothing, so it does not use up a probed step
        (at small expected batches every probed step could otherwise be such a batch). Only
        while probes are still due, and agreed across ranks, which must probe in lock-step.
        """
        compared, self._probe_compared_step = self._probe_compared_step, False
        if self.dp_config.verify_gradients == "first_steps" and self._probes_compared < VERIFIED_STEPS:
            self._probes_compared += int(self._all_ranks_agree(compared))

    def _all_ranks_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one process: this one)."""
        return flag

    def _bucket_reducer(self) -> BucketReducer | None:
        """Cross-rank sum of one bucket; ``None`` on one process."""
        return None

    def _local_noise_std(self, total: float) -> float:
        """Std of the noise this rank adds, so that the ranks' noise sums to N(0, total²) exactly once."""
        if self.dp_config.noise_placement == "split":
            return total / math.sqrt(self.world_size)
        return total if self.global_rank == 0 else 0.0

    def _check_one_batch_per_release(self) -> None:
        # The accountant charges one Poisson(q) batch per noisy step. Lightning enforces that for
        # automatic optimization (k micro-batches = one Poisson batch); a manual loop must step once per batch.
        module = known(self.lightning_module, "the LightningModule")
        batches, self._batches_since_release = self._batches_since_release, 0
        k = known(self._trainer, "the Trainer").accumulate_grad_batches
        if module.automatic_optimization and self.dp_config.poisson_sampling:
            with decision("whole_logical_batch"):
                self._refuse_partial_batch(batches, k)
        if not module.automatic_optimization and batches != 1:
            raise RuntimeError(
                f"Under DP, manual optimization must call opt.step() exactly once per training batch; this step "
                f"covers {batches} batches. Several batches per step would sample at a higher rate than the "
                "accountant charges, and several steps per batch release the same examples twice. To accumulate, "
                "use automatic optimization with Trainer(accumulate_grad_batches=k)."
            )

    def _refuse_partial_batch(self, batches: int, k: int) -> None:
        if batches != k:
            known(self.private_step, "the private step").discard()
            raise RuntimeError(
                f"This release covers {batches} of the {k} micro-batches of one Poisson batch "
                f"(accumulate_grad_batches={k}): Lightning would release part of a logical batch as a whole one, "
                "which the accountant does not cover. This happens when a run resumes under accumulation from a "
                "checkpoint written between the micro-batches of a step (Trainer.save_checkpoint after fit "
                "returned, or in the middle of an accumulation): resume from a checkpoint that ModelCheckpoint wrote "
                "at a step's end, or with accumulate_grad_batches=1. Nothing of this step was released."
            )

    def _release(self) -> None:
        step, state = known(self._fit.step, "the private step"), self.dp_state
        expected_batch_size = known(state.expected_batch_size, "the expected batch size q·N")
        self._check_one_batch_per_release()
        steps, total = state.steps, state.noise_std
        released = total  # the std of this step's noise on the clipped sum, as the optimizer's DP plan is told
        spec = ReleaseSpec(steps, self.dp_config.noise_mechanism, step.sensitivity, released, expected_batch_size,
                           self.global_rank, self.world_size)  # fmt: skip
        if self.dp_config.correlated:
            plan = known(self._fit.correlated, "the strategy matrix of the correlated noise")
            if steps >= plan.strategy.n:
                raise RuntimeError(
                    f"Step {steps} is past the {plan.strategy.n} steps the strategy matrix of noise_mechanism="
                    f"{self.dp_config.noise_mechanism!r} was built and accounted for; nothing was released."
                )
            step.bind_noise_strategy(plan.strategy)
            released = total * float(plan.marginal[steps])
            run_sensitivity = self.accounting.mechanism.run_sensitivity(plan.sensitivity, plan.strategy.n)
            strategy = plan.strategy.matrix() if observers() else None  # dense C only for an audit
            spec = replace(spec, noise_std=released, strategy=strategy, run_sensitivity=run_sensitivity)
        step.release(self._local_noise_std(total), released, expected_batch_size, self._bucket_reducer(), steps, spec)
        self.accounting.step()
        self._count_compared_probe()
        journal = self._journal()
        if journal is not None and self.is_global_zero and self.accounting.ledger.history:
            sigma, q, _ = self.accounting.ledger.history[-1]
            journal.append(state.steps, sigma, q)  # durable before optimizer.step applies the update
        seen, self._nonfinite_seen = self._nonfinite_seen, step.nonfinite_examples
        if step.nonfinite_examples > seen and not self._warned_nonfinite:
            self._warned_nonfinite = True
            from dplightning.callbacks.progress import NONFINITE_METRIC  # not at import, as above

            # Not rank_zero_warn: the rank that met the example says so. Later ones are only counted.
            warnings.warn(
                f"Step {state.steps}: {step.nonfinite_examples - seen} example(s) had a non-finite (NaN/inf) "
                "per-example gradient (a NaN/inf loss or input); each contributed zero to the step, which stays "
                "private and finite. The running count is strategy.dp_state.nonfinite_examples and the logged metric "
                f"'{NONFINITE_METRIC}' (raw, not private).",
                stacklevel=2,
            )


def _logical_batch(logical: int, batch_size: int, world_size: int, k: int, q: float, poisson: bool) -> str:
    """One line saying what one noisy step averages over."""
    if poisson:
        line = (
            f"Logical batch: one Poisson sample of expected size {logical} (batch_size {batch_size} x {world_size} "
            f"process(es), q = {q:.4g})"
        )
        if k == 1:
            return line + "."
        return (
            f"{line}, split into {k} micro-batches of about {logical / (k * world_size):.4g} per process: under "
            "DP, accumulate_grad_batches splits the sampled batch, it does not multiply it."
        )
    return (
        f"Logical batch: {k} x {batch_size} x {world_size} = {logical} examples per step (accumulate_grad_batches x "
        "batch_size x processes), averaged; without Poisson sampling ε is infinite."
    )


def _building_train_loader(trainer: pl.Trainer) -> bool:
    """Whether the loader being processed is the train loader.

    In the training stage, or before any stage when ``configure_optimizers`` asks for
    ``trainer.estimated_stepping_batches`` during setup (only the train loader is built then;
    evaluation loops set their stage before they build theirs).
    """
    stage = trainer.state.stage
    return stage == RunningStage.TRAINING or (stage is None and trainer.fit_loop._combined_loader is None)


def _dataset_size(dataloader: DataLoader) -> int:
    """N of the train loader's dataset, refusing unsized and empty ones before any step."""
    try:
        n = len(dataloader.dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise TypeError(
            f"DP training needs a dataset with a known size N (q = batch_size / N and δ depend on it); "
            f"{type(dataloader.dataset).__name__} has no __len__. Use a map-style dataset."
        ) from err
    if n == 0:
        raise ValueError("The train dataset is empty (N = 0): there is nothing to train on and q is undefined.")
    return n


def _compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    """The precision the backward passes run in: 16 bits under a 16-bit precision setting, else fp32."""
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


def _numel(batch: Any) -> int:
    """Elements in the tensors of ``batch``."""
    return sum(t.numel() for t in tree_flatten(batch)[0] if isinstance(t, Tensor))


def _batch_units(module: nn.Module, batch: Any) -> int:
    """The number of privacy units in ``batch``: the module's ``dp_batch_size`` or the first tensor's rows.

    Raises:
        TypeError: If neither gives a count: the layer-input check and the scale of a mean
            loss need it, and are never skipped.
    """
    if isinstance(module, CountsExamples):
        units = module.dp_batch_size(batch)
        if isinstance(units, bool) or not isinstance(units, int) or units < 0:
            raise ValueError(f"dp_batch_size(batch) must return an int >= 0 (units in the batch), got {units!r}.")
        return units
    rows = batch_rows(batch)
    if rows is None:
        raise TypeError(
            f"Cannot tell how many examples a training batch of type {type(batch).__name__} holds (no tensor in it "
            "as a tensor, mapping, list, tuple or dataclass). DP training needs the count to check that every layer "
            "sees one row per example and to scale a mean loss. Define `dp_batch_size(self, batch) -> int` on "
            f"{type(module).__name__} returning the number of privacy units in the batch."
        )
    return rows


def _rows_per_unit(module: nn.Module) -> int:
    rows = getattr(module, "dp_rows_per_unit", 1)
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"dp_rows_per_unit must be an int >= 1 (rows per privacy unit), got {rows!r}.")
    return rows


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


def planned_steps(trainer: pl.Trainer, per_epoch: int) -> int | None:
    """Optimizer steps the run will take, ``min(max_steps, max_epochs x steps per epoch)``; ``None`` if unbounded."""
    epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else math.inf
    max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else math.inf
    total = min(max_steps, epochs * per_epoch)
    return int(total) if math.isfinite(total) else None
