"""What an optimizer's ``exclude`` patterns mean: one rule for :class:`DPGrape` and :class:`DPMuon`.

A parameter is excluded when any pattern matches any of its names: its own name
(``model.lm_head.weight``) or the name of a module that owns it (``model.lm_head``; a tied
parameter has several owners). A pattern is matched as follows:

* a pattern with a shell wildcard (``*``, ``?`` or ``[...]``) is an :mod:`fnmatch` pattern
  that must match the whole name (``*head*``, ``encoder.layer.0.*``);
* a pattern without one matches any name that contains it, as if written ``*pattern*``
  (``"head"`` is ``"*head*"``); DP-Muon's name fragments (``"embed"``, ``"wte"``, ...) keep
  the meaning they always had;
* case does not matter (``"Head"`` matches ``lm_head``), on every platform.

Before this rule, DP-GRAPE matched its patterns case-sensitively against module names only,
so a pattern without a wildcard had to be a whole module name; DP-Muon looked for each
pattern as a substring of the lower-cased parameter name, and wildcards had no meaning.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

_WILDCARDS = frozenset("*?[")


def as_fnmatch(pattern: str) -> str:
    """The fnmatch pattern ``pattern`` stands for: itself if it has a wildcard, else ``*pattern*``."""
    return pattern if _WILDCARDS & set(pattern) else f"*{pattern}*"


def matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` matches ``name`` (see the module docstring)."""
    return fnmatch.fnmatchcase(name.lower(), as_fnmatch(pattern).lower())


def excluded(names: Iterable[str], patterns: Sequence[str]) -> bool:
    """Whether any pattern matches any of ``names`` (a parameter's name and its owning modules' names)."""
    names = list(names)
    return any(matches(name, pattern) for pattern in patterns for name in names)
