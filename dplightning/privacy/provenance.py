"""What a run's guarantee is about: the privacy unit, and what the data derived outside the DP steps.

A data module (or the train loader's dataset) may declare

* ``dp_privacy_unit``: a :class:`PrivacyUnit` (or a short text), what one unit of the
  training data is, with the window length and stride when the units are windows of a
  series;
* ``dp_not_covered``: ``{name: text}``, what it computed from the private training data
  outside the DP steps (a tokenizer vocabulary, normalisation statistics), which the
  guarantee does not cover.

Either may be an attribute, a property or a method without arguments. The DP strategy
records both in every checkpoint (:func:`data_provenance`); ``privacy-report`` and
``export`` say them in words with :func:`describe_privacy_unit`, the one place where the
text of a privacy unit is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

UNDECLARED_UNIT = "one item of the train loader's dataset (the data declares no dp_privacy_unit)"
"""What one unit is when neither the data module nor the dataset says more."""


@dataclass(frozen=True)
class PrivacyUnit:
    """One privacy unit of the training data, as a data module declares it.

    Args:
        description: What one unit is, e.g. ``"one training sentence"``.
        window: Rows of the series in one unit, when units are windows of a series.
        stride: Rows between the starts of consecutive training windows (with ``window``).
    """

    description: str
    window: int | None = None
    stride: int | None = None

    def __post_init__(self) -> None:
        if not self.description.strip():
            raise ValueError("A privacy unit needs a description.")
        if (self.window is None) != (self.stride is None):
            raise ValueError(f"Give a window unit's length and stride together, got {self.window}, {self.stride}.")
        for name, value in (("window", self.window), ("stride", self.stride)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"The privacy unit's {name} must be an int >= 1, got {value!r}.")


def _declared(sources: list[Any], name: str) -> list[Any]:
    """The values of ``name`` that ``sources`` declare (called if callable), in order."""
    values = []
    for source in sources:
        value = getattr(source, name, None)
        value = value() if callable(value) else value
        if value is not None:
            values.append(value)
    return values


def _unit_record(declared: Any, rows_per_unit: int) -> dict[str, Any]:
    unit = PrivacyUnit(declared) if isinstance(declared, str) else declared
    if unit is not None and not isinstance(unit, PrivacyUnit):
        raise TypeError(f"dp_privacy_unit must be a PrivacyUnit or a text, got {type(unit).__name__}.")
    record: dict[str, Any] = asdict(unit) if unit is not None else {"description": None, "window": None, "stride": None}
    return {**record, "rows_per_unit": rows_per_unit}


def data_provenance(trainer: Any, rows_per_unit: int) -> dict[str, Any]:
    """The checkpoint record of what the run's data declares (public values only).

    The data module's ``dp_privacy_unit`` wins over the dataset's; ``dp_not_covered``
    entries of both are kept.

    Args:
        trainer: The Trainer that fits (``None``: nothing declared).
        rows_per_unit: Forward rows per unit (the module's ``dp_rows_per_unit``).

    Returns:
        ``{"privacy_unit": {description, window, stride, rows_per_unit}, "not_covered": {name: text}}``.
    """
    loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
    sources = [getattr(trainer, "datamodule", None), getattr(loader, "dataset", None)]
    sources = [s for s in sources if s is not None]
    units = _declared(sources, "dp_privacy_unit")
    not_covered: dict[str, str] = {}
    for declared in reversed(_declared(sources, "dp_not_covered")):  # the data module's text wins
        not_covered.update({str(k): str(v) for k, v in dict(declared).items()})
    return {"privacy_unit": _unit_record(units[0] if units else None, rows_per_unit), "not_covered": not_covered}


def describe_privacy_unit(record: Mapping[str, Any]) -> str:
    """One privacy unit in words, from a checkpoint's record (:func:`data_provenance`)."""
    parts = [record.get("description") or UNDECLARED_UNIT]
    window, stride = record.get("window"), record.get("stride")
    if window and stride:
        overlap = math.ceil(window / stride)
        if overlap > 1:
            parts.append(
                f"training windows of {window} rows start every {stride} row(s), so one row of the series lies in "
                f"up to {overlap} windows: the guarantee is per window; for one row it is that of a group of up to "
                f"{overlap} units"
            )
        else:
            parts.append(
                f"training windows of {window} rows start every {stride} rows and do not overlap: each row lies in "
                "at most one window, so the guarantee also covers any single row"
            )
    rows = int(record.get("rows_per_unit") or 1)
    if rows > 1:
        parts.append(
            f"each unit is {rows} consecutive rows of the forward batch (dp_rows_per_unit = {rows}), whose "
            "gradients are summed and clipped together"
        )
    return "; ".join(parts)
