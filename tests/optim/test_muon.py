"""DPMuon / DP-MuonBC: the reference Muon update, per-matrix clipping, the noise of the release, BC's bias."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from dplightning.optim import DPMuon
from dplightning.optim.bias_correction import (
    MOMENTUM_FORMS,
    closed_form_input_variance,
    momentum_noise_variance,
    orthogonalize,
)
from dplightning.optim.muon import PAPER_FORM
from dplightning.optim.newton_schulz import newton_schulz
from dplightning.privacy.clipping import split_max_grad_norm
from dplightning.protocols import DPRelease
from tests.helpers import TinyModule, dp, make_dataset, make_trainer, params_of
from tests.reference import clipped_sum, per_example_grads

# ---------------------------------------------------------------- a reference Muon, from dp_muon.md §1


def reference_ns5(G: Tensor, steps: int = 5) -> Tensor:
    """NS5 of the spec's pseudocode, in fp64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class ReferenceMuon:
    """Muon (EMA momentum, Nesterov, shape scale, decoupled weight decay) on the matrices, in fp64."""

    def __init__(self, lr: float, beta: float = 0.95, wd: float = 0.0) -> None:
        self.lr, self.beta, self.wd = lr, beta, wd
        self.momentum: dict[str, Tensor] = {}

    def step(self, name: str, W: Tensor, g: Tensor) -> Tensor:
        g, beta = g.double(), self.beta
        M = self.momentum[name] = beta * self.momentum.get(name, torch.zeros_like(g)) + (1 - beta) * g
        U = (1 - beta) * g + beta * M
        O = reference_ns5(U.reshape(U.shape[0], -1)) * math.sqrt(max(1.0, U.shape[0] / U.shape[1]))  # noqa: E741
        return W.double() * (1 - self.lr * self.wd) - self.lr * O.view_as(W)


def reference_muon(W: Tensor, grads: list[Tensor], lr: float, beta: float, wd: float) -> Tensor:
    muon, W = ReferenceMuon(lr, beta, wd), W.double()
    for g in grads:
        W = muon.step("w", W, g)
    return W


def net(hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def test_without_dp_the_update_is_the_reference_muon_and_adamw() -> None:
    torch.manual_seed(0)
    model = net(16)
    before = params_of(model)
    opt = DPMuon(model.parameters(), lr=0.05, weight_decay=0.1, adam_lr=0.01, adam_betas=(0.9, 0.95), adam_eps=1e-8)
    grads = {n: [torch.randn_like(p) for _ in range(3)] for n, p in model.named_parameters()}
    for k in range(3):
        for n, p in model.named_parameters():
            p.grad = grads[n][k].clone()
        opt.step()
    # AdamW reference for the vectors: torch's own.
    biases = {n: nn.Parameter(before[n].clone()) for n in before if before[n].dim() == 1}
    adam = torch.optim.AdamW(biases.values(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for k in range(3):
        for n, b in biases.items():
            b.grad = grads[n][k].clone()
        adam.step()
    for n, p in model.named_parameters():
        if p.dim() == 2:
            expected = reference_muon(before[n], grads[n], lr=0.05, beta=0.95, wd=0.1)
            torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)
        else:
            torch.testing.assert_close(p.detach(), biases[n].detach(), rtol=1e-6, atol=1e-7)


N = 12


class _Keeps(DPMuon):
    def dp_release(self, release: DPRelease) -> None:
        super().dp_release(release)
        self.kept = getattr(self, "kept", []) + [
            ({p: s.clone() for p, s in release.slots.items()}, release.noise_std, release.groups)
        ]


def test_with_sigma_0_and_no_clipping_the_strategy_gives_the_reference_muon_update() -> None:
    torch.manual_seed(1)
    module = TinyModule(net(), optimizer=lambda ps: DPMuon(ps, lr=0.05, adam_lr=0.01))
    before = params_of(module)
    data = DataLoader(make_dataset(N), batch_size=N)  # q = 1: the released mean is the full gradient
    make_trainer(dp(noise_multiplier=0.0, max_grad_norm=1e6, poisson_sampling=False), max_steps=2).fit(module, data)
    # Reference: the same batches through plain autograd, Muon on the matrices and torch's AdamW on the biases.
    ref = net().double()
    ref.load_state_dict({k.removeprefix("net."): v.double() for k, v in before.items()})
    muon = ReferenceMuon(lr=0.05)
    vectors = [p for p in ref.parameters() if p.dim() == 1]
    adam = torch.optim.AdamW(vectors, lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    for x, y in module.batches:
        ref.zero_grad()
        F.cross_entropy(ref(x.double()), y).backward()
        adam.step()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if p.dim() == 2:
                    p.copy_(muon.step(n, p, p.grad))
    assert len(module.batches) == 2
    for (n, p), (_, q) in zip(module.net.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach(), rtol=0, atol=1e-5, msg=n)


def test_each_matrix_is_clipped_to_its_own_bound() -> None:
    c = 0.05  # small enough that every block of every example is clipped
    torch.manual_seed(2)
    module = TinyModule(net(), optimizer=lambda ps: _Keeps(ps))
    before = params_of(module)
    data = DataLoader(make_dataset(N), batch_size=N)
    make_trainer(dp(noise_multiplier=0.0, max_grad_norm=c, poisson_sampling=False)).fit(module, data)
    slots, noise_std, groups = module.trainer.optimizers[0].kept[0]
    names = {p: n.removeprefix("net.") for n, p in module.named_parameters()}
    blocks = [[names[p] for p in g.params] for g in groups]
    matrices = [n for n in names.values() if n.endswith("weight")]
    assert blocks == [[n] for n in matrices] + [[n for n in names.values() if n.endswith("bias")]]
    assert [g.max_norm for g in groups] == pytest.approx([c / 2] * 4)  # 3 matrices + the rest: Δ = C
    ref = net()
    ref.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = module.batches[0]
    grads = per_example_grads(ref, F.cross_entropy, x, y)
    for b in blocks:  # the reference blocks really are over their bound before clipping
        assert (torch.stack([grads[n].flatten(1).square().sum(1) for n in b]).sum(0).sqrt() > c / 2).all()
    expected = clipped_sum(grads, c, blocks)
    for p, n in names.items():
        torch.testing.assert_close(slots[p], expected[n] / N, rtol=1e-5, atol=1e-7)


def test_the_release_noise_has_the_joint_sensitivity_std_in_every_block_and_one_ledger_entry_per_step() -> None:
    sigma, c, n, batch, steps = 1.3, 0.5, 32, 16, 4
    module = TinyModule(
        nn.Sequential(nn.Linear(6, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 3)),
        zero_loss=True,  # every per-example gradient is 0: the release is the noise alone
        optimizer=lambda ps: _Keeps(ps, lr=1e-3),
    )
    data = DataLoader(make_dataset(n), batch_size=batch)  # Poisson sampling with q = batch / n
    strategy = dp(noise_multiplier=sigma, max_grad_norm=c, seed=3, accountant="rdp")
    make_trainer(strategy, max_steps=steps).fit(module, data)
    kept = module.trainer.optimizers[0].kept
    expected_std = sigma * c / batch  # σ·√(Σ C_b²)/(qN) with Δ = C and qN = batch
    assert len(kept) == steps and all(std == pytest.approx(expected_std) for _, std, _ in kept)
    for p in module.parameters():
        z = torch.stack([slots[p] for slots, _, _ in kept]).flatten()
        # Sample std of z.numel() Gaussian draws: relative standard error 1/√(2·numel); 5 of them allowed.
        tolerance = 5 / math.sqrt(2 * z.numel())
        assert abs(z.std().item() / expected_std - 1) < tolerance, (tuple(p.shape), z.std().item(), expected_std)
    assert strategy.ledger.steps == steps and strategy.ledger.history == ((sigma, batch / n, steps),)


# ---------------------------------------------------------------- DP-MuonBC


def synthetic(m: int, n: int, seed: int) -> Tensor:
    """Ū = U diag(s) Vᵀ, s log-spaced in [1, 31.6] (dp_muon.md §3.7)."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g))
    return (U * torch.logspace(0, 1.5, m)) @ V.T


@pytest.mark.parametrize(("ratio", "at_most"), [(0.02, 0.5), (0.05, 0.5), (0.1, 0.85)])
def test_bias_correction_reduces_the_bias_of_ns_under_noise(ratio: float, at_most: float) -> None:
    # ‖N‖_F/‖Ū‖_F = ratio; the spec's table expects BC to cut the bias 3-5x at 0.02-0.05, less at 0.1.
    m, n, draws = 32, 64, 256
    Ubar = synthetic(m, n, 0)
    target = newton_schulz(Ubar, dtype=torch.float32)
    tau = ratio * torch.linalg.matrix_norm(Ubar).item() / math.sqrt(m * n)
    noise = tau * torch.randn(draws, m, n, generator=torch.Generator().manual_seed(1))
    inputs = list(torch.cat([Ubar + noise, Ubar - noise]))  # antithetic DP noise: no first-order MC error
    plain = orthogonalize(inputs, [tau] * len(inputs)).outputs
    bc = orthogonalize(inputs, [tau] * len(inputs), True, torch.Generator().manual_seed(2), max_noise_ratio=None)
    assert all(bc.corrected)

    def bias(outs: list[Tensor]) -> float:
        return ((torch.stack(outs).mean(0) - target).norm() / target.norm()).item()

    assert bias(bc.outputs) < at_most * bias(plain)


def test_zero_noise_and_the_guard_give_plain_ns() -> None:
    U = [synthetic(16, 32, 4), synthetic(16, 32, 5)]
    gen = torch.Generator().manual_seed(0)
    plain = orthogonalize(U, [0.0, 0.0]).outputs
    zero = orthogonalize(U, [0.0, 0.0], True, gen)
    assert zero.corrected == [False, False]
    for a, b in zip(plain, zero.outputs):
        assert torch.equal(a, b)  # τ = 0 takes the explicit plain branch (λ = τ²/ρ² would be 0/0)
    tau_big = torch.linalg.matrix_norm(U[0]).item() / math.sqrt(U[0].numel())  # r̂ = 1 > 0.5
    guarded = orthogonalize(U, [tau_big, 1e-3], True, gen, max_noise_ratio=0.5)
    assert guarded.corrected == [False, True] and guarded.noise_ratios[0] == pytest.approx(1.0)
    torch.testing.assert_close(guarded.outputs[0], orthogonalize(U, [tau_big, 1e-3]).outputs[0], rtol=0, atol=0)


@pytest.mark.parametrize("form", sorted(MOMENTUM_FORMS))
def test_the_momentum_noise_recursion_matches_the_closed_forms(form: str) -> None:
    beta, s, buffer = 0.95, 0.3, 0.0
    for t in range(1, 1001):
        buffer, tau2 = momentum_noise_variance(form, beta, buffer, s * s)  # type: ignore[arg-type]
        if t in (1, 2, 10, 100, 1000):
            assert tau2 == pytest.approx(closed_form_input_variance(form, beta, s, t), rel=1e-12)  # type: ignore[arg-type]


def test_heavyball_and_ema_give_the_same_update_under_frobenius_normalization() -> None:
    torch.manual_seed(5)
    grads = [torch.randn(8, 16) for _ in range(4)]
    outs = []
    for form in ("heavyball", "ema"):
        W = nn.Parameter(torch.zeros(8, 16))
        opt = DPMuon([W], lr=0.1, momentum_form=form)
        for g in grads:
            W.grad = g.clone()
            opt.step()
        outs.append(W.detach().clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def _release(params: list[nn.Parameter], grads: list[Tensor], std: float, step: int) -> DPRelease:
    return DPRelease(dict(zip(params, grads)), std, [], step)


def test_dp_muonbc_takes_tau_from_the_release_and_resumes_its_probes_exactly() -> None:
    torch.manual_seed(6)
    W = [nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16, 8))]
    grads = [[torch.randn(8, 16) * 10, torch.randn(16, 8) * 10] for _ in range(4)]

    def run(opt: DPMuon, params: list[nn.Parameter], steps: range) -> None:
        for k in steps:
            opt.dp_release(_release(params, grads[k], std=0.5, step=k))
            opt.step()

    opt = DPMuon(W, bias_correction=True, seed=7)
    opt.dp_plan([("a", W[0]), ("b", W[1])], 1.0)
    run(opt, W, range(2))
    saved, weights = copy.deepcopy(opt.state_dict()), [w.detach().clone() for w in W]  # as a checkpoint would
    run(opt, W, range(2, 4))
    # τ of the Nesterov input after 2 steps with s = 0.5: r̂ = τ·√(mn)/‖U‖_F, logged per matrix.
    ratio, corrected = opt.last_noise_ratios["a"]
    assert corrected and 0 < ratio < 0.5 and opt.corrected_fraction == (8, 8)
    W2 = [nn.Parameter(w.clone()) for w in weights]
    opt2 = DPMuon(W2, bias_correction=True, seed=7)
    opt2.dp_plan([("a", W2[0]), ("b", W2[1])], 1.0)
    opt2.load_state_dict(saved)
    run(opt2, W2, range(2, 4))
    for a, b in zip(W, W2):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="no release"):
        opt2.step()


def test_the_plan_splits_matrices_from_embeddings_heads_and_vectors() -> None:
    emb, hidden, head, bias = (nn.Parameter(torch.zeros(s)) for s in [(10, 4), (4, 4), (3, 4), (4,)])
    opt = DPMuon([emb, hidden, head, bias], clip_split="numel")
    named = [("wte.weight", emb), ("h.0.mlp.weight", hidden), ("lm_head.weight", head), ("h.0.mlp.bias", bias)]
    plan = opt.dp_plan(named, 2.0)
    assert [g.name for g in plan.groups] == ["h.0.mlp.weight", "non-matrix"]
    assert math.sqrt(sum(g.max_norm**2 for g in plan.groups)) == pytest.approx(2.0)  # Δ = C
    assert plan.groups[0].max_norm == pytest.approx(2.0 * math.sqrt(16 / (16 + 40 + 12 + 4)))  # ∝ √numel
    with pytest.raises(ValueError, match="momentum_form"):
        DPMuon([hidden], momentum_form="adam")  # type: ignore[arg-type]


SIZES = [[(4, 4)], [(4, 4), (3, 5), (6,)], [(8, 2)] * 3, [(8, 2), (4, 4), (2, 8), (3,), (5,)]]


@pytest.mark.parametrize("clip_split", ["equal", "numel"])
@pytest.mark.parametrize("sizes", SIZES)
def test_the_plans_bounds_are_the_one_split_of_c(clip_split: str, sizes: list[tuple[int, ...]]) -> None:
    named = [(f"h.{i}.weight", nn.Parameter(torch.zeros(s))) for i, s in enumerate(sizes)]
    groups = DPMuon([p for _, p in named], clip_split=clip_split).dp_plan(named, 0.9).groups  # type: ignore[arg-type]
    sized = [float(sum(p.numel() for p in g.params)) for g in groups]
    weights = [1.0] * len(groups) if clip_split == "equal" else sized
    assert [g.max_norm for g in groups] == split_max_grad_norm(0.9, weights)  # bit for bit


# ---------------------------------------------------------------- the paper's form and the control arms


def reference_paper_step(M: Tensor, W: Tensor, g: Tensor, lr: float, beta: float, kappa: int, q: int) -> Tensor:
    """One step of the spec's §2.2 in fp64: heavy-ball m, Y₀ = T(m)/max(1, ‖T(m)‖_F), q steps of p_κ(YYᵀ)Y."""
    M.mul_(beta).add_(g.double())
    tall = M.shape[0] > M.shape[1]
    Y = M.T if tall else M
    Y = Y / max(1.0, Y.norm().item())
    eye = torch.eye(Y.shape[0], dtype=torch.float64)
    for _ in range(q):
        R = eye - Y @ Y.T  # p_κ(λ) = Σ_s (2s)!/(4^s (s!)²)·(1 − λ)^s, written from the series itself
        P = sum(math.factorial(2 * s) / (4**s * math.factorial(s) ** 2) * torch.linalg.matrix_power(R, s)
                for s in range(kappa + 1))  # fmt: skip
        Y = P @ Y
    O = Y.T if tall else Y  # noqa: E741
    return W.double() - lr * O * math.sqrt(max(1.0, W.shape[0] / W.shape[1]))


@pytest.mark.parametrize("shape", [(8, 8), (6, 12), (12, 6)])
def test_the_paper_form_is_the_specs_heavyball_max1_taylor_iteration(shape: tuple[int, int]) -> None:
    torch.manual_seed(11)
    W = nn.Parameter(torch.randn(*shape))
    W_ref, M_ref = W.detach().double().clone(), torch.zeros(*shape, dtype=torch.float64)
    opt = DPMuon([W], lr=0.1, momentum=0.9, **PAPER_FORM)
    for k in range(4):
        g = torch.randn(*shape) * (0.05 if k < 2 else 2.0)  # below and above the max(1, ·) threshold
        W.grad = g.clone()
        opt.step()
        W_ref = reference_paper_step(M_ref, W_ref, g, lr=0.1, beta=0.9, kappa=2, q=PAPER_FORM["ns_steps"])
        torch.testing.assert_close(W.detach().double(), W_ref, rtol=0, atol=2e-6)


def test_flat_clip_split_is_one_group_at_the_full_bound_and_keeps_muons_update() -> None:
    emb, hidden, bias = (nn.Parameter(torch.zeros(s)) for s in [(10, 4), (4, 4), (4,)])
    named = [("wte.weight", emb), ("h.0.mlp.weight", hidden), ("h.0.mlp.bias", bias)]
    plan = DPMuon([emb, hidden, bias], clip_split="flat").dp_plan(named, 2.0)
    assert [(g.name, g.params, g.max_norm) for g in plan.groups] == [("all", (emb, hidden, bias), 2.0)]
    # Only the plan changes: from the same release both splits make the same update.
    outs = []
    for split in ("equal", "flat"):
        torch.manual_seed(12)
        W = [nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16))]
        opt = DPMuon(W, clip_split=split)
        opt.dp_plan([("a.weight", W[0]), ("a.bias", W[1])], 1.0)
        for k in range(3):
            opt.dp_release(_release(W, [torch.randn(8, 16), torch.randn(16)], std=0.1, step=k))
            opt.step()
        outs.append([w.detach().clone() for w in W])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_matrix_update_adamw_is_torchs_adamw_on_every_parameter_under_muons_plan() -> None:
    torch.manual_seed(13)
    model, ref = net(16), net(16)
    ref.load_state_dict(model.state_dict())
    named = list(model.named_parameters())
    opt = DPMuon(model.parameters(), matrix_update="adamw", adam_lr=0.01, adam_betas=(0.9, 0.999), adam_eps=1e-6)
    assert opt.dp_plan(named, 1.0).groups == DPMuon(model.parameters()).dp_plan(named, 1.0).groups  # Muon's plan
    adam = torch.optim.AdamW(ref.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    for k in range(3):
        grads = [torch.randn_like(p) for p in model.parameters()]
        opt.dp_release(_release([p for _, p in named], grads, std=0.1, step=k))
        opt.step()
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        adam.step()
    for (n, p), q in zip(named, ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    assert opt.dp_metrics() == {}  # no Muon matrix, no r̂
    with pytest.raises(ValueError, match="matrix_update"):
        DPMuon(model.parameters(), matrix_update="sgd")  # type: ignore[arg-type]


def test_a_conv1d_weight_gets_the_shape_scale_of_its_layer_not_of_its_storage() -> None:
    transformers = pytest.importorskip("transformers")
    conv1d = transformers.pytorch_utils.Conv1D(64, 16)  # y = x @ W + b, W stored [in 16, out 64]
    linear = nn.Linear(16, 64, bias=False)  # the same layer stored [out, in]: scale √(64/16) = 2
    with torch.no_grad():
        linear.weight.copy_(conv1d.weight.T)
    g = torch.randn(64, 16, generator=torch.Generator().manual_seed(14))
    updates = []
    for layer, grad in ((linear, g), (conv1d, g.T)):
        opt = DPMuon([layer.weight], lr=0.1)
        opt.dp_bind_module(layer)
        before = layer.weight.detach().clone()
        layer.weight.grad = grad.clone()
        opt.step()
        updates.append(layer.weight.detach() - before)
    torch.testing.assert_close(updates[1], updates[0].T, rtol=1e-5, atol=1e-7)
    # The update's spectral scale is lr·2 up to NS's band (the stored layout would give lr·1).
    assert torch.linalg.matrix_norm(updates[1], ord=2).item() == pytest.approx(0.1 * 2, rel=0.2)


def test_dp_metrics_report_noise_ratio_quartiles_and_guard_and_bc_fractions() -> None:
    torch.manual_seed(15)
    W = [nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8, 8))]
    opt = DPMuon(W, bias_correction=True, max_noise_ratio=0.5)
    opt.dp_plan([("a", W[0]), ("b", W[1]), ("c", W[2])], 1.0)
    scales = (10.0, 10.0, 0.01)  # two matrices well above the noise, one buried in it
    for k in range(2):
        opt.dp_release(_release(W, [s * torch.randn_like(w) for s, w in zip(scales, W)], std=0.5, step=k))
        opt.step()
    metrics = opt.dp_metrics()
    ratios = sorted(r for r, _ in opt.last_noise_ratios.values())
    q = torch.tensor(ratios, dtype=torch.float64).quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    assert [metrics[f"muon/noise_ratio_p{p}"] for p in (25, 50, 75)] == pytest.approx(q.tolist())
    assert ratios[0] < 0.5 < ratios[-1]
    assert metrics["muon/guard_open_fraction"] == pytest.approx(4 / 6)  # two of three matrices, both steps
    assert metrics["muon/bc_fraction"] == pytest.approx(4 / 6)
    assert "muon/bc_fraction" not in DPMuon(W).dp_metrics()


def test_the_strategy_logs_the_muon_diagnostics_every_step() -> None:
    module = TinyModule(net(), optimizer=lambda ps: DPMuon(ps, lr=0.01))
    data = DataLoader(make_dataset(N), batch_size=4)
    make_trainer(dp(noise_multiplier=1.0, max_grad_norm=1.0, seed=0), max_steps=2).fit(module, data)
    logged = module.trainer.callback_metrics
    assert {"muon/noise_ratio_p25", "muon/noise_ratio_p50", "muon/noise_ratio_p75"} <= set(logged)
    assert logged["muon/noise_ratio_p50"].item() == pytest.approx(
        float(torch.tensor([r for r, _ in module.trainer.optimizers[0].last_noise_ratios.values()]).median()), rel=0.5
    )
