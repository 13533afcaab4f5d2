"""Moved to :mod:`dplightning.commands.calibrate` (issue 26: the commands live together); still importable here."""

from dplightning.commands.calibrate import main

__all__ = ["main"]
