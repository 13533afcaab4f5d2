"""``AdaLNBindFractions``: how often the DP-aware AdaLN-Zero bounds bind on the training examples (**nonprivate**).

A bound that never binds changes nothing, and one that binds on most examples changes the model; either way a
comparison of DP-aware with DP-vanilla says little about the method (issue 24, item 3). This callback measures, on
the private training batches, what share of the examples the condition's projection rescales and what share of the
raw modulation coordinates lie beyond their bound. It reads them with forward hooks on the network's own modules
(:class:`~dplightning.models.adaln.L2BallProjection`, whose input is c̃, and each AdaLN layer's
``adaLN_modulation``, whose output is the raw (γ̃, β̃, α̃)), never with per-example gradient hooks: no backward work,
one comparison per value in the forward, and nothing at all (no hook) when disabled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from dplightning.callbacks._logging import log_scalars
from dplightning.models.adaln import AdaLNFinalLayer, AdaLNZeroBlock, L2BallProjection, modulation_chunks
from dplightning.protocols import dp_state_of

PREFIX = "nonprivate/adaln_bind"
PROJECTION = "projection"
BOUND_NAMES: tuple[str, ...] = (PROJECTION, "gamma", "beta", "alpha")
"""The bounds watched: the projection of c̃ (a share of examples) and γ, β, α (shares of coordinates)."""


def projection_binds(c_tilde: Tensor, c_max: float) -> tuple[Tensor, int]:
    """(examples whose ‖c̃‖ > c_max, examples): the rows of ``c_tilde`` ``[B, d]`` the projection rescales."""
    norms = torch.linalg.vector_norm(c_tilde.detach(), dim=-1)
    return (norms > c_max).sum(), norms.numel()


def coordinate_binds(raw: Tensor, limit: float) -> tuple[Tensor, int]:
    """(coordinates with |raw| > limit, coordinates) of a raw (pre-bound) modulation tensor."""
    return (raw.detach().abs() > limit).sum(), raw.numel()


@dataclass
class BindRecord:
    """One window of optimizer steps.

    Attributes:
        step: Optimizer steps done at the end of the window.
        fractions: Bound name -> share that bound (examples for ``projection``, coordinates for γ/β/α);
            only the bounds the network has.
        counts: Bound name -> (binding, total), summed over ranks.
    """

    step: int
    fractions: dict[str, float]
    counts: dict[str, tuple[int, int]]


class AdaLNBindFractions(Callback):
    """**nonprivate**: the share of training examples and coordinates where each DP-aware AdaLN-Zero bound binds.

    Logged every ``every_n_steps`` optimizer steps (over the window's training batches, all ranks) under
    ``nonprivate/adaln_bind/``, and once more at the end of training over the whole run under
    ``nonprivate/adaln_bind/run/`` (:attr:`run_fractions`, what :func:`dplightning.methods.adaln_bounds.vacuity`
    judges):

    * ``projection``: the share of examples with ‖c̃‖ > c_max, where c̃ is what the L2 ball projects
      (t_emb + ctx, or ctx alone with ``project="ctx"``): the examples the projection rescales;
    * ``gamma``, ``beta``, ``alpha``: the share of raw modulation coordinates with |x̃| > x_max, pooled over
      every block and the final layer (which has no gate).

    **What "binds" means for the soft bound.** ``hard`` (clamp) changes exactly the coordinates with
    |x̃| > x_max. ``soft`` (x_max·tanh(x̃/x_max)) changes every coordinate a little; the same threshold is used
    for it because at |x̃| = x_max the bound already returns 0.76·x̃ (24 % shrunk) and passes back
    sech²(1) = 0.42 of the gradient, and beyond it the value saturates towards x_max: the coordinates counted
    are those the bound mainly decides, not the network. One threshold for both modes also makes the soft and
    hard arms' shares comparable, and matches the calibration (:mod:`dplightning.methods.adaln_bounds`), which
    sets each x_max at a percentile of |x̃| itself.

    Only training batches are counted (not validation, sampling or the DP strategy's coupling probe, which
    replays a batch); a bound that is ``None`` is not logged. These shares are raw statistics of the private
    training data, NOT differentially private: like the clipping and tail statistics they sit under
    ``nonprivate/`` and must not be released with the model. ``enabled=False`` registers no hook at all.

    Args:
        every_n_steps: Optimizer steps per logged window.
        enabled: ``False`` turns the callback off (no hook, nothing computed or logged).
    """

    def __init__(self, every_n_steps: int = 50, enabled: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.enabled = enabled
        self.history: list[BindRecord] = []
        """One record per closed window (identical on every rank)."""
        self.run_counts: dict[str, tuple[int, int]] = {}
        """Bound name -> (binding, total) over the whole run, all ranks."""
        self._handles: list[RemovableHandle] = []
        self._window: dict[str, Tensor] = {}
        self._trainer: pl.Trainer | None = None
        self._armed = False

    @property
    def run_fractions(self) -> dict[str, float]:
        """Bound name -> share that bound over the whole run (after training)."""
        return _fractions(self.run_counts)

    # ------------------------------------------------------------------ hooks

    def attach(self, network: nn.Module) -> list[str]:
        """Hook every bounded site of ``network``; return the bounds found (names of :data:`BOUND_NAMES`)."""
        self.detach()
        found: set[str] = set()
        for module in network.modules():
            if isinstance(module, L2BallProjection) and module.c_max is not None:
                self._handles.append(module.register_forward_hook(self._projection_hook))
                found.add(PROJECTION)
            elif isinstance(module, (AdaLNZeroBlock, AdaLNFinalLayer)):
                kinds = {k for k in module.MODULATION_KINDS if module.bounds.limit(k) is not None}
                if kinds:
                    self._handles.append(module.adaLN_modulation.register_forward_hook(self._modulation_hook(module)))
                    found |= kinds
        return [name for name in BOUND_NAMES if name in found]

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _counting(self) -> bool:
        if not self._armed or self._trainer is None:
            return False
        return not getattr(dp_state_of(self._trainer.strategy), "probing", False)

    def _add(self, name: str, binding: Tensor, total: int) -> None:
        counts = torch.stack([binding.to(torch.float64), binding.new_tensor(total, dtype=torch.float64)])
        self._window[name] = self._window[name] + counts if name in self._window else counts

    def _projection_hook(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        if self._counting():
            self._add(PROJECTION, *projection_binds(args[0], module.c_max))  # type: ignore[arg-type]

    def _modulation_hook(self, layer: AdaLNZeroBlock | AdaLNFinalLayer) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], raw: Tensor) -> None:
            if not self._counting():
                return
            for kind, chunk in modulation_chunks(raw, layer.MODULATION_KINDS):
                limit = layer.bounds.limit(kind)
                if limit is not None:
                    self._add(kind, *coordinate_binds(chunk, limit))

        return hook

    # ------------------------------------------------------------------ the schedule

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        self._trainer = trainer
        self.history, self.run_counts, self._window = [], {}, {}
        if not self.attach(pl_module):
            rank_zero_warn("AdaLNBindFractions: the model has no bounded projection or modulation; nothing to log.")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._armed = bool(self._handles)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._armed = False

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Called once per optimizer step, after the forward passes of all its micro-batches.
        if self._handles and (trainer.global_step + 1) % self.every_n_steps == 0:
            self._close(trainer, trainer.global_step + 1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._handles:
            return
        if self._window:
            self._close(trainer, trainer.global_step)
        self.detach()
        self._armed = False
        log_scalars(trainer, {f"{PREFIX}/run/{k}": v for k, v in self.run_fractions.items()}, trainer.global_step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.detach()  # also after a failed fit: no hook outlives the run
        self._armed = False

    def _close(self, trainer: pl.Trainer, steps_done: int) -> None:
        window, self._window = self._window, {}
        counts = _sum_over_ranks(window, trainer.strategy.root_device)
        for name, (binding, total) in counts.items():
            before = self.run_counts.get(name, (0, 0))
            self.run_counts[name] = (before[0] + binding, before[1] + total)
        record = BindRecord(steps_done, _fractions(counts), counts)
        self.history.append(record)
        log_scalars(trainer, {f"{PREFIX}/{k}": v for k, v in record.fractions.items()}, steps_done)


def _fractions(counts: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    return {name: binding / total for name, (binding, total) in counts.items() if total > 0}


def _sum_over_ranks(window: dict[str, Tensor], device: torch.device) -> dict[str, tuple[int, int]]:
    """Each bound's (binding, total) summed over ranks: one small collective when distributed.

    Every rank has the same bounds, so the same names, even when its own window saw no example
    (an empty Poisson batch still runs the forward with zero rows).
    """
    if not window:
        return {}
    names = sorted(window)
    stacked = torch.stack([window[n].to(device) for n in names])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
    return {n: (int(b), int(t)) for n, (b, t) in zip(names, stacked.tolist(), strict=True)}
