"""The privacy record a DP run stores in its checkpoints: its one writer and its one reader.

Every checkpoint a dplightning DP strategy writes holds, under :data:`CHECKPOINT_KEY`, the
public values its (ε, δ) guarantee is computed from (the ledger's (σ, q, steps) history, δ,
the sampling) and what ``privacy-report`` and ``export`` state besides (the engines, the
privacy unit, the library versions). :class:`PrivacyRecord` is that entry, typed: the
strategies write it with :meth:`PrivacyRecord.store_in`, and the resume, ``export`` and
``privacy-report`` read it with :meth:`PrivacyRecord.from_checkpoint`. The entry itself
stays a dict of plain values, so that ``torch.load(weights_only=True)`` opens it.

A record without one of :data:`REQUIRED_FIELDS` (every record any version wrote has them)
is refused rather than read with a default. The other fields were added over time; a record
written before a field existed reads as that field's default, given here and nowhere else.
Nothing in a record is secret: never a seed, a generator state or a correlated mechanism's
noise buffers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

CHECKPOINT_KEY = "dplightning"
"""The checkpoint entry that holds the record."""

REQUIRED_FIELDS = (
    "ledger",
    "noise_multiplier",
    "target_epsilon",
    "max_grad_norm",
    "sample_rate",
    "num_samples",
    "delta",
    "clipping",
    "poisson_sampling",
)
"""Fields every record has held since the first release; a record without one is refused."""

REQUIRED_LEDGER_FIELDS = ("accountant", "history")
"""Fields of the ledger's own state (:meth:`PrivacyLedger.state_dict`) that ε is computed from."""


class NoPrivacyRecord(ValueError):
    """A checkpoint without a privacy record: it was not written by a dplightning DP strategy."""


class IncompletePrivacyRecord(ValueError):
    """A privacy record without a field the guarantee depends on (truncated or edited by hand)."""


@dataclass(frozen=True, kw_only=True)
class PrivacyRecord:
    """The public privacy state of a DP run, as its checkpoints store it (fields in the stored order).

    Args:
        ledger: The ledger's state: ``{"version", "accountant", "history": [(σ, q, steps), ...]}``.
        noise_multiplier: σ of the gradient (``None``: not calibrated yet).
        target_epsilon: The ε the run was calibrated for, if any.
        max_grad_norm: The clipping bound C.
        sample_rate: Poisson rate q of the train loader (``None``: not known yet).
        num_samples: The training set size N.
        delta: δ of the guarantee.
        clipping: The clipping mode as configured.
        poisson_sampling: Whether batches were Poisson-sampled (otherwise ε is infinite).
        clipping_engine: The configured clipping engine.
        step_releases: Registered per-step releases besides the gradient: name -> σ_r.
        noise_mechanism: The noise mechanism and its public parameters (``None``: DP-SGD, as
            every record written before correlated noise).
        epsilon: The exact ε at ``delta`` when the record was written (``None``: not stored).
        accountant: The accountant the run was configured with.
        secure_mode: Whether noise and sampling came from the OS CSPRNG.
        seeded: Whether a test seed fixed the noise (never the seed itself).
        world_size: Processes of the run.
        rows_per_unit: Forward rows per privacy unit.
        privacy_unit: The unit the data declares (``{description, window, stride, rows_per_unit}``).
        not_covered: What the data computed outside the DP steps: name -> text.
        layer_engines: The clipping engine of every hooked layer.
        nonfinite_examples: Examples whose per-example gradient was not finite: read from records
            written before this count was kept out of them (a raw count of the private data, not
            released with noise); never written now.
        versions: Library versions the record was written with.
        run_id: Names the run's privacy journal (:mod:`dplightning.strategies.journal`).
    """

    ledger: Mapping[str, Any]
    noise_multiplier: float | None
    target_epsilon: float | None
    max_grad_norm: float
    sample_rate: float | None
    num_samples: int | None
    delta: float | None
    clipping: str
    poisson_sampling: bool
    clipping_engine: str | None = None
    step_releases: Mapping[str, float] = field(default_factory=dict)
    noise_mechanism: Mapping[str, Any] | None = None
    epsilon: float | None = None
    accountant: str | None = None
    secure_mode: bool | None = None
    seeded: bool | None = None
    world_size: int | None = None
    rows_per_unit: int = 1
    privacy_unit: Mapping[str, Any] | None = None
    not_covered: Mapping[str, str] = field(default_factory=dict)
    layer_engines: Mapping[str, str] = field(default_factory=dict)
    nonfinite_examples: int | None = None
    versions: Mapping[str, str | None] = field(default_factory=dict)
    run_id: str | None = None

    # ------------------------------------------------------------------ the writer

    def to_dict(self) -> dict[str, Any]:
        """The record as the checkpoint stores it: plain values only, copied."""
        return {f.name: copy.deepcopy(_plain(getattr(self, f.name))) for f in fields(self)}

    def store_in(self, checkpoint: dict[str, Any]) -> None:
        """Write the record into ``checkpoint`` (replacing any record it held)."""
        checkpoint[CHECKPOINT_KEY] = self.to_dict()

    # ------------------------------------------------------------------ the reader

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, Any]) -> PrivacyRecord:
        """The record of a loaded checkpoint.

        Raises:
            NoPrivacyRecord: If the checkpoint holds none (not trained by a DP strategy).
            IncompletePrivacyRecord: If it lacks a field of :data:`REQUIRED_FIELDS`.
        """
        record = cls.find(checkpoint)
        if record is None:
            raise NoPrivacyRecord(
                f"The checkpoint has no privacy ledger ('{CHECKPOINT_KEY}' entry): it was not written by a "
                "dplightning DP strategy."
            )
        return record

    @classmethod
    def find(cls, checkpoint: Mapping[str, Any]) -> PrivacyRecord | None:
        """The record of a loaded checkpoint, ``None`` if it holds none.

        Raises:
            IncompletePrivacyRecord: If the record lacks a field of :data:`REQUIRED_FIELDS`.
        """
        entry = checkpoint.get(CHECKPOINT_KEY)
        return cls.from_dict(entry) if entry else None

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> PrivacyRecord:
        """The record from the dict :meth:`to_dict` wrote (or any earlier version of it).

        Fields this version does not know are left out; fields an earlier version did not
        write take their defaults.

        Raises:
            IncompletePrivacyRecord: If ``entry`` lacks a field of :data:`REQUIRED_FIELDS`.
        """
        if not isinstance(entry, Mapping):
            raise IncompletePrivacyRecord(f"The checkpoint's privacy record is a {type(entry).__name__}, not a dict.")
        ledger = entry.get("ledger")
        missing = [name for name in REQUIRED_FIELDS if name not in entry]
        if isinstance(ledger, Mapping):
            missing += [f"ledger.{name}" for name in REQUIRED_LEDGER_FIELDS if name not in ledger]
        elif "ledger" in entry:
            missing.append("ledger (not a dict)")
        if missing:
            raise IncompletePrivacyRecord(
                f"The checkpoint's privacy record lacks {', '.join(missing)}, which every record a dplightning DP "
                "strategy writes holds: it was truncated or edited, so no guarantee can be read from it."
            )
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in entry.items() if name in known}
        for name in ("step_releases", "not_covered", "layer_engines", "versions"):
            if name in values and values[name] is None:  # some earlier records wrote None for "none"
                del values[name]
        return cls(**copy.deepcopy(values))

    # ------------------------------------------------------------------ derived values

    @property
    def history(self) -> list[Any]:
        """The ledger's (σ, q, steps) segments, oldest first, as stored."""
        return list(self.ledger["history"])

    @property
    def ledger_accountant(self) -> str:
        """The accountant the ledger's ε is computed with."""
        return str(self.ledger["accountant"])

    @property
    def steps(self) -> int:
        """The compositions the ledger charges (the sum of its segments' steps)."""
        return sum(int(segment[2]) for segment in self.history)

    @property
    def unit(self) -> dict[str, Any]:
        """The privacy-unit record (records before the data declared units held ``rows_per_unit`` only)."""
        if isinstance(self.privacy_unit, Mapping):
            return dict(self.privacy_unit)
        return {"description": None, "window": None, "stride": None, "rows_per_unit": int(self.rows_per_unit or 1)}


def _plain(value: Any) -> Any:
    """``value`` with every mapping a plain dict (``weights_only`` loading rebuilds plain containers only)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
