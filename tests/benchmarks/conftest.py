"""Fixtures shared by the tests of the benchmark scripts; every test here is marked ``lab`` (by folder)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def benchmark_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Imports a script of benchmarks/ by file name (the scripts import each other by file name).

    The folder stays on ``sys.path`` for the rest of the test, so a test body may import a script's
    neighbours (``engines``, ``_protocol``) directly.
    """
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The lab's tests (benchmark and protocol scripts, not the package) leave ``make test-fast``."""
    here = Path(__file__).resolve().parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.lab)
