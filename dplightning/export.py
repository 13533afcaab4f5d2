"""Moved to :mod:`dplightning.commands.export` (issue 26: the commands live together); still importable here."""

from dplightning.commands.export import (
    SAFE_GLOBALS,
    TRUST_HELP,
    UnsafeCheckpoint,
    exit_status,
    export,
    load_checkpoint,
    load_module,
    main,
    privacy_of,
    task_class,
    unit_record,
)

__all__ = [
    "SAFE_GLOBALS",
    "TRUST_HELP",
    "UnsafeCheckpoint",
    "exit_status",
    "export",
    "load_checkpoint",
    "load_module",
    "main",
    "privacy_of",
    "task_class",
    "unit_record",
]
