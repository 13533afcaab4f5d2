"""The private step: per-example gradients, clipping into buckets, noise once, the release.

One object per fit, built at setup from the module and its optimizer; the strategy calls
it at four points of every optimizer step, each a named template step:

1. :meth:`PrivateStep.batch` around ``training_step``: hooks capture the layers' calls.
2. :meth:`PrivateStep.after_backward` after each backward pass: the engines' per-example
   gradients are verified against autograd (first steps; :mod:`.verification`), then
   clipped into the fp32 buckets (automatic optimization) or summed with the batch's other
   backward passes (manual optimization; :mod:`.accumulation`). The raw ``p.grad`` never
   survives a backward pass.
3. :meth:`PrivateStep.release` once per optimizer step: noise once, the cross-rank sum,
   division by the public expected batch, then ``p.grad`` (and the optimizer's DP plan, if
   it has one) receive the noisy mean.
4. :meth:`PrivateStep.close` at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from dplightning._state import known
from dplightning.privacy.buffers import BufferWatch, public_buffers
from dplightning.privacy.clipping import ClipGroup, make_clip_groups
from dplightning.privacy.correlated_noise import CorrelatedBucketNoise
from dplightning.privacy.grad_sample import PerExampleGrad, PerExampleHooks, SlotTransform
from dplightning.privacy.matrix_mechanism import Strategy as NoiseStrategy
from dplightning.privacy.mechanism import BucketReducer, GradientPrivatizer, MicroBatchStats, merge_stats
from dplightning.privacy.noise import GaussianNoise
from dplightning.privacy.release import ReleaseSpec, decision
from dplightning.protocols import DPPlan, DPPlanned, DPRelease
from dplightning.strategies.accumulation import ManualAccumulation
from dplightning.strategies.config import DPConfig
from dplightning.strategies.coupling import (
    AloneProbe,
    CouplingProbe,
    GradientSummary,
    alone_tolerance,
    coupled_parameters,
    rng_state,
    set_rng_state,
    summarize,
    summary_pays,
    unit_gradient_gap,
)
from dplightning.strategies.replay import ClipReplay
from dplightning.strategies.verification import GradientVerification


class PrivateStep:
    """Per-example gradients, clipping, noise and release for one module and its optimizer.

    Args:
        config: The strategy's DP arguments.
        module: The LightningModule (hooked in place).
        optimizer: Its single optimizer; its trainable parameters are privatized.
        noise: This rank's noise source: independent Gaussian, or the correlated noise of a
            matrix-factorization mechanism (one stream per bucket).
        compute_dtype: The precision the backward passes run in (bf16 under ``bf16-mixed``).
    """

    def __init__(
        self,
        config: DPConfig,
        module: nn.Module,
        optimizer: Optimizer,
        noise: GaussianNoise | CorrelatedBucketNoise,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.noise = noise
        self.last_step_stats: list[MicroBatchStats] = []
        self.nonfinite_examples = 0
        self._stats: list[MicroBatchStats] = []
        self.accumulation = ManualAccumulation()
        self.verification = GradientVerification(config.verify_gradients, compute_dtype)
        self.agree: Callable[[bool], bool] = lambda flag: flag
        """Whether a flag holds on every rank (the strategy's collective): the ranks decide every check together."""
        self._automatic = True
        self._scale = 1.0
        self._early = False
        self._early_stats: list[MicroBatchStats] = []
        self._early_done: set[int] = set()
        self._local_groups: dict[nn.Module, list[int]] = {}
        self._suspended: list[nn.Parameter] = []
        self._batch_units: int | None = None
        self._rows_per_unit = 1
        self._loss_divisor = 1
        self._probe: CouplingProbe | None = None
        self._replay: ClipReplay | None = None
        self.probing = False
        """Whether ``training_step`` is running on the coupling probe's batch (see strategies/coupling.py)."""
        self.hooks: PerExampleHooks | None = None
        self.buffers = BufferWatch(module, public_buffers(module), privatized=lambda: self.privatizer.params)
        self.plan()

    # ------------------------------------------------------------------ planning

    def plan(self) -> None:
        """Hook the layers of the optimizer's trainable parameters and lay out their buckets.

        Runs at setup and again when the trainable parameters change (see :meth:`replan_if_changed`).
        """
        named = _privatized_parameters(self.module, self.optimizer)
        bind = getattr(self.optimizer, "dp_bind_module", None)
        if isinstance(self.optimizer, DPPlanned) and callable(bind):
            bind(self.module)  # optional: a plan that selects parameters by their layer's type
        plan = (
            self.optimizer.dp_plan(named, self.config.max_grad_norm)
            if isinstance(self.optimizer, DPPlanned)
            else DPPlan()
        )
        groups = plan.groups or make_clip_groups(self.config.clipping, named, self.config.max_grad_norm)
        # What the final report and checkpoints call the clipping: the optimizer's groups override the policy.
        self.clipping = f"optimizer plan ({len(groups)} groups)" if plan.groups else self.config.clipping
        _check_partition(groups, named)
        self.transforms: dict[nn.Parameter, SlotTransform] = dict(plan.transforms)
        if self.hooks is not None:
            self.hooks.close()
        self.hooks = PerExampleHooks(
            self.module,
            [p for _, p in named],
            engine=self.config.clipping_engine,
            functorch_fallback=self.config.grad_sample_mode == "functorch",
            transforms=self.transforms,
        )
        self.hooks.capturing = False
        slot_shapes = {p: t.slot_shape(p.shape) for p, t in self.transforms.items()}
        self.privatizer = GradientPrivatizer(groups, bucket_cap_mb=self.config.bucket_cap_mb, slot_shapes=slot_shapes)
        owners = _owners(self.hooks.layers)
        self._local_groups = _layer_local_groups(owners, groups)
        self.hooks.on_layer_done = self._on_layer_done
        local = {j for js in self._local_groups.values() for j in js}
        spanning = {p for j, g in enumerate(groups) if j not in local for p in g.params}
        # What clip_replay takes norms of when a layer is done: its own parameters of the spanning groups.
        self._streamable = {
            layer: [p for p in params if p in spanning and owners[p] == [layer]]
            for layer, params in self.hooks.layers.items()
        }
        self._has_spanning = bool(spanning)
        self._signature = _trainable_signature(self.optimizer)
        self.verification.restart()

    def trainables_changed(self) -> bool:
        """Whether the optimizer's trainable parameters differ from the planned ones."""
        return _trainable_signature(self.optimizer) != self._signature

    def replan_if_changed(self, step: int) -> None:
        """Re-plan if the optimizer's trainable parameters differ from the planned ones (call between steps)."""
        if _trainable_signature(self.optimizer) == self._signature:
            return
        before = len(self._signature)
        self.plan()
        rank_zero_info(
            f"The trainable parameters changed at step {step} ({before} -> {len(self._signature)} tensors): "
            "per-example hooks and buckets re-planned."
        )

    def summary(self) -> str:
        """The engine of every hooked layer, as a table."""
        hooks = known(self.hooks, "the per-example hooks")
        rows = [("layer", "type", "params", "engine")] + [
            (name, kind, f"{count:,}", engine) for name, kind, count, engine in hooks.summary()
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])

    def engines(self) -> dict[str, str]:
        """The clipping engine of every hooked layer: layer name -> engine."""
        hooks = known(self.hooks, "the per-example hooks")
        return {name: engine for name, _, _, engine in hooks.summary()}

    @property
    def groups(self) -> list[ClipGroup]:
        """The clipping groups in :class:`MicroBatchStats` column order."""
        return self.privatizer.groups

    @property
    def sensitivity(self) -> float:
        """The joint sensitivity Δ of the clip groups, √(Σ C_b²) (C for flat clipping)."""
        return self.privatizer.sensitivity

    def parameter_names(self) -> list[str]:
        """Names of the privatized parameters in :attr:`MicroBatchStats.param_sq_norms` column order."""
        names = {p: n for n, p in self.module.named_parameters()}
        return [names[p] for p in self.privatizer.params]

    @property
    def capturing(self) -> bool:
        """Whether the hooks are capturing a training batch's layer calls now."""
        return self.hooks is not None and self.hooks.capturing

    def bind_noise_strategy(self, strategy: NoiseStrategy) -> None:
        """Give a correlated noise source the strategy matrix C of the run (before each release)."""
        if isinstance(self.noise, CorrelatedBucketNoise):
            self.noise.bind(strategy)

    # ------------------------------------------------------------------ one batch

    @contextmanager
    def batch(
        self,
        units: int,
        rows_per_unit: int,
        automatic: bool,
        loss_divisor: int,
        probe: CouplingProbe | None = None,
    ) -> Iterator[None]:
        """Capture one training batch of ``units`` privacy units, ``rows_per_unit`` forward rows each.

        ``automatic``: automatic optimization (each backward pass covers a whole micro-batch);
        ``loss_divisor``: what the loss is divided by before its backward (Lightning's k under
        automatic optimization, 1 under manual); ``probe``: the coupling probe to run after
        the batch's backward pass (automatic optimization only).

        Outside verification, autograd's own weight gradients are turned off for the batch (the
        engines need only the layers' inputs and output gradients): from here to the end of its
        backward pass under automatic optimization, to the end of ``training_step`` under manual.
        """
        hooks = known(self.hooks, "the per-example hooks")
        self._batch_units, self._rows_per_unit = units, rows_per_unit
        self._automatic, self._loss_divisor, self._probe = automatic, loss_divisor, probe
        # From the captured gradients of the backpropagated loss to each unit's own gradient.
        self._scale = float(loss_divisor) * (float(units) if self.config.loss_reduction == "mean" and units else 1.0)
        # Per-layer groups are clipped as soon as their layer's backward is done (their inputs and
        # output gradients are then freed), under automatic optimization outside verification and
        # the coupling probe (both compare the pass' per-example gradients after it).
        self._early = automatic and not self.verification.active and probe is None
        self._replay = None
        if self.config.clip_replay and self._early and self._has_spanning:
            self._replay = ClipReplay(self.privatizer, hooks, self._streamable, rows_per_unit, self._scale)
        hooks.fingerprint = self._replay is not None
        self.restore_weight_grads()
        if not self.verification.active:
            self._suspended = [p for p in self.privatizer.params if p.requires_grad]
            for p in self._suspended:
                p.requires_grad_(False)
        self.buffers.deep = self.verification.active  # frozen weights' values on the verified steps only
        self.buffers.snapshot()
        try:
            with hooks.capture(units * rows_per_unit):
                yield
            self.buffers.check("training_step")
        finally:
            if not automatic:
                self.restore_weight_grads()

    def restore_weight_grads(self) -> None:
        """Give back ``requires_grad`` to the parameters :meth:`batch` turned it off for."""
        for p in self._suspended:
            p.requires_grad_(True)
        self._suspended = []

    @property
    def pending(self) -> bool:
        """Whether backward passes of the current batch await their release (manual optimization)."""
        return self.accumulation.pending

    @property
    def replaying(self) -> bool:
        """Whether the current batch's backward pass is to be replayed (``clip_replay``; see :meth:`replay`)."""
        return self._replay is not None

    def replay(self, backward: Callable[[], None]) -> None:
        """Between the first backward pass (graph retained) and :meth:`after_backward`: clip by replaying it.

        Args:
            backward: Runs the same backward pass again (see strategies/replay.py).
        """
        replay, self._replay = known(self._replay, "the clip replay"), None
        rest = [j for j in range(len(self.groups)) if j not in self._early_done]
        try:
            stats = replay.run(backward, rest)
        except BaseException:  # a partial or mismatched replay: nothing of this step may be released
            self.discard()
            raise
        self._early_stats.append(stats)
        self._early_done.update(rest)

    def after_backward(self) -> None:
        """Take the per-example gradients of one backward pass; drop autograd's raw gradient.

        Under automatic optimization the pass covers a whole micro-batch and is clipped now; under
        manual optimization it is summed with the batch's other passes until the release. On the
        steps the gradient verification or the coupling probe checks, the ranks agree on the
        decision (one collective): every rank refuses if one does, none is left waiting.
        """
        checking = self.verification.active or self._probe is not None
        failure: RuntimeError | None = None
        try:
            self._take_backward()
        except RuntimeError as err:
            failure = err
        if checking and not self.agree(failure is None) and failure is None:
            self.discard()
            failure = RuntimeError(
                "Another process refused this step (its gradient verification or coupling probe failed; its error "
                "names the cause). Every process stops here, before the release. Nothing of this step was released."
            )
        if failure is not None:
            raise failure

    def _take_backward(self) -> None:
        hooks = known(self.hooks, "the per-example hooks")
        self.buffers.check("training_step and its backward pass")
        automatic, scale = self._automatic, self._scale
        if automatic:
            self.restore_weight_grads()
            hooks.forget_inputs()  # the graph's one backward pass is done: free the layers' inputs now
        grads = hooks.pop(self._rows_per_unit)
        if self.verification.active:
            self.verification.check(self.module, self.privatizer.params, grads, self.transforms, self._batch_units)
        # Before the coupling probe, whose forward would otherwise hold them: nothing reads them after the check.
        self._drop_weight_grads()
        if not automatic:
            self.accumulation.add(grads, scale)
            return
        if self._probe is None:
            self._clip(grads, scale)
            return
        if not summary_pays(grads):
            self._check_coupling(grads)
            self._clip(grads, scale)
            return
        # The probe (automatic optimization only) replays the step. Its comparison needs only a summary of the
        # real pass, smaller here than the pass' per-example state, which is therefore clipped and freed first.
        real = summarize(grads, self._probe.kept)
        self._clip(grads, scale)
        del grads
        try:
            self._check_coupling(real)
        except BaseException:  # refused, or the replay failed: the step's clipped sum must never be released
            self.discard()
            raise

    def _drop_weight_grads(self) -> None:
        """Set every ``p.grad`` to ``None``.

        Autograd's raw sum is not private: only the released gradient may reach the optimizer.
        """
        for p in self.module.parameters():
            p.grad = None

    def _on_layer_done(self, layer: nn.Module) -> None:
        if not self._early:
            return
        hooks = known(self.hooks, "the per-example hooks")
        for j in self._local_groups.get(layer, []):
            grads = hooks.take(self.privatizer.groups[j].params, self._rows_per_unit)
            self._early_stats.append(self.privatizer.accumulate(grads, scale=self._scale, groups=[j]))
            self._early_done.add(j)
        if self._replay is not None:
            self._replay.layer_done(layer)

    def _clip(self, grads: dict[nn.Parameter, PerExampleGrad], scale: float) -> None:
        rest = [j for j in range(len(self.groups)) if j not in self._early_done]
        had_grads = bool(grads) or bool(self._early_stats)
        stats = merge_stats([*self._early_stats, self.privatizer.accumulate(grads, scale=scale, groups=rest)])
        self._early_stats, self._early_done = [], set()
        units = stats.norms.shape[0]
        if had_grads and self._batch_units is not None and units != self._batch_units:
            raise RuntimeError(
                f"Per-example gradients have {units} rows but the batch has {self._batch_units} examples: is a layer "
                "fed sequence-first (batch_first=False) input? The privacy unit must be the batch's first dimension."
            )
        self.nonfinite_examples += stats.nonfinite
        self._stats.append(stats)

    def _check_coupling(self, real: Mapping[nn.Parameter, GradientSummary | PerExampleGrad]) -> None:
        """Replay the step on the probe batch; refuse if a kept unit's gradient changed (strategies/coupling.py)."""
        probe, self._probe = known(self._probe, "the coupling probe"), None
        hooks = known(self.hooks, "the per-example hooks")
        units = known(self._batch_units, "the batch's unit count")
        self._early = False  # the probe's gradients must not reach the buckets
        after = rng_state()
        set_rng_state(probe.rng)
        self.probing = True
        try:
            with hooks.capture(units * self._rows_per_unit):
                loss = probe.run()
            if loss is not None and loss.requires_grad:
                (loss / self._loss_divisor).backward()
        finally:
            self.probing = False
            replayed = hooks.pop(self._rows_per_unit)
            set_rng_state(after)
            self._drop_weight_grads()  # the probe's backward wrote them again (verified steps)
        if units < 2 or loss is None:
            return
        if probe.alone is not None:
            self._check_alone(probe.alone, probe.rng, units)
        differing = coupled_parameters(real, replayed, probe.kept)
        with decision("coupling_probe"):
            self._refuse_coupled(differing)

    def _refuse_coupled(self, differing: Mapping[nn.Parameter, float]) -> None:
        if differing:
            names = {p: n for n, p in self.module.named_parameters()}
            listed = ", ".join(f"{names.get(p, '?')} ({err:.2g})" for p, err in list(differing.items())[:6])
            raise RuntimeError(
                "Each example's gradient must depend on that example alone, but replacing the other examples of the "
                f"batch changed the gradients of the examples kept (relative difference): {listed}. The loss or the "
                "model couples the examples of a batch (a token mean over the whole batch, e.g. Hugging Face's loss "
                "with labels=; batch-normalised or contrastive terms; in-batch negatives; a layer fed sequence-first "
                "input; a lookup shared by the batch and reduced over it; state the model carries from one forward to "
                "the next, e.g. an RNN hidden state kept in self.hidden: stateful models are not supported), so "
                "per-example clipping would not bound "
                "one example's influence. Reduce the loss per example first, then over the batch (docs/dp_sgd_core.md, "
                "'The per-example loss contract'). If the batch holds a tensor whose first dimension equals the "
                "batch size but is not one row per example (a table shared by the batch), pass it another way. "
                "Nothing was updated."
            )

    def _check_alone(self, alone: AloneProbe, rng: tuple[Tensor, list[Tensor]], units: int) -> None:
        """Refuse if a unit's gradient in its batch differs from its gradient collated alone (see coupling.py)."""
        hooks = known(self.hooks, "the per-example hooks")
        passes = []
        after = rng_state()
        for run, rows in ((alone.in_batch, units), (alone.alone, 1)):
            set_rng_state(rng)
            self.probing = True
            try:
                with hooks.capture(rows * self._rows_per_unit):
                    loss = run()
                if loss is not None and loss.requires_grad:
                    (loss / self._loss_divisor).backward()
            finally:
                self.probing = False
                passes.append(hooks.pop(self._rows_per_unit))
                set_rng_state(after)
                self._drop_weight_grads()
        scales = (self._scale, float(self._loss_divisor))  # each unit's own gradient, in the batch and alone
        gap = unit_gradient_gap(passes[0], passes[1], alone.position, scales)
        with decision("shape_probe"):
            self._refuse_shape_coupled(gap, alone_tolerance(*passes))

    @staticmethod
    def _refuse_shape_coupled(gap: float, tolerance: float) -> None:
        if gap > tolerance:
            raise RuntimeError(
                f"An example's gradient changed when it was collated alone instead of in its batch (relative "
                f"difference {gap:.2g}): the loss or the model depends on the batch's padded shape, e.g. a mean over "
                "the padded grid ((per_token * mask).mean() divides by n x T_max) or mean pooling over padded steps. "
                "Then the longest example of a batch "
                "changes every other example's gradient, which per-example clipping does not bound. Reduce each "
                "example over its own valid positions ((per_token * mask).sum(1) / mask.sum(1)), then over the "
                "batch. Nothing was updated."
            )

    # ------------------------------------------------------------------ the release

    def release(
        self,
        local_noise_std: float,
        noise_std: float,
        expected_batch_size: float,
        reduce: BucketReducer | None,
        step: int,
        spec: ReleaseSpec | None = None,
    ) -> None:
        """Noise once, sum across ranks, divide by q·N; then ``p.grad`` and the optimizer's plan receive it.

        Args:
            local_noise_std: Std of the noise this rank adds.
            noise_std: Std of the total noise on the clipped sum at this step, σΔ (for correlated
                noise the std of z_t, which the optimizer's DP plan is told).
            expected_batch_size: The public q·N.
            reduce: The cross-rank sum of one bucket, or ``None`` on one process.
            step: Index of this noisy step.
            spec: The release as the strategy declares it, for the release seam's observers.
        """
        self.restore_weight_grads()
        accumulated = self.accumulation.take()
        if accumulated is not None:
            self._clip(*accumulated)
        self.verification.step_done(self.agree)
        self.noise.start_step(step)
        self.privatizer.release(self.noise, local_noise_std, expected_batch_size, reduce, spec=spec)
        if isinstance(self.optimizer, DPPlanned):
            slots = {p: self.privatizer.slot(p) for p in self.privatizer.params}
            self.optimizer.dp_release(DPRelease(slots, noise_std / expected_batch_size, self.groups, step))
        self.last_step_stats, self._stats = self._stats, []

    def discard(self) -> None:
        """Forget everything accumulated since the last release (a step that will never be released)."""
        self.privatizer.discard()
        self.accumulation.clear()
        self._stats.clear()
        self._early_stats, self._early_done = [], set()
        self._replay = None

    def close(self) -> None:
        """Remove every hook; give back ``requires_grad``."""
        self.restore_weight_grads()
        if self.hooks is not None:
            self.hooks.close()
        self.hooks = None
        self.accumulation.clear()
        self._stats = []


def _privatized_parameters(module: nn.Module, optimizer: Optimizer) -> list[tuple[str, nn.Parameter]]:
    names = {p: n for n, p in module.named_parameters()}
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    foreign = [p for p in in_optimizer if p not in names]
    if foreign:
        raise ValueError(f"The optimizer holds {len(foreign)} trainable tensors that are not parameters of the module.")
    left_out = sorted(n for p, n in names.items() if p.requires_grad and p not in set(in_optimizer))
    if left_out:
        rank_zero_warn(f"Trainable parameters not in the optimizer get no gradient under DP: {left_out[:5]}...")
    return [(names[p], p) for p in dict.fromkeys(in_optimizer)]


def _owners(layers: dict[nn.Module, list[nn.Parameter]]) -> dict[nn.Parameter, list[nn.Module]]:
    """The hooked layers of each privatized parameter (several: a weight shared by layers)."""
    owners: dict[nn.Parameter, list[nn.Module]] = {}
    for layer, params in layers.items():
        for p in params:
            owners.setdefault(p, []).append(layer)
    return owners


def _layer_local_groups(
    owners: dict[nn.Parameter, list[nn.Module]], groups: list[ClipGroup]
) -> dict[nn.Module, list[int]]:
    """Groups whose parameters all belong to one layer, and to no other: clippable when that layer is done."""
    local: dict[nn.Module, list[int]] = {}
    for j, group in enumerate(groups):
        layer_sets = {tuple(owners.get(p, [])) for p in group.params}
        if len(layer_sets) == 1 and len(only := next(iter(layer_sets))) == 1:
            local.setdefault(only[0], []).append(j)
    return local


def _trainable_signature(optimizer: Optimizer) -> tuple[int, ...]:
    return tuple(id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad)


def _check_partition(groups: list[ClipGroup], named: list[tuple[str, nn.Parameter]]) -> None:
    grouped = [p for g in groups for p in g.params]
    if len(grouped) != len(set(grouped)) or set(grouped) != {p for _, p in named}:
        raise ValueError(
            "The clip groups must partition the privatized parameters (each trainable parameter of the optimizer "
            "in exactly one group)."
        )
