"""No ``assert`` statement in the package: ``python -O`` strips them, and a privacy check must not vanish."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dplightning
from dplightning._state import StateError, known

PACKAGE = Path(dplightning.__file__).parent


def test_the_package_has_no_assert_statements() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Assert)
    ]
    assert not found, f"replace these by explicit errors (dplightning._state.known): {found}"


def test_known_names_what_is_missing() -> None:
    assert known(3, "a count") == 3
    with pytest.raises(StateError, match="the Trainer is not set"):
        known(None, "the Trainer")
