"""Where the benchmarks write by default: ``outputs/`` under the working directory.

``benchmarks/results/*.json`` and ``docs/figures/*.png`` are the records the docs cite. A run
replaces one of them only when its command names it (``--out benchmarks/results/NAME.json``,
``--figures docs/figures``); by default results go to ``outputs/benchmarks/`` and figures to
``outputs/figures/``, which git ignores.
"""

from __future__ import annotations

from pathlib import Path

OUTPUTS = Path("outputs")


def default_result(name: str) -> Path:
    """Default path of a benchmark's result file ``name`` (e.g. ``engines_cpu.json``)."""
    return OUTPUTS / "benchmarks" / name


def default_figures() -> Path:
    """Default folder of a benchmark's figures."""
    return OUTPUTS / "figures"
