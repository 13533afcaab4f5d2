"""The validation experiments of dp_muon.md §4 for DP-MuonBC's bias correction (V1-V3).

V1: the τ² of the NS input for the three momentum forms, against a simulation of pure-noise
chains. V2: the static bias table of §3.7 (64x128, singular values log-spaced in [1, 31.6],
NS5 in fp32, then the NS calls in bf16). V3: the asymptotic order of the bias (singular values
in [10, 31.6], NS in fp64, antithetic DP noise), as slopes of log-bias against log-τ.

    OMP_NUM_THREADS=1 python benchmarks/muon_bias_validation.py \\
        --out benchmarks/results/muon_bias_validation.json

Single-threaded. Each estimator here shares one f(U) between the probe scales (cheaper than the
optimizer's path); a check at the start confirms it equals ``orthogonalize``'s output.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
from _harness import provenance
from torch import Tensor
from tqdm import tqdm

from dplightning.optim.bias_correction import MOMENTUM_FORMS, closed_form_input_variance, orthogonalize
from dplightning.optim.newton_schulz import newton_schulz

# dp_muon.md §3.7: ratio -> (plain, BC rho=tau, BC rho=tau/2, BC rho=2tau, plain RMSE, BC(rho=tau) RMSE).
SPEC_V2 = {
    0.02: (0.0054, 0.0012, 0.0012, 0.0014, 0.0739, 0.0745),
    0.05: (0.0307, 0.0082, 0.0060, 0.0143, 0.1815, 0.1899),
    0.10: (0.0973, 0.0530, 0.0417, 0.0709, 0.3401, 0.3800),
    0.20: (0.2183, 0.1511, 0.1377, 0.1772, 0.5695, 0.6714),
    0.50: (0.4586, 0.3706, 0.3434, 0.4138, 0.8915, 1.1181),
    1.00: (0.6415, 0.5825, 0.5592, 0.6116, 1.0559, 1.3135),
    2.00: (0.7644, 0.7189, 0.7029, 0.7409, 1.1897, 1.4637),
}
SPEC_V2_BF16 = {0.02: (0.0094, 0.0098), 0.05: (0.0305, 0.0119)}  # (plain, BC rho=tau) with the NS calls in bf16
PROBE_SCALES = {"tau": 1.0, "tau/2": 0.5, "2tau": 2.0}


def synthetic(m: int, n: int, lo: float, hi: float, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """U diag(s) Vᵀ with random orthonormal factors (QR of Gaussians) and s log-spaced in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    s = torch.logspace(math.log10(lo), math.log10(hi), m, dtype=torch.float64)
    return ((U * s) @ V.T).to(dtype)


def v1(chains: int, beta: float, seed: int) -> dict:
    """Empirical Var(U_t) of pure-noise chains against the closed forms, t in {1, 2, 10, 100, 1000}."""
    g = torch.Generator().manual_seed(seed)
    s, checkpoints, out = 1.0, (1, 2, 10, 100, 1000), {}
    for form in sorted(MOMENTUM_FORMS):
        M = torch.zeros(chains, dtype=torch.float64)
        rows = []
        for t in range(1, max(checkpoints) + 1):
            ghat = s * torch.randn(chains, generator=g, dtype=torch.float64)
            if form == "heavyball":
                M = beta * M + ghat
                U = M
            else:
                M = beta * M + (1 - beta) * ghat
                U = (1 - beta) * ghat + beta * M if form == "nesterov" else M
            if t in checkpoints:
                predicted = closed_form_input_variance(form, beta, s, t)  # type: ignore[arg-type]
                empirical = U.var().item()
                rel = empirical / predicted - 1
                rows.append({"t": t, "predicted": predicted, "empirical": empirical, "rel_err": rel})
        out[form] = rows
    return out


Estimator = Callable[[Tensor, float, torch.Generator], dict[str, Tensor]]


def estimators(dtype: torch.dtype, scales: dict[str, float]) -> Estimator:
    """Plain f(U) and BC for each probe scale, on a batch of inputs U [k, m, n], one f(U) shared."""

    def run(U: Tensor, tau: float, gen: torch.Generator) -> dict[str, Tensor]:
        k = U.shape[0]
        Z = torch.randn((len(scales), *U.shape), generator=gen, dtype=U.dtype)
        rhos = torch.tensor([c * tau for c in scales.values()], dtype=U.dtype).view(-1, 1, 1, 1)
        stacked = torch.cat([U, (U + rhos * Z).flatten(0, 1), (U - rhos * Z).flatten(0, 1)])
        f = newton_schulz(stacked, dtype=dtype).to(U.dtype)
        plain, plus, minus = f[:k], f[k : k + len(scales) * k], f[k + len(scales) * k :]
        probes = (0.5 * (plus + minus)).view(len(scales), *U.shape)
        out = {"plain": plain}
        for j, (name, c) in enumerate(scales.items()):
            lam = 1.0 / c**2
            out[f"bc_{name}"] = (1 + lam) * plain - lam * probes[j]
        return out

    return run


def check_against_the_optimizer_path() -> float:
    """Max difference between this file's BC (ρ = τ) and ``orthogonalize`` on the same probes."""
    U = synthetic(32, 64, 1, 31.6, 9) + 0.05 * torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    tau = 0.05
    ours = estimators(torch.float32, {"tau": 1.0})(U[None], tau, torch.Generator().manual_seed(3))["bc_tau"][0]
    lib = orthogonalize([U], [tau], True, torch.Generator().manual_seed(3), max_noise_ratio=None).outputs[0]
    return (ours - lib).abs().max().item()


def bias_study(
    Ubar: Tensor,
    tau: float,
    draws: int,
    run: Estimator,
    seed: int,
    antithetic: bool = False,
    chunk: int = 200,
) -> dict[str, dict[str, float]]:
    """Relative bias ‖E[est] − f(Ū)‖/‖f(Ū)‖ and relative RMSE of each estimator over ``draws`` noise draws."""
    target = newton_schulz(Ubar, dtype=Ubar.dtype if Ubar.dtype == torch.float64 else torch.float32).to(Ubar.dtype)
    g_noise, g_probe = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    sums: dict[str, Tensor] = {}
    sq: dict[str, float] = {}
    done = 0
    while done < draws:
        k = min(chunk, draws - done)
        N = tau * torch.randn((k, *Ubar.shape), generator=g_noise, dtype=Ubar.dtype)
        U = torch.cat([Ubar + N, Ubar - N]) if antithetic else Ubar + N
        for name, est in run(U, tau, g_probe).items():
            sums[name] = sums.get(name, torch.zeros_like(Ubar)) + est.sum(0)
            sq[name] = sq.get(name, 0.0) + (est - target).square().sum().item()
        done += k
    count = draws * (2 if antithetic else 1)
    norm = target.norm().item()
    return {
        name: {
            "bias": ((sums[name] / count - target).norm() / norm).item(),
            "rmse": math.sqrt(sq[name] / count) / norm,
        }
        for name in sums
    }


def v2(draws: int, draws_large: int, bf16_draws: int, seed: int) -> dict:
    Ubar = synthetic(64, 128, 1.0, 31.6, seed)
    norm = torch.linalg.matrix_norm(Ubar).item()
    out: dict = {"fp32": {}, "bf16": {}}
    fp32 = estimators(torch.float32, PROBE_SCALES)
    for ratio in tqdm(SPEC_V2, desc="V2 fp32"):
        tau = ratio * norm / math.sqrt(Ubar.numel())  # ‖N‖_F / ‖Ū‖_F = ratio in expectation
        n = draws if ratio < 0.5 else draws_large
        res = bias_study(Ubar, tau, n, fp32, seed + int(1000 * ratio))
        spec = SPEC_V2[ratio]
        ref = dict(zip(["plain", "bc_tau", "bc_tau/2", "bc_2tau"], spec[:4]))
        for name, r in res.items():
            r["spec_bias"] = ref[name]
            r["mc_se"] = r["rmse"] / math.sqrt(n)
            r["z"] = (r["bias"] - ref[name]) / r["mc_se"]
        out["fp32"][str(ratio)] = {"draws": n, **res}
    bf16 = estimators(torch.bfloat16, {"tau": 1.0})
    for ratio in tqdm((0.02, 0.05, 0.1), desc="V2 bf16"):
        tau = ratio * norm / math.sqrt(Ubar.numel())
        res = bias_study(Ubar, tau, bf16_draws, bf16, seed + int(1000 * ratio))
        out["bf16"][str(ratio)] = {"draws": bf16_draws, **res}
    return out


def v3(m: int, n: int, taus: tuple[float, ...], draws: tuple[int, ...], seed: int) -> dict:
    Ubar = synthetic(m, n, 10.0, 31.6, seed, dtype=torch.float64)
    run = estimators(torch.float64, {"tau": 1.0})
    out: dict = {"shape": [m, n], "rows": []}
    for tau in tqdm(taus, desc="V3 fp64"):
        row: dict = {"tau": tau}
        for d in draws:
            res = bias_study(Ubar, tau, d, run, seed + d, antithetic=True)
            row[f"plain@{d}"], row[f"bc@{d}"] = res["plain"]["bias"], res["bc_tau"]["bias"]
        out["rows"].append(row)
    big = max(draws)
    logs = [math.log(r["tau"]) for r in out["rows"]]

    def slope(key: str, lo: int, hi: int) -> float:
        ys = [math.log(r[key]) for r in out["rows"]]
        return (ys[hi] - ys[lo]) / (logs[hi] - logs[lo])

    out["plain_slope"] = slope(f"plain@{big}", 0, len(taus) - 1)
    out["bc_slope_top_two"] = slope(f"bc@{big}", len(taus) - 2, len(taus) - 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=200_000)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--draws-large", type=int, default=1500, help="draws at ratios >= 0.5")
    parser.add_argument("--bf16-draws", type=int, default=1000)
    parser.add_argument("--v3-shape", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--v3-draws", type=int, nargs="+", default=(1000, 4000))
    parser.add_argument("--v3-taus", type=float, nargs="+", default=(0.025, 0.05, 0.1, 0.2))
    parser.add_argument("--only", choices=["v1", "v2", "v3"], nargs="+", default=["v1", "v2", "v3"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run (few draws)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.chains, args.draws, args.draws_large, args.bf16_draws, args.v3_draws = 20_000, 100, 50, 20, (50, 100)
    start = time.time()
    result: dict = {"args": vars(args), "check_vs_optimizer_path": check_against_the_optimizer_path()}
    print(f"BC here vs orthogonalize: max |diff| {result['check_vs_optimizer_path']:.2e}")
    if "v1" in args.only:
        report_v1(result, args)
    if "v2" in args.only:
        report_v2(result, args)
    if "v3" in args.only:
        report_v3(result, args)
    result["seconds"] = time.time() - start
    result |= provenance(1)
    print(f"\n{result['seconds']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def report_v1(result: dict, args: argparse.Namespace) -> None:
    result["v1"] = v1(args.chains, 0.95, args.seed)
    print("\nV1: Var(U_t) empirical / predicted - 1")
    for form, rows in result["v1"].items():
        print(f"  {form:10s}", "  ".join(f"t={r['t']}: {r['rel_err']:+.4f}" for r in rows))


def report_v2(result: dict, args: argparse.Namespace) -> None:
    result["v2"] = v2(args.draws, args.draws_large, args.bf16_draws, args.seed)
    print("\nV2 fp32: relative bias (spec) [z = (ours - spec)/MC-SE], RMSE")
    print("  ratio   " + "".join(f"{k:22s}" for k in ["plain", "BC tau", "BC tau/2", "BC 2tau"]) + "RMSE plain/BC")
    for ratio, res in result["v2"]["fp32"].items():
        cells = [f"{res[k]['bias']:.4f} ({res[k]['spec_bias']:.4f}) [{res[k]['z']:+.1f}]" for k in PROBE_SCALES_KEYS]
        print(f"  {ratio:6s}  " + "  ".join(cells) + f"  {res['plain']['rmse']:.3f}/{res['bc_tau']['rmse']:.3f}")
    print("\nV2 bf16 (all NS calls in bf16): relative bias plain -> BC tau")
    for ratio, res in result["v2"]["bf16"].items():
        fp = result["v2"]["fp32"][ratio]
        print(
            f"  {ratio:6s}  bf16 {res['plain']['bias']:.4f} -> {res['bc_tau']['bias']:.4f}   "
            f"fp32 {fp['plain']['bias']:.4f} -> {fp['bc_tau']['bias']:.4f}"
        )


def report_v3(result: dict, args: argparse.Namespace) -> None:
    m, n = args.v3_shape
    result["v3"] = v3(m, n, tuple(args.v3_taus), tuple(args.v3_draws), args.seed)
    print(f"\nV3 ({m}x{n}, s in [10, 31.6], fp64, antithetic noise): relative bias")
    for row in result["v3"]["rows"]:
        print("  " + "  ".join(f"{k}={v:.3g}" for k, v in row.items()))
    print(
        f"  plain slope {result['v3']['plain_slope']:.2f} (expected 2 ± 0.2); "
        f"BC slope between the two largest τ {result['v3']['bc_slope_top_two']:.2f} (expected >= 3.5)"
    )


PROBE_SCALES_KEYS = ["plain", "bc_tau", "bc_tau/2", "bc_2tau"]

if __name__ == "__main__":
    main()
