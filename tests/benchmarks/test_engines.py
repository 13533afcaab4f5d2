"""engines.py's Lightning runners: what they ask of the Trainer."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch


@pytest.mark.parametrize(("runner", "accelerator", "asked"), [
    ("dp_auto_replay", "gpu", "warn"), ("dp_auto", "gpu", None), ("dp_auto_replay", "cpu", None),
])  # fmt: skip
def test_the_replay_runner_asks_for_deterministic_kernels_on_a_gpu_for_its_own_fit_only(
    benchmark_module: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, runner: str, accelerator: str,
    asked: str | None,
) -> None:  # fmt: skip
    """The replay refuses a second backward pass that differs bit for bit: on a GPU that needs deterministic kernels."""
    engines = benchmark_module("engines")
    seen: dict[str, Any] = {}

    class Trainer:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)

        def fit(self, *args: Any) -> None:  # as Lightning does for deterministic="warn"
            if seen["deterministic"] == "warn":
                torch.use_deterministic_algorithms(True, warn_only=True)

    monkeypatch.setattr(engines, "quiet_trainer", Trainer)
    place = engines.Placement.__new__(engines.Placement)  # no CUDA here: skip the device, keep the field
    object.__setattr__(place, "accelerator", accelerator)
    object.__setattr__(place, "precision", "32-true")
    monkeypatch.setattr(engines.Placement, "synchronize", lambda self: None)
    w = engines.WORKLOADS["mlp_mnist"]
    engines._lightning(runner, w.build(), w, None, 1, "flat", place)
    assert seen["deterministic"] == asked
    assert not torch.are_deterministic_algorithms_enabled()  # the next runner starts as before
