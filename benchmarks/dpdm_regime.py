"""DPDM's regime per setting: the DP noise norm of one step against the clipped signal (CPU, seconds).

One DP-SGD step releases (Σ_i clip_C(g_i) + N(0, σ² C² I_d)) / B. The signal has norm at most C
(all B clipped gradients aligned); the noise has norm about σ C √d / B. Their ratio σ√d / B is
what a setting trades: σ grows as ε shrinks or the steps grow, √d with the network, and B
divides it. The paper's MNIST setting (B = 4,096, d = 1.75 M, σ = 2.38) sits at 0.77; settings
far above 1 are noise-dominated and learn little in a few hundred steps (issue 23, docs/dpdm.md
"Choosing the regime").

For each setting the network is built (random weights) to count d, and σ is calibrated for
(ε, δ, q = B / N, steps) with the library's accountant (PRV), exactly as ``DPStrategy`` does.

    python benchmarks/dpdm_regime.py --out benchmarks/results/dpdm_regime.json
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _harness import provenance, provenance_line, write_report
from _outputs import default_result

from dplightning.models import NCSNppUNet
from dplightning.privacy.accounting import calibrate_noise_multiplier


@dataclass(frozen=True)
class Setting:
    """One training setting of DPDM.

    Args:
        name: Label.
        n: Training images (the privacy units).
        batch: Expected batch B (Poisson, q = B / n).
        steps: Optimizer steps.
        epsilon: Target ε.
        net: ``NCSNppUNet`` arguments.
        delta: δ (default 1 / (10 n), the strategy's default).
    """

    name: str
    n: int
    batch: int
    steps: int
    epsilon: float
    net: Mapping[str, Any] = field(default_factory=dict)
    delta: float | None = None


SMALL = {"nf": 8, "ch_mult": (1, 2), "num_res_blocks": 1, "attn_resolutions": ()}
OLD_DIGITS = {"image_size": 8, "nf": 16, "ch_mult": (1, 2), "num_res_blocks": 1, "attn_resolutions": (4,)}
OLD_14 = {**OLD_DIGITS, "image_size": 14, "attn_resolutions": (7,)}
SETTINGS = (
    Setting("paper MNIST 28x28, eps 10", 60_000, 4096, 4394, 10.0, {}, 1e-5),
    Setting("old digits_eps10.yaml", 1258, 64, 200, 10.0, OLD_DIGITS),
    Setting("old K sweep (digits, B 32, 50 steps)", 1258, 32, 50, 10.0, OLD_DIGITS),
    Setting("digits_eps10.yaml (now)", 1258, 256, 200, 10.0, {"image_size": 8, **SMALL}),
    Setting("digits, eps 1", 1258, 256, 200, 1.0, {"image_size": 8, **SMALL}),
    Setting("old mnist5k_eps10.yaml (14x14)", 3800, 64, 240, 10.0, {**OLD_14}),
    Setting("mnist5k_eps10.yaml (now, 14x14)", 3800, 512, 300, 10.0, {"image_size": 14, **SMALL}),
    Setting("MNIST-5k 28x28, paper network, B 1000 (GPU row)", 4000, 1000, 400, 10.0, {}),
)  # fmt: skip


def measure(setting: Setting) -> dict[str, Any]:
    """d, q, σ and the noise-to-signal ratio σ√d / B of one setting."""
    d = sum(p.numel() for p in NCSNppUNet(**setting.net).parameters())
    q = setting.batch / setting.n
    delta = setting.delta if setting.delta is not None else 1 / (10 * setting.n)
    sigma = calibrate_noise_multiplier(setting.epsilon, delta, q, setting.steps)
    ratio = sigma * math.sqrt(d) / setting.batch
    return {**asdict(setting), "delta": delta, "parameters": d, "sample_rate": q, "epochs": setting.steps * q,
            "sigma": sigma, "noise_to_signal": ratio}  # fmt: skip


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table docs/dpdm.md shows."""
    lines = [
        "| setting | d | B | q | steps | epochs | ε | σ (PRV) | σ√d / B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['parameters']:,} | {r['batch']} | {r['sample_rate']:.3g} | {r['steps']} | "
            f"{r['epochs']:.1f} | {r['epsilon']:g} | {r['sigma']:.3f} | **{r['noise_to_signal']:.2f}** |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default: outputs/benchmarks/)")
    args = parser.parse_args(argv)
    rows = [measure(s) for s in SETTINGS]
    out = args.out or default_result("dpdm_regime.json")
    write_report(out, "dpdm_regime", 1, {"accountant": "prv"}, rows=rows)
    out.with_suffix(".md").write_text(markdown(rows) + "\n" + provenance_line(provenance(1)))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
