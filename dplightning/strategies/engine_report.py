"""The clipping engine of every hooked layer: one line at setup, the table on request and in the log folder.

The table has a row per layer (38 for ResNet-18), too long to print on every fit. Setup
prints how many layers each engine handles and where the table is:
:meth:`DPStrategy.engine_table` and :data:`ENGINE_TABLE_FILE` in the trainer's log folder
(written when the trainer has a logger with a folder).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

ENGINE_TABLE_FILE = "dp_engines.txt"
"""Name of the engine table in the trainer's log folder."""

_KINDS = (
    (re.compile(r"book_keeping for T <= \d+, else instantiate"), "book_keeping or instantiate by T"),
    (re.compile(r"book_keeping \(ghost norm for T <= \d+\)"), "book_keeping"),
)
"""Engine descriptions whose per-layer threshold the one-line summary leaves to the table."""


def engine_kind(description: str) -> str:
    """The engine of a table row without its per-layer threshold (T: rows per example of a layer call)."""
    for pattern, kind in _KINDS:
        if pattern.fullmatch(description):
            return kind
    return description


def engine_summary(engines: list[str], table_at: list[str]) -> str:
    """One line: how many layers each engine handles, and where the full table is."""
    counts = Counter(engine_kind(e) for e in engines)
    kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    return f"Per-example gradients: {len(engines)} layers ({kinds}); engine per layer: {' or '.join(table_at)}"


def table_path(trainer: pl.Trainer) -> Path | None:
    """Where the table goes: the first logger's folder, ``None`` without a logger (call on every rank)."""
    if not trainer.loggers:
        return None
    folder = trainer.log_dir  # a collective under multi-process strategies
    return Path(folder) / ENGINE_TABLE_FILE if folder else None


def report_engines(table: str, engines: list[str], trainer: pl.Trainer, is_global_zero: bool) -> None:
    """Write ``table`` to the log folder (rank 0) and print the one-line summary.

    Args:
        table: The engine table (``PrivateStep.summary()``).
        engines: The engine column, one entry per hooked layer.
        trainer: The trainer being set up.
        is_global_zero: Whether this process writes.
    """
    path = table_path(trainer)
    if path is not None and is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"Per-example gradients, engine per layer:\n{table}\n")
    folder = str(path) if path is not None else f"{ENGINE_TABLE_FILE} in the log folder of a run with a logger"
    rank_zero_info(engine_summary(engines, ["strategy.engine_table()", folder]))
