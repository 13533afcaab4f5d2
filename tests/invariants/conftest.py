"""Run the single-process invariants and the gradient-fidelity cases with every clipping engine."""

from __future__ import annotations

import pytest

from dplightning.privacy.grad_sample import available_engines
from tests import helpers

EVERY_ENGINE = ("test_single_device.py", "test_gradient_fidelity.py")
"""Modules whose tests run once per engine; the multi-process ones choose their engines themselves."""


REPLAYED = ("test_single_device.py",)
"""Modules whose tests also run with ``clip_replay`` (gradient fidelity replays inside its own reference check)."""


@pytest.fixture(autouse=True)
def clipping_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The clipping engine of the strategies the helpers build in this test (``<engine>-replay``: with clip_replay)."""
    engine = getattr(request, "param", "auto")
    name, _, replay = engine.partition("-")
    monkeypatch.setattr(helpers, "ENGINE", name)
    monkeypatch.setattr(helpers, "REPLAY", replay == "replay")
    return engine


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "clipping_engine" not in metafunc.fixturenames or metafunc.definition.path.name not in EVERY_ENGINE:
        return
    engines = available_engines()
    # Manual optimization runs its own backward passes: clip_replay refuses it.
    if metafunc.definition.path.name in REPLAYED and "manual_optimization" not in metafunc.definition.name:
        engines = [*engines, *(f"{e}-replay" for e in engines)]
    metafunc.parametrize("clipping_engine", engines, indirect=True)
