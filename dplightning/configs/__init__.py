"""The shipped configs (``configs/<task>/*.yaml`` in the repository), reachable by name from any folder.

``dplightning fit --config quickstart`` reads ``quickstart.yaml`` from the installed package when no
file of that name exists where the command runs; ``dplightning configs`` lists the names.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def names() -> list[str]:
    """Every shipped config, as the name ``--config`` takes (its path under the configs folder, no suffix)."""
    return sorted(p.relative_to(ROOT).with_suffix("").as_posix() for p in ROOT.rglob("*.yaml"))


def find(name: str) -> Path | None:
    """The shipped config ``name`` (``quickstart``, ``grape/digits.yaml``, ``configs/quickstart.yaml``), if any."""
    relative = name.removeprefix("configs/")
    for candidate in (relative, f"{relative}.yaml"):
        path = (ROOT / candidate).resolve()
        if path.is_relative_to(ROOT) and path.suffix == ".yaml" and path.is_file():
            return path
    return None
