"""Moved to :mod:`dplightning.commands.report` (issue 26: the commands live together); still importable here."""

from dplightning.commands.report import DP_SGD, MATCH_RTOL, format_report, load_report, main, privacy_report

__all__ = ["DP_SGD", "MATCH_RTOL", "format_report", "load_report", "main", "privacy_report"]
