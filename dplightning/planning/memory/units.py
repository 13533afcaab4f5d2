"""Units of the plan: bytes, the phases of a step, and reading ``80GB`` / ``24GiB``."""

from __future__ import annotations

import re
from typing import Literal

Phase = Literal["static", "forward", "backward", "optimizer"]
PHASES: dict[str, str] = {
    "static": "whole step",
    "forward": "end of forward",
    "backward": "end of backward",
    "optimizer": "optimizer step",
}
GB = 1e9
_UNITS = {"": GB, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": GB, "gb": GB, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
DEFAULT_SIGMAS = 4.0
"""Standard deviations above the expected Poisson batch that the physical batch must hold."""


def parse_memory(text: str) -> float:
    """Bytes in ``"80GB"``, ``"80GiB"``, ``"24G"``, ``"512MiB"`` or a bare number of GB.

    Raises:
        ValueError: For an unknown unit or a negative amount.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"Cannot read {text!r} as an amount of memory (e.g. 80GB, 80GiB, 24G, 512MiB).")
    return float(match.group(1)) * _UNITS[unit]
