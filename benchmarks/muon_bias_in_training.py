"""DP-MuonBC's bias in real training: the spec's V5 diagnostic (``dp_muon.md`` §4), on public data ONLY.

**Not private, by design.** The run records the noise-free clipped mean of every step, which a
private run must never see. It trains the digits ViT (``configs/grape/vit_digits_dp_adam.yaml``
with the optimizer switched to ``dplightning.optim.DPMuon``) under ``strategy="dp"`` at ε = 8
on scikit-learn's digits, a public data set, and wraps the strategy's ``GaussianNoise.sample`` so
that it knows the noise it added to each bucket: clean mean = released mean − noise / expected
batch, per parameter slot. Replaying DPMuon's momentum (same form and β) on the clean means
gives the noise-free NS input Ū of every matrix; U is the optimizer's actual NS input (the
matrices its ``orthogonalize`` call receives) and τ follows from ``momentum_noise_variance``.
The replay check: U − Ū must be the momentum-filtered DP noise, per-coordinate std τ.

At a few checkpoints, for the hidden matrices of the ViT (attention q/k/v/output, MLP in/out),
the state is frozen and ``pairs`` antithetic pairs of fresh noise N ~ N(0, τ²) per coordinate are
drawn (N and −N: the mean is unchanged and its first-order Monte Carlo error cancels). For each
estimator (plain NS; DP-MuonBC with ρ = τ, λ = 1; DP-MuonBC with ρ = 2τ, λ = 1/4, a clamped λ;
all three through ``orthogonalize`` with ``max_noise_ratio=None`` in fp32) it reports, against
f(Ū):

* relative bias ‖E f̂ − f(Ū)‖_F / ‖f(Ū)‖_F with the Monte Carlo floor subtracted: with a_i the
  pair means minus f(Ū), ā their mean and V = Σ_coords sample variance, θ = ‖ā‖² − V/n is an
  unbiased estimate of ‖E a‖²; the bias reported is √max(θ, 0)/‖f(Ū)‖. The raw ‖ā‖/‖f(Ū)‖ and
  the floor √(V/n)/‖f(Ū)‖ are reported too.
* the paired test of BC against plain: Δθ = θ_plain − θ_BC (same draws), its standard error and
  z = Δθ/SE; z > 2 says BC reduces the bias beyond its Monte Carlo error.
* the gain ⟨E f̂, f(Ū)⟩/‖f(Ū)‖² and the direction error ‖r‖/(gain·‖f(Ū)‖), where E f̂ = gain·f(Ū) + r
  with r ⟂ f(Ū): the part of the bias that a rescaling (a learning rate) cannot undo.
* relative RMSE of one draw, √(mean ‖f̂ − f(Ū)‖²)/‖f(Ū)‖.

Standard errors: delete-one-group jackknife over ``groups`` groups of pairs. Also r̂ = τ√(mn)/‖U‖_F
(what the guard sees) and the clean ratio τ√(mn)/‖Ū‖_F. Runs: DP-Muon's default (Muon's quintic,
Nesterov, Frobenius normalization) at expected batch 256 (200 steps) and 1,024 (q ≈ 0.81, 50
steps: past q ≈ 0.8 the amplification by subsampling is nearly gone, so fewer steps are what
lowers the noise); the paper form (``PAPER_FORM``) too where the installed DPMuon has it. To
map the bias against r̂ below the noise met in training, the last checkpoint's Ū is also
studied with τ scaled down (``--tau-scales``; a what-if, marked as such in the records).

    OMP_NUM_THREADS=1 python benchmarks/muon_bias_in_training.py \\
        --out benchmarks/results/muon_bias_in_training_cpu.json --figure docs/figures/dp_muon_bias_in_training.png
    OMP_NUM_THREADS=1 python benchmarks/muon_bias_in_training.py --smoke    # < 1 min, for the test
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from _harness import provenance
from _outputs import default_result
from torch import Tensor
from tqdm import tqdm

import dplightning.optim.muon as muon_module
from dplightning.cli import build_cli
from dplightning.optim import DPMuon
from dplightning.optim.bias_correction import momentum_noise_variance, orthogonalize
from dplightning.privacy.noise import GaussianNoise
from dplightning.protocols import DPRelease

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "grape" / "vit_digits_dp_adam.yaml"
PUBLIC_ONLY = (
    "PUBLIC DATA ONLY: this diagnostic records the noise-free clipped mean of every step (the noise the "
    "strategy added is subtracted), which is not private. Never run it on private data."
)
# DPMuon's settings on this ViT (those of configs/muon/vit_digits_dpmuon.yaml): Muon's lr and β,
# AdamW with DP-Adam's betas/eps on the non-matrix parameters. Training itself runs plain DP-Muon.
OPTIMIZER_ARGS: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "adam_lr": 0.01,
    "adam_betas": [0.9, 0.999],
    "adam_eps": 1.0e-6,
}
# Estimators: name -> probe_scale ρ/τ (None: plain NS). λ = 1/probe_scale².
ESTIMATORS: dict[str, float | None] = {"plain": None, "bc": 1.0, "bc_lam1/4": 2.0}
BC_NAMES = [n for n, s in ESTIMATORS.items() if s is not None]
# The ViT's hidden matrices by kind: name endings of transformers' current ViT, then of its older one.
KINDS = {
    "attention.q_proj.weight": "q",
    "attention.k_proj.weight": "k",
    "attention.v_proj.weight": "v",
    "attention.o_proj.weight": "attn_out",
    "mlp.fc1.weight": "mlp_in",
    "mlp.fc2.weight": "mlp_out",
    "attention.attention.query.weight": "q",
    "attention.attention.key.weight": "k",
    "attention.attention.value.weight": "v",
    "attention.output.dense.weight": "attn_out",
    "intermediate.dense.weight": "mlp_in",
    ".output.dense.weight": "mlp_out",  # after attention.output.dense (checked first)
}
OPT_ONLY_KWARGS = {
    "bias_correction",
    "generator",
    "probe_scale",
    "probe_pairs",
    "max_noise_ratio",
    "ns_dtype",
    "bc_dtype",
}


@dataclass(frozen=True)
class Run:
    """One training run: the Muon form, the expected batch, the steps and the frozen checkpoints."""

    form: str
    batch: int
    steps: int
    checkpoints: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.form}_B{self.batch}"


def paper_form() -> dict[str, Any] | None:
    """``PAPER_FORM`` of the installed DPMuon, or ``None`` where the API has not landed."""
    form = getattr(muon_module, "PAPER_FORM", None)
    if form is None or not set(form) <= set(inspect.signature(DPMuon.__init__).parameters):
        return None
    return dict(form)


def matrix_kind(name: str) -> str | None:
    """``q``/``k``/``v``/``attn_out``/``mlp_in``/``mlp_out`` for a ViT hidden matrix, else ``None``."""
    for fragment, kind in KINDS.items():
        if name.endswith(fragment):
            return kind
    return None


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    for word in ("layers", "layer"):
        if word in parts and parts.index(word) + 1 < len(parts) and parts[parts.index(word) + 1].isdigit():
            return int(parts[parts.index(word) + 1])
    return None


# ---------------------------------------------------------------------------------------------- recording


@dataclass
class Snapshot:
    """One matrix's frozen state at a checkpoint: the NS input U, the clean Ū and τ."""

    run: str
    step: int
    name: str
    U: Tensor
    Ubar: Tensor
    tau: float
    r_hat_optimizer: float
    ns_kwargs: dict[str, Any]


@dataclass
class Recorder:
    """Wraps the noise source and DPMuon to keep, per step, the noise-free NS input of every Muon matrix.

    Patches (class level, only while :meth:`patched` is active): ``GaussianNoise.sample`` records
    every noise tensor it returns with the tensor it was shaped like (a bucket);
    ``DPMuon.dp_release`` subtracts each slot's noise / expected batch from the released mean and
    replays the momentum on it; the ``orthogonalize`` DPMuon calls records the actual U and τ and
    checks them against the replay.

    Args:
        run: The run's name (recorded in the snapshots).
        checkpoints: 1-based steps at which the selected matrices are frozen.
        layers: ViT layers whose matrices are frozen.
    """

    run: str
    checkpoints: set[int]
    layers: set[int]
    snapshots: list[Snapshot] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)
    ns_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: Any = None
    _noise: list[tuple[Tensor, float, Tensor]] = field(default_factory=list)
    _clean: dict[Tensor, Tensor] = field(default_factory=dict)  # per Muon parameter: the clean NS input Ū
    _buffers: dict[Tensor, tuple[Tensor, float]] = field(default_factory=dict)  # clean M, noise variance of M
    _pending: list[list[Tensor]] = field(default_factory=list)  # per orthogonalize call: its parameters in order
    _taus: dict[Tensor, float] = field(default_factory=dict)
    _step: int = 0
    _optimizer: DPMuon | None = None

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        recorder = self
        sample, dp_release, ortho = GaussianNoise.sample, DPMuon.dp_release, muon_module.orthogonalize

        def recording_sample(noise: GaussianNoise, like: Tensor, std: float) -> Tensor:
            out = sample(noise, like, std)
            recorder._noise.append((like, std, out))
            return out

        def recording_release(opt: DPMuon, release: DPRelease) -> None:
            recorder._on_release(opt, release)
            dp_release(opt, release)

        def recording_orthogonalize(*args: Any, **kwargs: Any) -> Any:
            result = ortho(*args, **kwargs)
            bound = inspect.signature(ortho).bind(*args, **kwargs)
            recorder._on_orthogonalize(bound.arguments, result)
            return result

        with (
            mock.patch.object(GaussianNoise, "sample", recording_sample),
            mock.patch.object(DPMuon, "dp_release", recording_release),
            mock.patch.object(muon_module, "orthogonalize", recording_orthogonalize),
        ):
            yield

    def _slot_noise(self, slot: Tensor) -> Tensor:
        """The noise this step added to ``slot`` (a view of one bucket), found by storage and offset."""
        for bucket, _, noise in self._noise:
            if bucket.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr():
                offset = slot.storage_offset() - bucket.storage_offset()
                return noise.reshape(-1)[offset : offset + slot.numel()].view(slot.shape)
        if self._noise:
            raise RuntimeError("A released slot lies in no bucket the noise source was called for.")
        return torch.zeros_like(slot)  # σ = 0: no noise drawn

    def _on_release(self, opt: DPMuon, release: DPRelease) -> None:
        self._optimizer = opt
        self._step = release.step + 1
        stds = {std for _, std, _ in self._noise}
        if len(stds) > 1:
            raise RuntimeError(f"One release drew noise of several stds {sorted(stds)}: not one process' release.")
        # The noise of the sum has std σΔ; the release divides it by the expected batch B.
        batch = stds.pop() / release.noise_std if stds and release.noise_std > 0 else 1.0
        self._pending = []
        for group in opt.param_groups:
            params = [p for p in group["params"] if p in release.slots and opt.uses_muon(p, group)]
            if not params:
                continue
            self._pending.append(params)
            beta, form = group["momentum"], group["momentum_form"]
            for p in params:
                slot = release.slots[p]
                clean = (slot - self._slot_noise(slot) / batch).float().view_as(p)
                M, var = self._buffers.get(p, (torch.zeros_like(clean), 0.0))
                # The optimizer's momentum, on the clean means (same form and β).
                if form == "heavyball":
                    M = beta * M + clean
                    Ubar = M
                else:
                    M = torch.lerp(M, clean, 1 - beta)
                    Ubar = torch.lerp(clean, M, beta) if form == "nesterov" else M
                var, tau2 = momentum_noise_variance(form, beta, var, release.noise_std**2)
                self._buffers[p] = (M, var)
                self._clean[p] = Ubar.reshape(Ubar.shape[0], -1).clone()
                self._taus[p] = math.sqrt(tau2)
        self._noise = []
        self.steps.append({"step": self._step, "noise_std": release.noise_std, "expected_batch": batch})

    def _on_orthogonalize(self, arguments: dict[str, Any], result: Any) -> None:
        if not self._pending:
            raise RuntimeError("DPMuon orthogonalized matrices without a release the recorder saw.")
        params, matrices, taus = self._pending.pop(0), arguments["matrices"], arguments["taus"]
        if [tuple(m.shape) for m in matrices] != [tuple(self._clean[p].shape) for p in params]:
            raise RuntimeError("The matrices DPMuon orthogonalized are not its Muon parameters in group order.")
        ns_kwargs = dict(arguments.get("ns_kwargs", {}))
        self.ns_kwargs = {k: v for k, v in ns_kwargs.items() if k not in OPT_ONLY_KWARGS}
        names = self._optimizer.names if self._optimizer is not None else {}
        sq, count, total, tau_err = 0.0, 0, 0.0, 0.0
        for p, U, tau, ratio in zip(params, matrices, taus, result.noise_ratios):
            diff = U.float() - self._clean[p]
            sq += diff.square().sum().item()
            total += diff.sum().item()
            count += diff.numel()
            tau_err = max(tau_err, abs(tau - self._taus[p]) / max(self._taus[p], 1e-30))
            name = names.get(p, str(id(p)))
            if self._step in self.checkpoints and matrix_kind(name) and layer_of(name) in self.layers:
                self.snapshots.append(
                    Snapshot(
                        self.run,
                        self._step,
                        name,
                        U.detach().float().clone(),
                        self._clean[p].clone(),
                        self._taus[p],
                        ratio,
                        self.ns_kwargs,
                    )  # fmt: skip
                )
        tau = self._taus[params[0]]
        row = self.steps[-1]
        row["tau"] = tau
        row["tau_optimizer_rel_err"] = tau_err
        row["diff_std_over_tau"] = math.sqrt(sq / count) / tau if tau > 0 else float("nan")
        row["diff_mean_over_tau"] = total / count / tau if tau > 0 else float("nan")
        row.update(quartiles("r_hat", result.noise_ratios))
        if self.progress is not None:
            self.progress.update(1)


def quartiles(prefix: str, values: Sequence[float]) -> dict[str, float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return {f"{prefix}_p25": q[0], f"{prefix}_p50": q[1], f"{prefix}_p75": q[2]}


def train(run: Run, epsilon: float, seed: int, layers: set[int]) -> tuple[dict[str, Any], list[Snapshot]]:
    """Fit the digits ViT with DPMuon under the DP strategy, recording the clean NS inputs."""
    init = dict(OPTIMIZER_ARGS)
    if run.form == "paper":
        form = paper_form()
        if form is None:
            raise RuntimeError("The installed DPMuon has no PAPER_FORM.")
        init.update(form)
    recorder = Recorder(run.name, set(run.checkpoints), layers)
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / "dpmuon.yaml"
        block = json.dumps({"class_path": "dplightning.optim.DPMuon", "init_args": init})  # JSON is YAML
        overlay.write_text(f"model:\n  init_args:\n    optimizer: {block}\n")
        args = [
            "fit", "--config", str(BASE_CONFIG), "--config", str(overlay), f"--seed_everything={seed}",
            "--trainer.max_epochs=-1", f"--trainer.max_steps={run.steps}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--test_after_fit=false",
            f"--trainer.default_root_dir={tmp}", f"--data.init_args.batch_size={run.batch}",
            f"--trainer.strategy.init_args.target_epsilon={epsilon}",
        ]  # fmt: skip
        start = time.perf_counter()
        # The CLI reads these args, not this script's command line.
        argv = mock.patch.object(sys, "argv", sys.argv[:1])
        with recorder.patched(), argv, tqdm(total=run.steps, desc=f"train {run.name}", leave=False) as bar:
            recorder.progress = bar
            cli = build_cli(args)
        fit_s = time.perf_counter() - start
        test = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    strategy = cli.trainer.strategy
    state = strategy.dp_state
    devs = [abs(r["diff_std_over_tau"] - 1) for r in recorder.steps if math.isfinite(r["diff_std_over_tau"])]
    record = {
        "name": run.name, "form": run.form, "optimizer_init_args": init, "ns_kwargs": recorder.ns_kwargs,
        "expected_batch": run.batch, "sample_rate": state.sample_rate, "steps": state.steps,
        "checkpoints": list(run.checkpoints), "noise_multiplier": state.noise_multiplier,
        "epsilon": strategy.get_epsilon(), "delta": state.delta, "test_acc": float(test["test_acc"]),
        "fit_seconds": round(fit_s, 1),
        "replay_check": {"max_abs_dev_std_over_tau": max(devs) if devs else None,
                         "max_tau_optimizer_rel_err": max(r["tau_optimizer_rel_err"] for r in recorder.steps)},
        "per_step": recorder.steps,
    }  # fmt: skip
    return record, recorder.snapshots


# ---------------------------------------------------------------------------------------------- Monte Carlo


def estimates(U: Tensor, tau: float, generator: torch.Generator, ns_kwargs: dict[str, Any]) -> dict[str, Tensor]:
    """Every estimator on a batch of noisy inputs ``U`` [k, m, n], through ``orthogonalize`` in fp32."""
    matrices, taus = list(U.unbind(0)), [tau] * U.shape[0]
    out = {}
    for name, scale in ESTIMATORS.items():
        res = orthogonalize(
            matrices, taus, bias_correction=scale is not None, generator=generator, probe_scale=scale or 1.0,
            max_noise_ratio=None, ns_dtype=torch.float32, bc_dtype=torch.float32, **ns_kwargs,
        )  # fmt: skip
        out[name] = torch.stack(res.outputs)
    return out


def _statistics(S: Tensor, P: Tensor, D: Tensor, n: Tensor, target: Tensor) -> dict[str, Tensor]:
    """Bias, MC floor, θ, gain and RMSE from sums over n antithetic pairs (batched over the leading dim).

    S: Σ a_i (a_i = pair mean − f(Ū), flattened), P: Σ ‖a_i‖², D: Σ over the 2n draws of ‖f̂ − f(Ū)‖².
    """
    target_norm = target.norm().item()
    abar = S / n[:, None]
    sq = abar.square().sum(1)
    var = (P - n * sq) / (n - 1)  # Σ over coordinates of the unbiased variance of a_i
    theta = sq - var / n  # unbiased for ‖E a‖²
    t2 = target_norm**2
    gain = 1 + abar @ target / t2
    # E f̂ = gain·f(Ū) + r with r ⟂ f(Ū), so θ/‖f(Ū)‖² = (1 − gain)² + ‖r‖²/‖f(Ū)‖².
    residual = (theta / t2 - (1 - gain).square()).clamp(min=0).sqrt()
    return {
        "bias": theta.clamp(min=0).sqrt() / target_norm,
        "bias_raw": sq.sqrt() / target_norm,
        "mc_floor": (var / n).clamp(min=0).sqrt() / target_norm,
        "theta_rel": theta / t2,
        # ⟨E f̂, f(Ū)⟩/‖f(Ū)‖²: 1 when unbiased; a bias that only shrinks f(Ū) shows here as gain < 1.
        "gain": gain,
        # The bias a rescaling (a learning rate) cannot undo: ‖r‖/(gain·‖f(Ū)‖), the angle's tangent.
        "direction_error": residual / gain,
        "rmse": (D / (2 * n)).sqrt() / target_norm,
    }


def _jackknife(full: Tensor, loo: Tensor) -> tuple[float, float]:
    """(value on all groups, delete-one-group jackknife standard error)."""
    k = loo.numel()
    se = math.sqrt((k - 1) / k * (loo - loo.mean()).square().sum().item())
    return full.item(), se


def bias_study(snap: Snapshot, pairs: int, groups: int, chunk: int, seed: int, tau_scale: float = 1.0) -> dict:
    """Relative bias and RMSE of each estimator at one frozen state, against f(Ū), with jackknife SEs."""
    Ubar, tau = snap.Ubar, snap.tau * tau_scale
    target = orthogonalize([Ubar], [0.0], ns_dtype=torch.float32, **snap.ns_kwargs).outputs[0].double()
    g_noise, g_probe = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    d = Ubar.numel()
    S = {e: torch.zeros(groups, d, dtype=torch.float64) for e in ESTIMATORS}
    P = {e: torch.zeros(groups, dtype=torch.float64) for e in ESTIMATORS}
    D = {e: torch.zeros(groups, dtype=torch.float64) for e in ESTIMATORS}
    n = torch.zeros(groups, dtype=torch.float64)
    done = 0
    while done < pairs:
        k = min(chunk, pairs - done)
        N = tau * torch.randn((k, *Ubar.shape), generator=g_noise)
        est = estimates(torch.cat([Ubar + N, Ubar - N]), tau, g_probe, snap.ns_kwargs)
        group = torch.arange(done, done + k) * groups // pairs  # contiguous, near-equal groups of pairs
        for e, out in est.items():
            err = out.double() - target
            a = (0.5 * (err[:k] + err[k:])).flatten(1)
            S[e].index_add_(0, group, a)
            P[e].index_add_(0, group, a.square().sum(1))
            D[e].index_add_(0, group, err[:k].flatten(1).square().sum(1) + err[k:].flatten(1).square().sum(1))
        n.index_add_(0, group, torch.ones(k, dtype=torch.float64))
        done += k

    def full_and_loo(x: Tensor) -> Tensor:  # row 0: all groups; row 1 + j: all but group j
        total = x.sum(0, keepdim=True)
        return torch.cat([total, total - x])

    stats = {e: _statistics(full_and_loo(S[e]), full_and_loo(P[e]), full_and_loo(D[e]), full_and_loo(n),
                            target.flatten()) for e in ESTIMATORS}  # fmt: skip
    result: dict[str, Any] = {}
    for e, st in stats.items():
        row = {}
        for key, values in st.items():
            row[key], row[f"{key}_se"] = _jackknife(values[0], values[1:])
        result[e] = row
    reduction = {}
    for e in BC_NAMES:
        delta = stats["plain"]["theta_rel"] - stats[e]["theta_rel"]
        value, se = _jackknife(delta[0], delta[1:])
        reduction[e] = {"dtheta_rel": value, "se": se, "z": value / se if se > 0 else float("nan")}
    noise_norm = tau * math.sqrt(Ubar.numel())
    # r̂ of the actual U; for a scaled τ (a what-if with no U), r̂ at E‖U‖² = ‖Ū‖² + mnτ².
    r_hat = noise_norm / snap.U.norm().item() if tau_scale == 1.0 else noise_norm / math.hypot(Ubar.norm(), noise_norm)
    return {
        "estimators": result,
        "bc_reduction": reduction,
        "tau": tau,
        "tau_scale": tau_scale,
        "r_hat": r_hat,
        "clean_ratio": noise_norm / Ubar.norm().item(),
        "pairs": pairs,
        "groups": groups,
    }


# ---------------------------------------------------------------------------------------------- reporting


def fmt(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.4f}±{row[f'{key}_se']:.4f}"


def markdown(snapshots: list[dict[str, Any]]) -> str:
    """One row per matrix and checkpoint (or τ scale)."""
    head = (
        "| run | step | τ scale | matrix | shape | r̂ | clean ratio | bias plain | bias BC λ=1 | bias BC λ=1/4 "
        "| MC floor | z BC λ=1 | z BC λ=1/4 | gain plain | gain BC λ=1 | dir. error plain | dir. error BC λ=1 "
        "| RMSE plain | RMSE BC λ=1 | RMSE BC λ=1/4 |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in snapshots:
        e, r = s["estimators"], s["bc_reduction"]
        lines.append(
            f"| {s['run']} | {s['step']} | {s['tau_scale']:g} | {s['kind']}{s['layer']} "
            f"| {s['shape'][0]}x{s['shape'][1]} "
            f"| {s['r_hat']:.3f} | {s['clean_ratio']:.3g} | {fmt(e['plain'], 'bias')} | {fmt(e['bc'], 'bias')} "
            f"| {fmt(e['bc_lam1/4'], 'bias')} | {e['plain']['mc_floor']:.3f} | {r['bc']['z']:+.1f} "
            f"| {r['bc_lam1/4']['z']:+.1f} | {fmt(e['plain'], 'gain')} | {fmt(e['bc'], 'gain')} "
            f"| {fmt(e['plain'], 'direction_error')} | {fmt(e['bc'], 'direction_error')} "
            f"| {fmt(e['plain'], 'rmse')} | {fmt(e['bc'], 'rmse')} | {fmt(e['bc_lam1/4'], 'rmse')} |"
        )
    return "\n".join(lines)


def summary(snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run, checkpoint and τ scale: median r̂, mean bias/gain/RMSE over the matrices, the pooled paired z."""
    keys = sorted({(s["run"], s["step"], s["tau_scale"]) for s in snapshots}, key=lambda k: (k[0], -k[2], k[1]))
    rows = []
    for run, step, scale in keys:
        here = [s for s in snapshots if (s["run"], s["step"], s["tau_scale"]) == (run, step, scale)]
        row: dict[str, Any] = {"run": run, "step": step, "tau_scale": scale, "matrices": len(here)}
        row["r_hat_median"] = median([s["r_hat"] for s in here])
        row["clean_ratio_median"] = median([s["clean_ratio"] for s in here])
        for e in ESTIMATORS:
            for key in ("bias", "gain", "direction_error", "rmse"):
                vals = [s["estimators"][e][key] for s in here]
                ses = [s["estimators"][e][f"{key}_se"] for s in here]
                row[f"{key}_{e}"] = sum(vals) / len(vals)
                row[f"{key}_{e}_se"] = math.sqrt(sum(x * x for x in ses)) / len(ses)
        for e in BC_NAMES:
            d = [s["bc_reduction"][e] for s in here]
            se = math.sqrt(sum(x["se"] ** 2 for x in d))
            row[f"z_{e}_pooled"] = sum(x["dtheta_rel"] for x in d) / se if se > 0 else float("nan")
            row[f"z_{e}_min"] = min(x["z"] for x in d)
            row[f"z_{e}_max"] = max(x["z"] for x in d)
        rows.append(row)
    return rows


def median(values: Sequence[float]) -> float:
    return torch.tensor(list(values), dtype=torch.float64).median().item()


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | step | τ scale | r̂ (median) | clean ratio (median) | bias plain | bias BC λ=1 | bias BC λ=1/4 "
        "| pooled z BC λ=1 [min, max] | pooled z BC λ=1/4 [min, max] | gain plain | gain BC λ=1 "
        "| dir. error plain | dir. error BC λ=1 "
        "| RMSE plain | RMSE BC λ=1 | RMSE BC λ=1/4 |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["run"], str(r["step"]), f"{r['tau_scale']:g}", f"{r['r_hat_median']:.3f}"]
        cells.append(f"{r['clean_ratio_median']:.3g}")
        cells += [f"{r[f'bias_{e}']:.4f}±{r[f'bias_{e}_se']:.4f}" for e in ESTIMATORS]
        cells += [f"{r[f'z_{e}_pooled']:+.1f} [{r[f'z_{e}_min']:+.1f}, {r[f'z_{e}_max']:+.1f}]" for e in BC_NAMES]
        cells += [f"{r[f'gain_{e}']:.4f}±{r[f'gain_{e}_se']:.4f}" for e in ("plain", "bc")]
        cells += [f"{r[f'direction_error_{e}']:.3f}±{r[f'direction_error_{e}_se']:.3f}" for e in ("plain", "bc")]
        cells += [f"{r[f'rmse_{e}']:.3f}±{r[f'rmse_{e}_se']:.4f}" for e in ESTIMATORS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Relative bias, gain and RMSE against r̂, plain vs BC, with jackknife error bars; one row per Muon form.

    Filled markers: the states met in training (τ as in the run, r̂ of the actual U). Hollow: the
    same Ū with τ scaled down (a what-if; r̂ at E‖U‖²).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = {"plain": "tab:blue", "bc": "tab:red", "bc_lam1/4": "tab:green"}
    labels = {"plain": "plain NS", "bc": "BC λ=1 (ρ=τ)", "bc_lam1/4": "BC λ=1/4 (ρ=2τ)"}
    forms = sorted({s["run"].split("_B")[0] for s in rows}, key=lambda f: f != "muon")
    runs = sorted({s["run"] for s in rows})
    markers = dict(zip(runs, "osD^v<>"))
    titles = {
        "muon": "DP-Muon default: quintic NS, Nesterov, Frobenius",
        "paper": "paper form: heavy-ball, max1, taylor2",
    }
    fig, axes = plt.subplots(len(forms), 4, figsize=(20, 4.3 * len(forms)), squeeze=False)
    panels = (("bias", "relative bias (MC floor subtracted)"), ("gain", "gain ⟨E f̂, f(Ū)⟩/‖f(Ū)‖²"),
              ("direction_error", "direction error ‖r‖/(gain·‖f(Ū)‖), E f̂ = gain·f(Ū) + r, r ⊥ f(Ū)"),
              ("rmse", "relative RMSE of one draw"))  # fmt: skip
    for row_axes, form in zip(axes, forms):
        for ax, (key, label) in zip(row_axes, panels):
            for e, color in colors.items():
                for run in (r for r in runs if r.split("_B")[0] == form):
                    for real in (True, False):
                        here = [s for s in rows if s["run"] == run and (s["tau_scale"] == 1.0) == real]
                        if here:
                            ax.errorbar(
                                [s["r_hat"] for s in here], [s["estimators"][e][key] for s in here],
                                yerr=[s["estimators"][e][f"{key}_se"] for s in here], fmt=markers[run], color=color,
                                mfc=color if real else "none", ms=4.5, alpha=0.75, capsize=1.5, lw=0.7,
                            )  # fmt: skip
            ax.set_xscale("log")
            if key in ("rmse", "direction_error"):
                ax.set_yscale("log")
            ax.set_xlabel("r̂ = τ√(mn)/‖U‖_F (what the guard sees)", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"{titles.get(form, form)}: {key.replace('_', ' ')}", fontsize=9)
            ax.axvline(0.5, color="gray", ls="--", lw=0.8)
            ax.grid(alpha=0.3, which="both")
    handles = [Line2D([], [], color=c, marker="o", ls="", label=labels[e]) for e, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=markers[r], ls="", label=f"run {r}") for r in runs]
    handles += [Line2D([], [], color="k", marker="o", ls="", label="in training"),
                Line2D([], [], color="k", marker="o", ls="", mfc="none", label="τ scaled down (what-if)"),
                Line2D([], [], color="gray", ls="--", label="guard r_max = 0.5")]  # fmt: skip
    axes[0][3].legend(handles=handles, fontsize=7, loc="best")
    fig.suptitle(
        "DP-MuonBC in training: digits ViT, ε = 8 (PUBLIC data: the noise-free means are recorded)", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def plan(args: argparse.Namespace) -> tuple[list[Run], str | None]:
    """The runs to train, and why the paper form is skipped (``None`` if it is run)."""
    runs = [Run("muon", args.batch, args.steps, tuple(args.checkpoints))]
    if args.large_batch:
        runs.append(Run("muon", args.large_batch, args.large_steps, tuple(args.large_checkpoints)))
    skipped = None
    if "paper" in args.forms:
        if paper_form() is None:
            skipped = "the installed DPMuon has no PAPER_FORM (the API had not landed): paper form not run"
        else:
            runs += [Run("paper", r.batch, r.steps, r.checkpoints) for r in list(runs)]
    return runs, skipped


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--batch", type=int, default=256, help="expected batch of the main run")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[10, 50, 100, 200])
    parser.add_argument("--large-batch", type=int, default=1024, help="0: no large-batch run")
    parser.add_argument("--large-steps", type=int, default=50)
    parser.add_argument("--large-checkpoints", type=int, nargs="+", default=[5, 10, 25, 50])
    parser.add_argument("--forms", nargs="+", default=["muon", "paper"], choices=["muon", "paper"])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 1], help="ViT layers whose matrices are studied")
    parser.add_argument("--pairs", type=int, default=256, help="antithetic noise pairs per matrix and checkpoint")
    parser.add_argument("--groups", type=int, default=16, help="jackknife groups")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--tau-scales", type=float, nargs="*", default=[0.1, 0.01],
                        help="also study τ x these scales on the last checkpoint's Ū (what-if less noise)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few steps and draws, one layer (< 1 min)")
    parser.add_argument("--out", default=str(default_result("muon_bias_in_training_cpu.json")))
    parser.add_argument("--figure", default=None, help="write the figure here (png)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.checkpoints, args.large_batch, args.forms = 6, [2, 6], 0, ["muon"]
        args.layers, args.pairs, args.groups, args.chunk, args.tau_scales = [0], 32, 4, 32, []
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    print(PUBLIC_ONLY, flush=True)
    start = time.time()
    runs, skipped = plan(args)
    result: dict[str, Any] = {
        "benchmark": "muon_bias_in_training",
        "public_data_only": PUBLIC_ONLY,
        **provenance(1, None if argv is None else [__file__, *argv]),
        "args": vars(args),
        "paper_form": paper_form(),
        "paper_form_skipped": skipped,
        "estimators": {
            e: ("plain NS" if s is None else f"DP-MuonBC probe_scale {s} (lambda {1 / s**2:g})")
            for e, s in ESTIMATORS.items()
        },  # fmt: skip
        "runs": [],
        "snapshots": [],
        "tau_scaled": [],
    }
    if skipped:
        print(skipped, flush=True)
    frozen: list[Snapshot] = []
    for run in runs:
        record, snaps = train(run, args.epsilon, args.seed, set(args.layers))
        result["runs"].append(record)
        frozen += snaps
        rc = record["replay_check"]
        print(
            f"{run.name}: {record['steps']} steps, σ {record['noise_multiplier']:.3f}, ε {record['epsilon']:.2f}, "
            f"test acc {record['test_acc']:.3f}, {record['fit_seconds']:.0f} s; replay: max |std(U − Ū)/τ − 1| "
            f"{rc['max_abs_dev_std_over_tau']:.4f}, τ vs optimizer's {rc['max_tau_optimizer_rel_err']:.1e}",
            flush=True,
        )
    jobs = [(s, 1.0) for s in frozen]
    for run in runs:
        last = [s for s in frozen if s.run == run.name and s.step == max(run.checkpoints)]
        jobs += [(s, c) for c in args.tau_scales for s in last]
    for i, (snap, scale) in enumerate(tqdm(jobs, desc="bias study")):
        row = bias_study(snap, args.pairs, args.groups, args.chunk, args.seed + 1000 * i, scale)
        kind, layer = matrix_kind(snap.name), layer_of(snap.name)
        row.update({"run": snap.run, "step": snap.step, "matrix": snap.name, "kind": kind, "layer": layer,
                    "shape": list(snap.Ubar.shape), "r_hat_optimizer": snap.r_hat_optimizer})  # fmt: skip
        (result["snapshots"] if scale == 1.0 else result["tau_scaled"]).append(row)
    result["summary"] = summary(result["snapshots"] + result["tau_scaled"])
    result["seconds"] = round(time.time() - start, 1)
    table = summary_markdown(result["summary"])
    full = markdown(result["snapshots"] + result["tau_scaled"])
    result["markdown"] = {"summary": table, "per_matrix": full}
    print("\nPer run, checkpoint and τ scale (mean over matrices ± jackknife SE; z: paired (θ_plain − θ_BC)/SE):")
    print(table)
    print("\nPer matrix:")
    print(full)
    print(f"\n{result['seconds']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.figure:
        figure(result["snapshots"] + result["tau_scaled"], Path(args.figure))
    return result


if __name__ == "__main__":
    main()
