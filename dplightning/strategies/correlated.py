"""Correlated-noise mechanisms in the strategy: their accounting rules and the strategy matrix of a run.

``noise_mechanism="band_mf"`` or ``"blt"`` replaces the independent noise N(0, (σΔ)²) of
each step by the correlated z_t = (C⁻¹w)_t of a matrix factorization, with w white and the
train loader's sampler by cyclic Poisson sampling over ``partitions`` fixed partitions (step t
samples partition t mod partitions). What the ledger charges:

* ``band_mf`` (bands ≤ partitions, columns of C of norm 1): ⌈t/partitions⌉ compositions of the
  Poisson-subsampled Gaussian at the partition's rate q' = partitions x B / N and noise
  multiplier σ (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", Thm. 4):
  one composition is charged at every step that starts a cycle of ``partitions`` steps.
* ``blt``: no amplification. The whole run is one Gaussian mechanism on C x whose sensitivity
  is that of ⌈n/partitions⌉ participations ``partitions`` steps apart (exact for the BLT
  strategies here); w has std σ x that sensitivity x Δ, so the run costs one Gaussian
  mechanism with noise multiplier σ, charged in full at its first step (as q = 1, one step).

Everything here is public (C depends on the planned number of steps and the optimizer only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.optim import SGD, Optimizer

from dplightning.privacy.blt import fit_blt
from dplightning.privacy.matrix_mechanism import Strategy, Workload, optimize_banded

UNAMPLIFIED_RATE = 1.0
"""The sample rate the ledger records for a mechanism accounted without amplification by sampling."""


@dataclass(frozen=True)
class NoiseMechanism:
    """A run's noise mechanism and the accounting rules that follow from it.

    Args:
        name: ``"gaussian"``, ``"band_mf"`` or ``"blt"``.
        partitions: Partitions of the cyclic Poisson sampler (1 for ``"gaussian"``).
        bands: Bands of ``"band_mf"``.
        buffers: Buffers of ``"blt"``.
    """

    name: str = "gaussian"
    partitions: int = 1
    bands: int | None = None
    buffers: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> NoiseMechanism:
        """The mechanism of a :class:`~dplightning.strategies.config.DPConfig`."""
        if not config.correlated:
            return cls()
        return cls(config.noise_mechanism, config.partitions, config.bands, config.blt_buffers)

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> NoiseMechanism:
        """The mechanism a checkpoint records (none recorded: ``"gaussian"``, as every older checkpoint)."""
        if not record or record.get("name", "gaussian") == "gaussian":
            return cls()
        name = str(record["name"])
        if name not in ("band_mf", "blt"):
            raise ValueError(f"Unknown noise mechanism {name!r} in the checkpoint's privacy record.")
        return cls(name, int(record["partitions"]), record.get("bands"), record.get("buffers"))

    @property
    def correlated(self) -> bool:
        """Whether the noise is correlated across steps."""
        return self.name != "gaussian"

    @property
    def amplified(self) -> bool:
        """Whether the ledger charges the sampling's amplification (DP-SGD and banded MF)."""
        return self.name in ("gaussian", "band_mf")

    def compositions(self, steps: int) -> int:
        """Subsampled-Gaussian compositions the ledger charges after ``steps`` released steps."""
        if steps <= 0:
            return 0
        if self.name == "gaussian":
            return steps
        if self.name == "band_mf":
            return -(-steps // self.partitions)
        return 1  # blt: the whole run is one Gaussian mechanism, charged at its first step

    def run_sensitivity(self, sensitivity: float, steps: int) -> float:
        """The sensitivity of C·X over a whole run of ``steps`` that the ledger charges, in units of Δ.

        ``sensitivity`` is :func:`strategy_sensitivity`'s. ``band_mf`` charges each of its
        compositions one participation (columns ``partitions`` apart do not overlap when
        bands <= partitions), so the run's is √(compositions) times it; ``blt``'s already covers
        every participation; DP-SGD's releases are each their own mechanism (√steps over a run).
        """
        if self.name == "blt":
            return sensitivity
        return sensitivity * math.sqrt(self.compositions(steps))

    def charges(self, step: int) -> bool:
        """Whether releasing step ``step`` (0-based) charges one composition."""
        return self.compositions(step + 1) > self.compositions(step)

    def accounted_rate(self, sample_rate: float) -> float:
        """The sample rate the ledger records for steps sampled at ``sample_rate``."""
        return sample_rate if self.amplified else UNAMPLIFIED_RATE

    def record(self) -> dict[str, Any]:
        """Public description for checkpoints and reports."""
        return {"name": self.name, "partitions": self.partitions, "bands": self.bands, "buffers": self.buffers}

    def describe(self) -> str:
        """One phrase naming the mechanism and its sampling."""
        if self.name == "gaussian":
            return "DP-SGD (independent Gaussian noise, Poisson sampling)"
        if self.name == "band_mf":
            return (
                f"banded matrix factorization ({self.bands} bands, cyclic Poisson sampling over {self.partitions} "
                f"partitions, amplified: {self.partitions} steps per composition)"
            )
        return (
            f"BLT matrix factorization ({self.buffers} buffers, cyclic Poisson sampling over {self.partitions} "
            "partitions, not amplified: the run is one Gaussian mechanism)"
        )


def workload_of(optimizer: Optimizer) -> Workload:
    """The workload the strategy matrix is optimised for: heavy-ball SGD's, else plain prefix sums.

    ``torch.optim.SGD`` with one momentum β > 0 in every group, no dampening and no Nesterov
    follows the momentum workload; any other optimizer is given the prefix sums (C stays
    valid for any optimizer: only its error depends on the workload).
    """
    if type(optimizer) is not SGD:
        return Workload()
    groups = optimizer.param_groups
    momenta = {float(g.get("momentum", 0.0)) for g in groups}
    plain = all(not g.get("nesterov", False) and float(g.get("dampening", 0.0)) == 0.0 for g in groups)
    if len(momenta) == 1 and plain and 0.0 < (beta := momenta.pop()) < 1.0:
        return Workload(momentum=beta)
    return Workload()


def describe_workload(workload: Workload) -> str:
    """The workload in words."""
    if workload.momentum:
        return f"heavy-ball SGD with momentum {workload.momentum:g}"
    return "prefix sums (plain SGD)"


def build_strategy(mechanism: NoiseMechanism, steps: int, workload: Workload) -> Strategy:
    """The strategy matrix C of a run of ``steps`` steps (cached by the optimisers)."""
    if mechanism.name == "band_mf":
        return optimize_banded(workload, steps, int(mechanism.bands or 1))
    if mechanism.name == "blt":
        return fit_blt(workload, steps, int(mechanism.buffers or 1), min_sep=mechanism.partitions)
    raise ValueError(f"{mechanism.name!r} has no strategy matrix.")


def strategy_sensitivity(mechanism: NoiseMechanism, strategy: Strategy) -> float:
    """Sensitivity of C x in units of Δ that the white noise w is calibrated to.

    ``band_mf``: one participation (the largest column norm, 1), which the amplified
    accounting composes ⌈n/partitions⌉ times. ``blt``: every participation the cyclic sampler
    allows, ⌈n/partitions⌉ of them ``partitions`` steps apart (exact for BLT's non-negative,
    non-increasing coefficients).
    """
    if mechanism.name == "band_mf":
        value = strategy.sensitivity(mechanism.partitions, 1)
    else:
        value = strategy.sensitivity(mechanism.partitions, None)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"The strategy's sensitivity {value} is not a finite positive number.")
    return value
