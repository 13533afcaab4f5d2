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


def config_digest(path: str | Path) -> str:
    """The parsed config at ``path`` (relative to the repository root; comments ignored), as sorted JSON.

    Part of an experiment's settings, so that a changed config cannot resume an old record.
    """
    return json.dumps(yaml.safe_load((ROOT / path).read_text()), sort_keys=True)
