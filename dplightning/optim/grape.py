"""DP-GRAPE: DP-AdamW on random projections of the weight matrices' per-example gradients.

Mulrooney et al., arXiv 2506.15588 (see ``specs/dp_grape.md``). Each selected weight matrix
W ∈ ℝ^{m×n} gets a Gaussian projection P with entries N(0, 1/r) (Johnson–Lindenstrauss; the
authors' code draws std 1/r, kept as ``projection_std="authors"``) on its smaller side; the
engine forms the per-example gradient directly in the projected space from the layer's inputs
A and output gradients Δ (R_i = Δ_iᵀ(A_i Pᵀ), or (Δ_i Pᵀ)ᵀ A_i, see
:class:`~dplightning.privacy.grad_sample.Projection`), so a projected layer's full per-example
gradient is never formed. Projected and full-dimensional gradients
are clipped and noised together by the strategy (one release, one accountant step), AdamW's
moments live in the projected space, and only the update is mapped back.

P is public randomness, regenerated from (seed, parameter name, refresh index) whenever it is
needed (in the backward pass and in ``step``) and never stored: every rank derives the same
P, and a resumed run, whose step count comes back with the optimizer state, the same P too.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dplightning.optim._adam import adam_direction
from dplightning.optim._release import closure_and_release
from dplightning.optim.patterns import excluded
from dplightning.privacy.grad_sample.engines import factors_matrix
from dplightning.privacy.grad_sample.grads import Factored
from dplightning.privacy.grad_sample.transforms import Projection, SlotTransform
from dplightning.privacy.noise import derive_seed
from dplightning.protocols import DPPlan, DPRelease

DEFAULT_EXCLUDE = ("*head*", "*classifier*")
"""Patterns (:mod:`dplightning.optim.patterns`) of weights that stay full-dimensional: task heads, as in the authors'
code."""

Side = Literal["left", "right"]


def projection_side(shape: torch.Size) -> Side:
    """The side the projection shrinks: the smaller dimension of the ``[rows, cols]`` matrix (ties: columns)."""
    rows, cols = shape[0], math.prod(shape[1:])
    return "right" if rows >= cols else "left"


def gaussian_projection(
    seed: int, name: str, refresh: int, rank: int, width: int, device: torch.device, std: str = "jl"
) -> Tensor:
    """P ∈ ℝ^{rank×width} from a generator seeded by (seed, name, refresh) on ``device``.

    ``std="jl"``: N(0, 1/rank), the Johnson–Lindenstrauss scale (norms preserved in
    expectation); ``"authors"``: entries N(0, 1/rank²), as the authors' code draws them
    (projected norms ≈ √rank smaller than full ones).
    """
    if std not in ("authors", "jl"):
        raise ValueError(f"projection std must be 'authors' or 'jl', got {std!r}.")
    generator = torch.Generator(device=device).manual_seed(derive_seed(seed, "dp-grape", name, refresh))
    return torch.randn(rank, width, generator=generator, device=device) * entry_std(rank, std)


def entry_std(rank: int, std: str) -> float:
    """The standard deviation of P's entries: 1/rank (``"authors"``) or 1/√rank (``"jl"``)."""
    return 1 / rank if std == "authors" else 1 / math.sqrt(rank)


class RandomProjection(SlotTransform):
    """A :class:`Projection` whose matrix is regenerated at each use, for the refresh index of its optimizer.

    Args:
        optimizer: The :class:`DPGrape` that owns the projection (its step count picks P).
        name: The parameter's name (part of P's seed).
        shape: The parameter's shape.
        side: ``"right"`` (G ↦ G Pᵀ) or ``"left"`` (G ↦ P G).
    """

    def __init__(self, optimizer: DPGrape, name: str, shape: torch.Size, side: Side) -> None:
        self.optimizer, self.name, self.shape, self.side = optimizer, name, torch.Size(shape), side

    @property
    def width(self) -> int:
        """The dimension P maps from."""
        return math.prod(self.shape[1:]) if self.side == "right" else self.shape[0]

    def matrix(self, device: torch.device) -> Tensor:
        """P for the current refresh index, made on ``device`` (freed by the caller after use)."""
        return self.optimizer.projection_matrix(self.name, self.optimizer.refresh_index, self.width, device)

    def _at(self, device: torch.device) -> Projection:
        return Projection(self.matrix(device), self.shape, self.side)

    def slot_shape(self, shape: torch.Size) -> torch.Size:
        rows, cols, r = shape[0], math.prod(shape[1:]), self.optimizer.rank
        return torch.Size((rows, r) if self.side == "right" else (r, cols))

    def dense(self, grads: Tensor) -> Tensor:
        return self._at(grads.device).dense(grads)

    def factored(self, grad: Factored) -> Factored:
        return self._at(grad.right.device).factored(grad)

    def lift(self, update: Tensor) -> Tensor:
        """An update in slot coordinates mapped back to the parameter's shape: N P (right) or Pᵀ N (left)."""
        p = self.matrix(update.device)
        full = update @ p if self.side == "right" else p.T @ update
        return full.view(self.shape)


class DPGrape(torch.optim.Optimizer):
    """DP-GRAPE: AdamW whose weight matrices are trained on random projections of their gradients.

    A drop-in replacement for ``torch.optim.AdamW`` under ``strategy="dp"`` / ``"dp_ddp"``
    (switch ``optimizer.class_path``, nothing else). It declares a DP plan: the selected
    weights' per-example gradients are projected inside the engine before clipping; all
    parameters, projected or not, share the strategy's clipping policy and noise. The
    update follows ``torch.optim.AdamW`` exactly (bias-corrected, eps added to √v̂, decoupled
    decay applied first), in slot coordinates, then mapped back: with r equal to the full
    dimension and P = I it *is* DP-Adam(W).

    Args:
        params: Parameters or parameter groups (as for any optimizer).
        lr: Learning rate.
        betas: Adam's (β₁, β₂).
        eps: Adam's ε (the authors' default 1e-6).
        weight_decay: Decoupled weight decay.
        rank: r, the projected dimension.
        refresh_every: T: P is redrawn every T optimizer steps (Adam's moments are kept,
            as in the authors' code).
        seed: Projection seed (public randomness: P depends on it, the step and the name only).
        include: fnmatch patterns of parameter names to project instead of the default
            selection (weights of ``nn.Linear`` and Hugging Face ``Conv1D`` layers outside
            ``exclude``); a matching parameter must be a matrix with ``rank ≤`` both sides.
            Each must match a whole name, case-sensitively: ``include`` overrides the layer
            check, so it names exactly what it selects.
        exclude: Patterns of weights that stay full-dimensional, matched against the
            parameter's name and its modules' names as :mod:`dplightning.optim.patterns`
            defines for every optimizer: wildcards as in fnmatch, a pattern without one as a
            substring (``"head"`` is ``"*head*"``), case ignored.
        projection_std: ``"jl"`` (default): P's entries N(0, 1/r), which keeps projected norms
            (so their share of the joint clip) and the lifted update's scale at those of the
            full-dimensional parameters; ``"authors"``: N(0, 1/r²), as the authors' code draws
            them. On the digits ViT at ε = 8 the authors' scale stayed at chance (0.10) while
            ``"jl"`` matched DP-Adam (0.73 vs 0.71, 3 seeds; ``docs/dp_grape.md``), hence the
            default departs from their code.
        scale: Factor on the lifted update of every projected weight (the authors' code: 1.0).
            With P's entries at std s the lifted update's entries have RMS √r·s times the
            slot update's (1/√r for the authors' P): a projected weight then learns √r times
            slower than an unprojected one at the same lr. ``"rms"`` undoes it (√r for the
            authors' P, 1 for ``"jl"``), so every parameter moves at AdamW's per-coordinate
            rate; on digits this decided between chance and DP-Adam-like accuracy
            (``docs/dp_grape.md``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        rank: int = 16,
        refresh_every: int = 100,
        seed: int = 0,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = DEFAULT_EXCLUDE,
        projection_std: str = "jl",
        scale: float | Literal["rms"] = 1.0,
    ) -> None:
        if rank < 1 or refresh_every < 1:
            raise ValueError(f"rank and refresh_every must be >= 1, got rank={rank}, refresh_every={refresh_every}.")
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Invalid AdamW hyperparameters: lr={lr}, betas={betas}, eps={eps}, wd={weight_decay}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        gaussian_projection(seed, "", 0, 1, 1, torch.device("cpu"), projection_std)  # validates the name
        if scale != "rms" and not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"scale must be a positive number or 'rms', got {scale!r}.")
        self.rank, self.refresh_every, self.seed, self.projection_std = rank, refresh_every, seed, projection_std
        self.scale = scale
        self.include, self.exclude = (list(include) if include is not None else None), list(exclude)
        self.projections: dict[nn.Parameter, RandomProjection] = {}
        self._owners: dict[nn.Parameter, list[tuple[str, nn.Module]]] | None = None
        self._release: DPRelease | None = None
        self.param_groups[0].setdefault("dp_grape_steps", 0)

    # ------------------------------------------------------------------ the plan

    @property
    def steps(self) -> int:
        """Optimizer steps taken (saved with the optimizer state, so a resumed run continues it)."""
        return int(self.param_groups[0]["dp_grape_steps"])

    @property
    def refresh_index(self) -> int:
        """Which P the next backward pass and step use: ⌊steps / T⌋."""
        return self.steps // self.refresh_every

    @property
    def lift_scale(self) -> float:
        """The factor on every lifted update (``scale``; ``"rms"``: 1 / (√r · std of P's entries))."""
        if self.scale != "rms":
            return float(self.scale)
        # U = N P sums r products with P's entries: RMS(U) = √r · std · RMS(N); undo it.
        return 1 / (math.sqrt(self.rank) * entry_std(self.rank, self.projection_std))

    def projection_matrix(self, name: str, refresh: int, width: int, device: torch.device) -> Tensor:
        """P of ``name`` at refresh ``refresh``: ``[rank, width]`` at ``projection_std`` (override to change)."""
        return gaussian_projection(self.seed, name, refresh, self.rank, width, device, self.projection_std)

    def dp_bind_module(self, module: nn.Module) -> None:
        """Learn which module owns each parameter (called by the strategy before :meth:`dp_plan`)."""
        owners: dict[nn.Parameter, list[tuple[str, nn.Module]]] = {}
        for name, m in module.named_modules(remove_duplicate=False):
            for p in m.parameters(recurse=False):
                owners.setdefault(p, []).append((name, m))
        self._owners = owners

    def selected(self, name: str, p: nn.Parameter) -> bool:
        """Whether parameter ``name`` is projected (see ``include`` / ``exclude``)."""
        if p.dim() < 2 or self.rank > min(p.shape[0], math.prod(p.shape[1:])):
            if self.include is not None and any(fnmatch.fnmatchcase(name, pat) for pat in self.include):
                raise ValueError(
                    f"{name} (shape {list(p.shape)}) matches include but cannot take a rank-{self.rank} projection: "
                    "it must be a matrix with both sides at least the rank."
                )
            return False
        if self.include is not None:
            return any(fnmatch.fnmatchcase(name, pat) for pat in self.include)
        if self._owners is None:
            raise RuntimeError("DPGrape.dp_plan needs dp_bind_module(module) first (the DP strategy calls it).")
        owners = self._owners.get(p, [])
        return (
            bool(owners)
            and all(_is_projectable_layer(m, p) for _, m in owners)
            and not excluded([name, *(n for n, _ in owners)], self.exclude)
        )

    def dp_plan(self, named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float) -> DPPlan:
        """Project the selected weights; every parameter keeps the strategy's clipping policy (one joint release)."""
        self.projections = {
            p: RandomProjection(self, name, p.shape, projection_side(p.shape))
            for name, p in named_params
            if self.selected(name, p)
        }
        return DPPlan(groups=None, transforms=dict(self.projections))

    def dp_release(self, release: DPRelease) -> None:
        """Keep the step's noisy means (slot coordinates) for :meth:`step`."""
        self._release = release

    def state_elements(self) -> dict[torch.dtype, int]:
        """AdamW's two fp32 moments per slot element (:class:`~dplightning.protocols.DeclaresStateSize`).

        A projected weight's slot is its ``slot_shape`` (after :meth:`dp_plan`), any other parameter's its own
        shape: :func:`~dplightning.optim._adam.adam_direction` makes the moments like the released slot, in fp32
        whatever the weights' dtype.
        """
        elements = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    projection = self.projections.get(p)
                    elements += 2 * (projection.slot_shape(p.shape) if projection else p.shape).numel()
        return {torch.float32: elements} if elements else {}

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step on the released noisy means; projected updates are mapped back with P."""
        loss, release = closure_and_release(self, closure)
        if release is None:
            raise RuntimeError(
                "DPGrape got no DP release: it only trains under Trainer(strategy='dp') or 'dp_ddp', which clip "
                "and noise its projected gradients (a plain optimizer step would leak the raw gradient's subspace "
                "coordinates, and the projected ones would have none)."
            )
        for group in self.param_groups:
            for p in group["params"]:
                if p not in release.slots:
                    continue
                direction = adam_direction(self.state[p], release.slots[p], group["betas"], group["eps"])
                if p in self.projections:
                    direction = self.projections[p].lift(direction) * self.lift_scale
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(direction.to(p.dtype), alpha=-group["lr"])
        self.param_groups[0]["dp_grape_steps"] = self.steps + 1  # the next backward pass sees the next P
        return loss


def _is_projectable_layer(layer: nn.Module, p: nn.Parameter) -> bool:
    return factors_matrix(layer) and p is layer.weight
