"""Detection power of ``dplightning audit`` at its default budget: which broken mechanisms it flags.

Run (the table in docs/trust.md; CPU, one thread)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/audit_power.py --seeds 10 \
        --out benchmarks/results/audit_power_cpu.json

Each row runs :func:`dplightning.commands.audit.audit` with its defaults (10,000 Dirac canaries, 50
steps, σ = 1, C = 1, q ≈ 0.02, δ = 10⁻⁶, 95% confidence, k₊ = 200) on ``--seeds`` seeds, with
the mechanism broken by :func:`dplightning.commands.audit.sabotaged` while the accountant keeps
claiming the full guarantee. "true ε" is the accountant's ε for the mechanism that actually
ran (noise σ·f, or clipping at f·C, which is noise σ/f relative to the sensitivity f·C);
infinite (``null`` in the JSON) without noise or clipping. A run is flagged when its lower
bound exceeds the claim.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _harness import write_report
from _outputs import default_result

from dplightning.commands.audit import AuditResult, audit
from dplightning.privacy.accounting import compute_epsilon

# The score is scale-free (fitted shift and noise), so clipping at f·C reads exactly like noise σ/f.
ROWS: list[tuple[str, str | None, float | None]] = [
    ("noise off", "noise", None),
    ("clipping off", "clipping", None),
    ("σ/4", "noise_scale", 0.25),
    ("σ/2", "noise_scale", 0.5),
    ("3σ/4", "noise_scale", 0.75),
    ("4C", "clipping_scale", 4.0),
    ("2C", "clipping_scale", 2.0),
    ("correct", None, None),
]


def true_epsilon(result: AuditResult) -> float:
    """ε of the mechanism that actually ran, by the same accountant, at the audit's δ."""
    sigma = result.noise_multiplier
    if result.sabotage in ("noise", "clipping"):
        return math.inf
    if result.sabotage == "noise_scale":
        sigma *= result.sabotage_factor or 1.0
    elif result.sabotage == "clipping_scale":
        sigma /= result.sabotage_factor or 1.0
    return compute_epsilon([(sigma, result.sample_rate, result.steps)], result.delta)


def run_row(sabotage: str | None, factor: float | None, seeds: list[int]) -> list[dict[str, Any]]:
    """One audit per seed, with its bound, the claim and the true ε."""
    runs = []
    for seed in seeds:
        start = time.perf_counter()
        result = audit(seed=seed, sabotage=sabotage, sabotage_factor=factor)  # type: ignore[arg-type]
        true = true_epsilon(result)
        runs.append({
            "seed": seed, "epsilon_lower_bound": result.epsilon_lower_bound,
            "claimed_epsilon": result.claimed_epsilon, "true_epsilon": true if math.isfinite(true) else None,
            "correct": result.correct, "guesses": result.guesses, "flagged": result.violation,
            "seconds": time.perf_counter() - start,
        })  # fmt: skip
    return runs


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: per row, true and claimed ε, the lower bound of every seed and how many were flagged."""
    lines = [
        "| mechanism | true ε | claimed ε | lower bound per seed | min / median | flagged |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        bounds = [run["epsilon_lower_bound"] for run in row["runs"]]
        claimed = statistics.median(run["claimed_epsilon"] for run in row["runs"])
        trues = [run["true_epsilon"] for run in row["runs"]]
        true = "∞" if None in trues else f"{statistics.median(trues):.2f}"
        flagged = sum(run["flagged"] for run in row["runs"])
        lines.append(
            f"| {row['mechanism']} | {true} | {claimed:.3f} | {', '.join(f'{b:.2f}' for b in bounds)} | "
            f"{min(bounds):.2f} / {statistics.median(bounds):.2f} | {flagged} / {len(bounds)} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every row on every seed, print the table, write the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=default_result("audit_power_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("dplightning").setLevel(logging.ERROR)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    rows = []
    for name, sabotage, factor in ROWS:
        rows.append(
            {"mechanism": name, "sabotage": sabotage, "factor": factor, "runs": run_row(sabotage, factor, seeds)}
        )
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    write_report(args.out, "audit_power", 1, vars(args) | {"seeds": seeds}, rows=rows)


if __name__ == "__main__":
    main()
