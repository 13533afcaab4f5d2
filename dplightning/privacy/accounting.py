"""Privacy accounting: a ledger of (σ, q, steps) segments over Opacus' accountants.

The accountants themselves (PRV, RDP, GDP) are Opacus'; this module only keeps the
history, caches the expensive ε computations and calibrates σ for a target ε.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from opacus.accountants import create_accountant
from opacus.accountants.registry import _ACCOUNTANTS
from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier

Segment = tuple[float, float, int]
"""One run of identical steps: (noise multiplier σ, sample rate q, number of steps)."""

_FORMAT_VERSION = 1

SIGMA_CAP = MAX_SIGMA / 2
"""σ at which an unreachable target's floor is reported: Opacus' calibration doubles σ up to
``MAX_SIGMA`` and always tries one σ in [MAX_SIGMA / 2, MAX_SIGMA], so ε(SIGMA_CAP) is reachable."""


def available_accountants() -> list[str]:
    """Names accepted by ``accountant=`` (Opacus' accountant registry)."""
    return sorted(_ACCOUNTANTS)


def check_accountant(name: str) -> str:
    """Return ``name`` if Opacus knows the accountant, else raise a helpful error."""
    if name not in _ACCOUNTANTS:
        raise ValueError(f"Unknown accountant {name!r}; choose one of {available_accountants()}.")
    return name


def compute_epsilon(history: Iterable[Segment], delta: float, accountant: str = "prv") -> float:
    """ε after composing ``history`` with an Opacus accountant (no caching).

    Args:
        history: Segments (σ, q, steps) in the order they were run.
        delta: Target δ.
        accountant: Name of an Opacus accountant (``"prv"``, ``"rdp"``, ``"gdp"``).

    Returns:
        ε, ``0.0`` for an empty history and ``inf`` if any step had σ = 0.
    """
    segments = [(float(s), float(q), int(t)) for s, q, t in history if t > 0]
    if not segments:
        return 0.0
    if any(s <= 0.0 for s, _, _ in segments):
        return math.inf
    if accountant == "gdp" and len({(s, q) for s, q, _ in segments}) > 1:
        # Opacus' GaussianAccountant reads only the last segment: it would under-report.
        raise ValueError("The 'gdp' accountant supports one constant (σ, q); use 'prv' or 'rdp'.")
    acc = create_accountant(check_accountant(accountant))
    acc.history = segments
    with warnings.catch_warnings():
        if accountant == "prv":  # PRV sizes its domain with an RDP bound; its tightness warning is noise here
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            # q = 1 (no subsampling, e.g. a correlated mechanism accounted without amplification): PRV takes
            # log(1 - q) = -inf on purpose and warns; its ε is still the Gaussian mechanism's (upper bound).
            warnings.filterwarnings("ignore", message="divide by zero encountered in log", category=RuntimeWarning)
        # A negative ε (δ ≥ 1/N makes the accountants return one) certifies (0, δ)-DP: report 0.
        return max(0.0, float(acc.get_epsilon(delta=delta)))


def calibrate_noise_multiplier(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "prv"
) -> float:
    """Smallest σ (to Opacus' bisection tolerance) with ε(σ, q, steps) ≤ ``target_epsilon``.

    Raises:
        ValueError: If the arguments are out of range, or the budget is unreachable (the message
            then gives the smallest ε the accountant certifies at these q, steps and δ).
    """
    if target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}.")
    if steps <= 0:
        raise ValueError(f"Cannot calibrate σ for {steps} steps; set max_epochs or max_steps.")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        warnings.filterwarnings("ignore", message="divide by zero encountered in log", category=RuntimeWarning)  # q=1
        try:
            sigma = get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=check_accountant(accountant),
                epsilon_tolerance=0.01 * min(1.0, target_epsilon),
            )
        except ValueError as err:  # Opacus' bare "The privacy budget is too low." (GDP: its root finder's error)
            raise ValueError(unreachable_target_message(target_epsilon, delta, sample_rate, steps, accountant)) from err
    return float(sigma)


def epsilon_floor(delta: float, sample_rate: float, steps: int, accountant: str = "prv") -> float | None:
    """ε at σ = ``SIGMA_CAP``; ``None`` if the accountant fails there.

    Past this σ more noise no longer lowers ε: what is left is the accountant's own resolution
    (RDP's finite set of orders, PRV's error bound). Any target ≥ it can be calibrated.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")  # RDP: expected here
            return compute_epsilon([(SIGMA_CAP, sample_rate, steps)], delta, accountant)
    except ValueError:  # GDP's root finder has no sign change at such σ
        return None


def unreachable_target_message(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str
) -> str:
    """Why no σ reaches ``target_epsilon`` here, with the smallest ε that can be asked for."""
    text = (
        f"target_epsilon = {target_epsilon} is out of reach with the '{accountant}' accountant at q = "
        f"{sample_rate:.4g}, {steps} steps and δ = {delta:.3g}: "
    )
    floor = epsilon_floor(delta, sample_rate, steps, accountant)
    if floor is None:
        text += f"its calibration fails for every σ up to {MAX_SIGMA:.0e}."
    else:
        text += (
            f"even σ = {SIGMA_CAP:.0e} gives ε = {floor:.4g}, and more noise no longer lowers it (the accountant's "
            f"numerical resolution). Ask for target_epsilon ≥ {_round_up(floor):g}."
        )
    for other in ("prv", "rdp"):
        other_floor = epsilon_floor(delta, sample_rate, steps, other) if other != accountant else None
        if other_floor is not None and (floor is None or other_floor < floor):
            return text + f" accountant='{other}' certifies ε down to {other_floor:.3g} here."
    return text


def _round_up(value: float) -> float:
    """``value`` rounded up to 3 significant digits (a target sure to be reachable)."""
    scale = 10 ** (2 - math.floor(math.log10(value)))
    return math.ceil(value * scale) / scale


def combined_noise_multiplier(noise_multipliers: Iterable[float]) -> float:
    """σ_eff of several Gaussian releases computed on the same Poisson sample at the same step.

    Releasing f_j(D) + N(0, (σ_j Δ_j)²) for j = 1..m, where Δ_j is f_j's sensitivity, is one
    Gaussian mechanism: scale each part by 1/(σ_j Δ_j) and the noise is N(0, I) while the
    sensitivity is sqrt(Σ_j σ_j⁻²). So the step is accounted as one subsampled Gaussian
    mechanism with noise multiplier σ_eff = (Σ_j σ_j⁻²)^(-1/2) (Andrew et al., "Differentially
    Private Learning with Adaptive Clipping", NeurIPS 2021, Thm. 1, for a gradient and a count).

    Args:
        noise_multipliers: σ_j of each release, in units of its own sensitivity.

    Returns:
        σ_eff; the single σ unchanged for one release, and 0 if any σ_j is 0 (not private).
    """
    sigmas = [float(s) for s in noise_multipliers]
    if not sigmas:
        raise ValueError("combined_noise_multiplier needs at least one release.")
    if len(sigmas) == 1:
        return sigmas[0]
    if any(s <= 0.0 for s in sigmas):
        return 0.0
    return math.fsum(s**-2 for s in sigmas) ** -0.5


def split_noise_multiplier(effective: float, others: Iterable[float]) -> float:
    """σ left for one release so that, with releases ``others``, the step has σ_eff = ``effective``.

    The inverse of :func:`combined_noise_multiplier`: σ = (σ_eff⁻² − Σ_r σ_r⁻²)^(-1/2).

    Raises:
        ValueError: If the other releases alone already cost as much as σ_eff allows.
    """
    others = [float(s) for s in others]
    if not others:
        return float(effective)
    rest = effective**-2 - math.fsum(s**-2 for s in others)
    if rest <= 0.0 or min(others) <= 0.0:
        raise ValueError(
            f"The step releases with noise multipliers {others} alone exceed the budget of σ_eff = {effective:.4g}; "
            "give them more noise (each σ_r must be well above σ_eff)."
        )
    return rest**-0.5


def steps_within_budget(
    prefix: Sequence[Segment],
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    delta: float,
    accountant: str = "prv",
    limit: int | None = None,
) -> int:
    """Largest n ≥ 0 with ε(``prefix`` + n steps of (σ, q)) ≤ ``target_epsilon``, at most ``limit``.

    Exact ε by doubling then bisection: about 2·log2(n) accountant calls (PRV on CPU: about
    0.1 s each up to 10³ steps, 0.7 s at 10⁴), so compute it once per (prefix, σ, q) and cache.

    Args:
        prefix: Segments run before the final (σ, q) segment.
        noise_multiplier: σ of the final segment (σ_eff if the step releases more than the gradient).
        sample_rate: q of the final segment.
        target_epsilon: The budget.
        delta: Target δ.
        accountant: Name of an Opacus accountant.
        limit: Largest n worth knowing (e.g. the steps the run plans); ``None`` for no cap.

    Returns:
        n; 0 if ``prefix`` alone (or one more step) already exceeds the budget.
    """

    def fits(n: int) -> bool:
        return compute_epsilon([*prefix, (noise_multiplier, sample_rate, n)], delta, accountant) <= target_epsilon

    if limit is not None and fits(limit):
        return limit
    lo, hi = 0, 1  # invariant once bracketed: fits(lo) and not fits(hi)
    if not fits(lo):
        return 0
    while (limit is None or hi < limit) and fits(hi):
        lo, hi = hi, 2 * hi
    if limit is not None:
        hi = min(hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class PrivacyLedger:
    """History of (σ, q, steps) segments and the ε it has spent.

    The history holds public values only, so every rank keeps an identical copy and
    the ledger may be checkpointed. Two ways to read ε:

    * :meth:`get_epsilon` is exact and memoised per (history, δ); a PRV call takes
      about a second at 10⁴ steps (CPU), so it is meant for reports.
    * :meth:`epsilon_bound` costs microseconds on most steps and is meant for progress
      bars: it returns the exact ε of the same run continued to the next point of a
      geometric grid of step counts (ratio ``grid_ratio``), which bounds ε from above
      because composing more identical steps never lowers ε. It is exact on grid points.

    Args:
        accountant: Name of an Opacus accountant.
        grid_ratio: Ratio between consecutive step counts of :meth:`epsilon_bound`'s grid.
        grid_min_gap: Fewest steps between two grid points, so that the first steps of a
            long run do not each pay for an accountant call.
    """

    def __init__(self, accountant: str = "prv", grid_ratio: float = 1.1, grid_min_gap: int = 1) -> None:
        self.accountant = check_accountant(accountant)
        if grid_ratio <= 1.0:
            raise ValueError(f"grid_ratio must be > 1, got {grid_ratio}.")
        self.grid_ratio = grid_ratio
        self.grid_min_gap = grid_min_gap
        """Fewest steps between grid points (a strategy sets about 1% of the planned run)."""
        self.grid_end: int | None = None
        """The planned total of steps, if known: a grid point, so the bound is exact when the run ends."""
        self._history: list[Segment] = []
        self._exact: OrderedDict[tuple[tuple[Segment, ...], float], float] = OrderedDict()
        self._grids: dict[tuple[Any, ...], tuple[list[int], list[float]]] = {}

    @property
    def history(self) -> tuple[Segment, ...]:
        """The segments run so far, oldest first."""
        return tuple(self._history)

    @property
    def steps(self) -> int:
        """Total number of accounted steps."""
        return sum(t for _, _, t in self._history)

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps of the subsampled Gaussian mechanism."""
        if num_steps <= 0:
            return
        if self._history and self._history[-1][:2] == (noise_multiplier, sample_rate):
            s, q, t = self._history[-1]
            self._history[-1] = (s, q, t + num_steps)
        else:
            self._history.append((float(noise_multiplier), float(sample_rate), int(num_steps)))

    def get_epsilon(self, delta: float) -> float:
        """Exact ε of the history so far (memoised)."""
        key = (self.history, float(delta))
        if key not in self._exact:
            self._exact[key] = compute_epsilon(key[0], delta, self.accountant)
            while len(self._exact) > 64:
                self._exact.popitem(last=False)
        return self._exact[key]

    def epsilon_bound(self, delta: float) -> float:
        """Upper bound on ε, exact at grid points; microseconds between them."""
        if not self._history:
            return 0.0
        *prefix, (sigma, q, steps) = self._history
        key = (tuple(prefix), sigma, q, float(delta))
        points, values = self._grids.setdefault(key, ([], []))
        i = bisect.bisect_left(points, steps)
        if i < len(points):
            return values[i]
        # The planned end is a grid point too: at the last step the bound is the exact ε, not the next point's.
        end = None if self.grid_end is None else self.grid_end - sum(t for *_, t in prefix)
        point = self._next_grid_point(points[-1] if points else 0, steps)
        if end is not None and steps <= end < point:
            point = end
        eps = compute_epsilon([*prefix, (sigma, q, point)], delta, self.accountant)
        points.append(point)
        values.append(eps)
        return eps

    def _next_grid_point(self, last: int, steps: int) -> int:
        point = max(last, 1)
        while point < steps:
            point = max(point + max(self.grid_min_gap, 1), math.ceil(point * self.grid_ratio))
        return point

    def state_dict(self) -> dict[str, Any]:
        """Public state for checkpoints: the history and the accountant name."""
        return {"version": _FORMAT_VERSION, "accountant": self.accountant, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the history written by :meth:`state_dict`."""
        if state.get("version") != _FORMAT_VERSION:
            raise ValueError(f"Unsupported ledger format {state.get('version')!r}.")
        self._history = [(float(s), float(q), int(t)) for s, q, t in state["history"]]
