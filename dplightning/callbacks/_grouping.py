"""Parameter groups for :class:`~dplightning.callbacks.GradientTailStats`: by name pattern or by module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

ALL, REST = "all", "rest"
GroupPatterns = Mapping[str, str | Sequence[str]]
"""Group name -> glob pattern(s) on parameter names, e.g. ``{"cond": ["*.t_embedder.*", "*adaLN*"]}``."""


def parameter_groups(names: Sequence[str], patterns: GroupPatterns | None) -> dict[str, list[int]]:
    """Column indices (into ``names``) of each group, ending with ``"all"``.

    Args:
        names: Privatized parameter names, in the column order of the per-parameter norms.
        patterns: Glob patterns per group (``fnmatch``; ``*`` also matches dots). Parameters
            matched by no pattern form ``"rest"``; groups may overlap. ``None``: one group
            per top-level module (see :func:`module_groups`).

    Raises:
        ValueError: If a group is named ``"all"``/``"rest"`` or matches no parameter.
    """
    groups = module_groups(names) if patterns is None else _pattern_groups(names, patterns)
    return {**groups, ALL: list(range(len(names)))}


def _pattern_groups(names: Sequence[str], patterns: GroupPatterns) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for group, pats in patterns.items():
        if group in (ALL, REST):
            raise ValueError(f"Group name {group!r} is reserved.")
        pats = [pats] if isinstance(pats, str) else list(pats)
        groups[group] = [i for i, n in enumerate(names) if any(fnmatchcase(n, p) for p in pats)]
        if not groups[group]:
            raise ValueError(f"Group {group!r} ({pats}) matches no privatized parameter; names look like {names[:3]}.")
    matched = {i for cols in groups.values() for i in cols}
    rest = [i for i in range(len(names)) if i not in matched]
    return {**groups, REST: rest} if rest else groups


def module_groups(names: Sequence[str]) -> dict[str, list[int]]:
    """One group per top-level module, below the modules all parameters share.

    ``model.features.0.weight`` and ``model.head.bias`` give ``model.features`` and
    ``model.head``: the LightningModule's single wrapper attribute (``model``) is skipped.
    """
    paths = [n.split(".")[:-1] for n in names]
    common = 0
    while paths and all(len(p) > common + 1 and p[common] == paths[0][common] for p in paths):
        common += 1
    groups: dict[str, list[int]] = {}
    for i, (name, path) in enumerate(zip(names, paths, strict=True)):
        key = ".".join(path[: common + 1]) or name
        groups.setdefault(key, []).append(i)
    return groups
