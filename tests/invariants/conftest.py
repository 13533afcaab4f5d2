"""Run the single-process invariants and the gradient-fidelity cases with every clipping engine."""

from __future__ import annotations

import pytest

from dplightning.privacy.grad_sample import available_engines
from tests import helpers

EVERY_ENGINE = ("test_single_device.py", "test_gradient_fidelity.py")
"""Modules whose tests run once per engine; the multi-process ones choose their engines themselves."""


@pytest.fixture(autouse=True)
def clipping_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The clipping engine of the strategies the helpers build in this test."""
    engine = getattr(request, "param", "auto")
    monkeypatch.setattr(helpers, "ENGINE", engine)
    return engine


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "clipping_engine" in metafunc.fixturenames and metafunc.definition.path.name in EVERY_ENGINE:
        metafunc.parametrize("clipping_engine", available_engines(), indirect=True)
