"""``DPMuon``: Muon on the hidden weight matrices, AdamW on the rest, from one DP release.

Private use needs nothing but the optimizer: under ``strategy="dp"`` its DP plan makes
each hidden matrix its own clip group (bound C_W) and the other parameters one group, the
strategy adds noise calibrated to the joint sensitivity √(Σ C_b²) (one accountant entry
per step) and pushes the noisy mean with its noise std; momentum, Newton–Schulz and the
AdamW step are post-processing of that release. ``bias_correction=True`` is DP-MuonBC
(:mod:`dplightning.optim.bias_correction`). Spec: ``dp_muon.md``; Muon reference:
KellerJordan/Muon.

Two control arms separate the clip plan from the update rule: ``clip_split="flat"`` (Muon's
update under flat clipping) and ``matrix_update="adamw"`` (AdamW under Muon's per-matrix plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from dplightning.optim._adam import adam_direction
from dplightning.optim._release import closure_and_release
from dplightning.optim.bias_correction import MOMENTUM_FORMS, MomentumForm, momentum_noise_variance, orthogonalize
from dplightning.optim.newton_schulz import NORMALIZATIONS, Normalization
from dplightning.optim.newton_schulz import ns_coefficients as resolve_coefficients
from dplightning.optim.patterns import excluded
from dplightning.privacy.clipping import ClipGroup, split_max_grad_norm
from dplightning.privacy.grad_sample.engines import is_hf_conv1d
from dplightning.protocols import DPPlan, DPRelease

DEFAULT_EXCLUDE: tuple[str, ...] = ("embed", "wte", "wpe", "head", "classifier", "score", "shared")
"""Patterns of ≥2-D parameters that get AdamW, not Muon (embeddings and output heads); without a wildcard, each
matches the names containing it (:mod:`dplightning.optim.patterns`)."""

CLIP_SPLITS = {
    "equal": "each Muon matrix its own group, the rest one group; C_b = C/√(number of groups)",
    "numel": "the same groups; C_b ∝ √(numel_b)",
    "flat": "one group of every parameter, bound C (a control arm: Muon's update, DP-Adam's plan)",
}
MATRIX_UPDATES = {
    "muon": "momentum + Newton–Schulz (DP-Muon)",
    "adamw": "AdamW with the adam_* settings (a control arm: DP-Adam under Muon's clip plan)",
}

PAPER_FORM: dict[str, Any] = {
    "momentum_form": "heavyball",
    "normalization": "max1",
    "ns_coefficients": "taylor2",
    "ns_steps": 5,
}
"""The DP-Muon paper's form (per the spec's summary): heavy-ball momentum, Y₀ = M / max(1, ‖M‖_F) and
q steps of the Taylor polynomial p_κ. The paper's κ and q are not confirmed; κ = 2, q = 5 here.
Use as ``DPMuon(params, **PAPER_FORM, lr=...)``; its learning rate is not Muon's (the update
is not normalised), so tune it on its own grid."""


class DPMuon(torch.optim.Optimizer):
    """Muon for hidden matrices and AdamW for the rest; DP-Muon / DP-MuonBC under a DP strategy.

    Which parameters are Muon's: a param group's ``use_muon`` if it sets one, else every
    ≥2-D parameter that no ``exclude`` pattern matches (names are known once the strategy
    asks for the DP plan; without a DP strategy every ≥2-D parameter). Conv
    filters are flattened to ``[out, in·kh·kw]``; the shape scale √max(1, rows/cols) uses that
    flattened shape (the reference uses the kernel's kh/kw for 4-D weights, a quirk not copied).
    The scale is the layer's fan-out/fan-in, not the storage's: Hugging Face ``Conv1D`` weights
    (GPT-2) are stored ``[in, out]`` and found by :meth:`dp_bind_module`.

    Args:
        params: Parameters or param groups (a group may set ``use_muon`` and any option below).
        lr: Muon learning rate (spectral norm per update).
        momentum: β.
        momentum_form: ``"nesterov"`` (Muon), ``"ema"`` or ``"heavyball"`` (paper); see
            :data:`~dplightning.optim.bias_correction.MOMENTUM_FORMS`.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: The step's polynomial: a name in
            :data:`~dplightning.optim.newton_schulz.NS_PRESETS` (``"muon"``, Keller Jordan's
            quintic; ``"taylor1"``/``"taylor2"``, the paper's cubic/quintic Taylor forms) or
            explicit coefficients ``(c₀, c₁, …)`` of X ← (c₀ + c₁XXᵀ + …)X.
        normalization: ``"frobenius"`` (Muon) or ``"max1"`` (paper).
        weight_decay: Decoupled weight decay of the Muon matrices: W ← W(1 − lr·wd).
        adam_lr: AdamW learning rate of the other parameters.
        adam_betas: AdamW betas.
        adam_eps: AdamW epsilon.
        adam_weight_decay: AdamW's decoupled weight decay.
        exclude: Patterns of ≥2-D parameters left to AdamW, matched against the parameter's
            name and its modules' names as :mod:`dplightning.optim.patterns` defines for every
            optimizer: a pattern without a wildcard matches the names that contain it (so a name
            fragment such as ``"embed"`` works as it always did), case ignored; with one, fnmatch.
        clip_split: The clip plan and how C = ``max_grad_norm`` is split into per-group bounds
            (Δ = C either way); see :data:`CLIP_SPLITS`.
        matrix_update: ``"muon"``, or ``"adamw"`` for the control arm; see :data:`MATRIX_UPDATES`.
        bias_correction: DP-MuonBC.
        probe_scale: ρ/τ of the probes.
        probe_pairs: Antithetic probe pairs per matrix and step.
        max_noise_ratio: The guard r_max (``None``: correct whatever the noise ratio).
        ns_dtype: Precision of plain NS, ``"bfloat16"``/``"float32"``; default bf16 on CUDA, fp32 on CPU.
        seed: Seed of the probe generator (public randomness, the same on every rank).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        momentum_form: MomentumForm = "nesterov",
        ns_steps: int = 5,
        ns_coefficients: str | Sequence[float] = "muon",
        normalization: Normalization = "frobenius",
        weight_decay: float = 0.0,
        adam_lr: float = 3e-4,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-10,
        adam_weight_decay: float = 0.0,
        exclude: Sequence[str] = DEFAULT_EXCLUDE,
        clip_split: Literal["equal", "numel", "flat"] = "equal",
        matrix_update: Literal["muon", "adamw"] = "muon",
        bias_correction: bool = False,
        probe_scale: float = 1.0,
        probe_pairs: int = 1,
        max_noise_ratio: float | None = 0.5,
        ns_dtype: str | None = None,
        seed: int = 0,
    ) -> None:
        _check(lr >= 0 and adam_lr >= 0, f"learning rates must be >= 0, got lr={lr}, adam_lr={adam_lr}")
        _check(0 <= momentum < 1, f"momentum must lie in [0, 1), got {momentum}")
        _check(momentum_form in MOMENTUM_FORMS, f"momentum_form must be one of {sorted(MOMENTUM_FORMS)}")
        _check(normalization in NORMALIZATIONS, f"normalization must be one of {sorted(NORMALIZATIONS)}")
        _check(ns_steps >= 1, f"ns_steps must be >= 1, got {ns_steps}")
        _check(clip_split in CLIP_SPLITS, f"clip_split must be one of {sorted(CLIP_SPLITS)}")
        _check(matrix_update in MATRIX_UPDATES, f"matrix_update must be one of {sorted(MATRIX_UPDATES)}")
        coefficients = resolve_coefficients(ns_coefficients)  # raises on an unknown preset or a bad sequence
        _check(probe_scale > 0 and probe_pairs >= 1, "probe_scale must be > 0 and probe_pairs >= 1")
        _check(max_noise_ratio is None or max_noise_ratio > 0, f"max_noise_ratio must be > 0, got {max_noise_ratio}")
        _check(all(0 <= b < 1 for b in adam_betas), f"adam_betas must lie in [0, 1), got {adam_betas}")
        _check(ns_dtype in (None, "bfloat16", "float32"), f"ns_dtype must be bfloat16 or float32, got {ns_dtype}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            momentum_form=momentum_form,
            ns_steps=ns_steps,
            ns_coefficients=coefficients,
            normalization=normalization,
            weight_decay=weight_decay,
            adam_lr=adam_lr,
            adam_betas=tuple(adam_betas),
            adam_eps=adam_eps,
            adam_weight_decay=adam_weight_decay,
            bias_correction=bias_correction,
            probe_scale=probe_scale,
            probe_pairs=probe_pairs,
            max_noise_ratio=max_noise_ratio,
            use_muon=None,
        )
        super().__init__(params, defaults)
        self.exclude = tuple(exclude)
        self.clip_split = clip_split
        self.matrix_update = matrix_update
        self.ns_dtype = getattr(torch, ns_dtype) if ns_dtype else None
        self.seed = seed
        self.names: dict[Tensor, str] = {}
        self.last_noise_ratios: dict[str, tuple[float, bool]] = {}
        """Per Muon matrix, the last step's r̂ and whether BC was applied (public; for logging)."""
        self.corrected_fraction: tuple[int, int] = (0, 0)
        """(matrix-steps corrected, matrix-steps with BC on) so far."""
        self.guard_open: tuple[int, int] = (0, 0)
        """(matrix-steps with 0 < r̂ ≤ max_noise_ratio, matrix-steps with noise) so far: where a guarded BC acts."""
        self._stored_transposed: set[Tensor] = set()
        self._owner_names: dict[Tensor, list[str]] = {}
        self._planned = False
        self._release: DPRelease | None = None
        self._generators: dict[torch.device, torch.Generator] = {}
        self._generator_states: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ the split and the DP plan

    def uses_muon(self, p: Tensor, group: dict[str, Any] | None = None) -> bool:
        """Whether ``p`` is updated by Muon (else by AdamW)."""
        group = group if group is not None else next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if group["use_muon"] is not None:
            return bool(group["use_muon"])
        name = self.names.get(p)
        return p.dim() >= 2 and (name is None or not excluded([name, *self._owner_names.get(p, [])], self.exclude))

    def dp_bind_module(self, module: nn.Module) -> None:
        """Learn which weights are stored ``[in, out]`` and which modules own each parameter.

        Hugging Face ``Conv1D`` weights are stored ``[in, out]``: their shape scale uses the
        layer's fan-out/fan-in. ``exclude`` patterns match the owning modules' names too. The DP
        strategies call it before :meth:`dp_plan`; without one, call it once with the model.
        """
        # Module.__getattr__ types the weight as Tensor | Module; a Conv1D's is a parameter.
        self._stored_transposed = {cast(Tensor, m.weight) for m in module.modules() if is_hf_conv1d(m)}
        owners: dict[Tensor, list[str]] = {}
        for name, m in module.named_modules(remove_duplicate=False):
            for p in m.parameters(recurse=False):
                owners.setdefault(p, []).append(name)
        self._owner_names = owners

    def dp_plan(self, named_params: Sequence[tuple[str, nn.Parameter]], max_grad_norm: float) -> DPPlan:
        """Each Muon matrix its own clip group, the other parameters one group (or all one, ``"flat"``); Δ = C."""
        self.names.update({p: n for n, p in named_params})
        self._planned = True
        if self.clip_split == "flat":
            return DPPlan([ClipGroup("all", tuple(p for _, p in named_params), max_grad_norm)])
        matrices = [(n, p) for n, p in named_params if self.uses_muon(p)]
        rest = tuple(p for _, p in named_params if not self.uses_muon(p))
        blocks: list[tuple[str, tuple[nn.Parameter, ...]]] = [(n, (p,)) for n, p in matrices]
        blocks += [("non-matrix", rest)] if rest else []
        if self.clip_split == "equal":
            weights = [1.0] * len(blocks)
        else:
            weights = [float(sum(p.numel() for p in ps)) for _, ps in blocks]
        bounds = split_max_grad_norm(max_grad_norm, weights)
        return DPPlan([ClipGroup(n, ps, bound) for (n, ps), bound in zip(blocks, bounds)])

    def dp_release(self, release: DPRelease) -> None:
        """Keep the step's release (the noisy means and their noise std) for :meth:`step`."""
        self._release = release

    def state_elements(self) -> dict[torch.dtype, int]:
        """The fp32 state of its steps (:class:`~dplightning.protocols.DeclaresStateSize`).

        A matrix that Muon updates keeps one momentum buffer of its size; every other parameter
        (and every one under ``matrix_update="adamw"``) AdamW's two moments. Both are fp32 whatever
        the weights' dtype. The split is :meth:`uses_muon`'s, so ask after :meth:`dp_plan`.
        """
        elements = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    muon = self.uses_muon(p, group) and self.matrix_update == "muon"
                    elements += p.numel() * (1 if muon else 2)
        return {torch.float32: elements} if elements else {}

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Momentum + NS (+ BC) for the Muon matrices, AdamW for the rest, from the release or ``p.grad``."""
        loss, release = closure_and_release(self, closure)
        if self._planned and release is None:
            raise RuntimeError(
                "DPMuon has a DP plan but received no release before step(): the noise std needed for its "
                "momentum bookkeeping (and DP-MuonBC) is unknown. Step it only through the DP strategy."
            )
        noise_var = release.noise_std**2 if release is not None else 0.0
        slots = release.slots if release is not None else {}
        for group in self.param_groups:
            muon: list[tuple[Tensor, Tensor]] = []
            adam: list[tuple[Tensor, Tensor]] = []
            for p in group["params"]:
                g = slots.get(p, p.grad)
                if g is None:
                    continue
                is_muon = self.uses_muon(p, group) and self.matrix_update == "muon"
                (muon if is_muon else adam).append((p, g.view_as(p)))
            self._muon_step(group, muon, noise_var)
            self._adam_step(group, adam)
        return loss

    def _muon_step(self, group: dict[str, Any], params: list[tuple[Tensor, Tensor]], noise_var: float) -> None:
        if not params:
            return
        beta, form = group["momentum"], group["momentum_form"]
        inputs, taus = [], []
        for p, g in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                state["noise_var"] = 0.0
            M, g = state["momentum_buffer"], g.float()
            if form == "heavyball":
                M.mul_(beta).add_(g)
                U = M
            else:
                M.lerp_(g, 1 - beta)
                U = g.lerp(M, beta) if form == "nesterov" else M
            state["noise_var"], tau2 = momentum_noise_variance(form, beta, state["noise_var"], noise_var)
            inputs.append(U.reshape(U.shape[0], -1))
            taus.append(math.sqrt(tau2))
        result = orthogonalize(
            inputs,
            taus,
            bias_correction=group["bias_correction"],
            generator=self._generator(params[0][0].device) if group["bias_correction"] else None,
            probe_scale=group["probe_scale"],
            probe_pairs=group["probe_pairs"],
            max_noise_ratio=group["max_noise_ratio"],
            ns_dtype=self.ns_dtype,
            steps=group["ns_steps"],
            coefficients=group["ns_coefficients"],
            normalization=group["normalization"],
        )
        lr, wd, r_max = group["lr"], group["weight_decay"], group["max_noise_ratio"]
        done, on = self.corrected_fraction
        opened, noisy = self.guard_open
        for (p, _), out, ratio, corrected in zip(params, result.outputs, result.noise_ratios, result.corrected):
            update = out * self._shape_scale(p, out)  # after BC: the scale is not part of f
            p.mul_(1 - lr * wd).add_(update.view_as(p).to(p.dtype), alpha=-lr)
            self.last_noise_ratios[self.names.get(p, str(id(p)))] = (ratio, corrected)
            done, on = done + corrected, on + bool(group["bias_correction"])
            opened += ratio > 0 and (r_max is None or ratio <= r_max)
            noisy += ratio > 0
        self.corrected_fraction = (done, on)
        self.guard_open = (opened, noisy)

    def _shape_scale(self, p: Tensor, flat: Tensor) -> float:
        """√max(1, fan_out/fan_in) of the flattened ``[out, in·k…]`` matrix (transposed if stored ``[in, out]``)."""
        rows, cols = flat.shape
        fan_out, fan_in = (cols, rows) if p in self._stored_transposed else (rows, cols)
        return math.sqrt(max(1.0, fan_out / fan_in))

    def dp_metrics(self) -> dict[str, float]:
        """Public diagnostics of the last step, for the logger (post-processing of the release).

        ``muon/noise_ratio_p25|p50|p75``: quartiles of r̂ = τ√(mn)/‖U‖_F over the last step's
        matrices (1 means U is all noise at the scale of its norm); ``muon/guard_open_fraction``:
        share of noisy matrix-steps so far with r̂ ≤ ``max_noise_ratio`` (where a guarded BC acts);
        ``muon/bc_fraction`` (with ``bias_correction``): share of matrix-steps BC was applied to.
        """
        ratios = sorted(r for r, _ in self.last_noise_ratios.values() if r > 0)
        if not ratios:
            return {}
        q = torch.tensor(ratios, dtype=torch.float64).quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
        metrics = {f"muon/noise_ratio_p{k}": float(v) for k, v in zip((25, 50, 75), q)}
        opened, noisy = self.guard_open
        metrics["muon/guard_open_fraction"] = opened / noisy if noisy else 0.0
        done, on = self.corrected_fraction
        if on:
            metrics["muon/bc_fraction"] = done / on
        return metrics

    def _adam_step(self, group: dict[str, Any], params: list[tuple[Tensor, Tensor]]) -> None:
        lr, wd = group["adam_lr"], group["adam_weight_decay"]
        for p, g in params:
            direction = adam_direction(self.state[p], g, group["adam_betas"], group["adam_eps"])
            p.mul_(1 - lr * wd).add_(direction.to(p.dtype), alpha=-lr)

    # ------------------------------------------------------------------ public randomness and resume

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)  # public: the same probes on every rank, independent of the data
            saved = self._generator_states.pop(str(device), None)
            if saved is not None:
                gen.set_state(saved)
            self._generators[device] = gen
        return self._generators[device]

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus the probe generators' states (exact resume of DP-MuonBC)."""
        sd = super().state_dict()
        states = {str(d): g.get_state() for d, g in self._generators.items()}
        sd["dpmuon_generators"] = {**self._generator_states, **states}
        sd["dpmuon_corrected_fraction"] = self.corrected_fraction
        sd["dpmuon_guard_open"] = self.guard_open
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved."""
        state_dict = dict(state_dict)
        self._generator_states = dict(state_dict.pop("dpmuon_generators", {}))
        self.corrected_fraction = tuple(state_dict.pop("dpmuon_corrected_fraction", (0, 0)))
        self.guard_open = tuple(state_dict.pop("dpmuon_guard_open", (0, 0)))
        self._generators = {}
        super().load_state_dict(state_dict)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"DPMuon: {message}.")
