"""``dplightning configs``: the configs shipped with the package, by the name ``--config`` takes."""

from __future__ import annotations

from dplightning.configs import names


def main(argv: list[str]) -> int:
    """List the shipped configs."""
    if argv:
        print("usage: dplightning configs   (lists the shipped configs; train with one: dplightning fit --config NAME)")
        return 0 if argv[0] in ("-h", "--help") else 2
    for name in names():
        print(name)
    return 0
