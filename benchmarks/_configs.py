"""The YAML pieces the method experiments build their runs from: optimizer overlays and config digests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def optimizer_overlay(init_args: Mapping[str, Any], class_path: str | None = None) -> str:
    """A YAML config that sets the optimizer's ``init_args`` (and ``class_path`` if given).

    A YAML overlay rather than command-line overrides: it keeps typed values, ``None`` included,
    which jsonargparse cannot take on the command line.
    """
    optimizer: dict[str, Any] = {"init_args": dict(init_args)}
    if class_path is not None:
        optimizer["class_path"] = class_path
    return yaml.safe_dump({"model": {"init_args": {"optimizer": optimizer}}}, sort_keys=True)


# Renamed packages whose old path still imports the same classes (issue 26: ``modules/`` became ``tasks/``).
RENAMED = {"dplightning.tasks.": "dplightning.modules."}


def config_digest(path: str | Path) -> str:
    """The parsed config at ``path`` (relative to the repository root; comments ignored), as sorted JSON.

    Part of an experiment's settings, so that a changed config cannot resume an old record. A class path
    under a renamed package is written by its old name (:data:`RENAMED`): it names the same class, and the
    records made before the rename keep their identity.
    """
    return json.dumps(_old_names(yaml.safe_load((ROOT / path).read_text())), sort_keys=True)


def _old_names(value: Any) -> Any:
    """``value`` (a parsed config) with every string that starts with a renamed package's new path given its old."""
    if isinstance(value, dict):
        return {key: _old_names(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_old_names(item) for item in value]
    if isinstance(value, str):
        for new, old in RENAMED.items():
            if value.startswith(new):
                return old + value[len(new) :]
    return value
