"""benchmarks/overhead_breakdown.py: exclusive scopes that add up, the library restored, a smoke run."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dplightning.privacy import noise
from dplightning.privacy.grad_sample import grads, hooks
from dplightning.strategies import private_step


@pytest.fixture
def ob(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("overhead_breakdown")


def test_nested_scopes_are_exclusive_and_a_reentered_label_is_timed_once(ob: ModuleType) -> None:
    timer = ob.ExclusiveTimer()
    start = time.perf_counter()
    with timer.scope("glue"):
        time.sleep(0.02)
        with timer.scope("noise"):
            time.sleep(0.03)
            with timer.scope("noise"):  # Summed.sq_norms calling a part's sq_norms: one stretch, not two
                time.sleep(0.01)
        time.sleep(0.02)
    wall = time.perf_counter() - start
    assert timer.seconds["noise"] == pytest.approx(0.04, abs=0.015)
    assert timer.seconds["glue"] == pytest.approx(0.04, abs=0.015)
    assert sum(timer.seconds.values()) == pytest.approx(wall, abs=1e-3)  # they add up to the wall time


def test_the_instrumented_functions_are_put_back(ob: ModuleType) -> None:
    before = (noise.GaussianNoise.sample, grads.Factored.sq_norms, hooks._hookable, hooks.PerExampleHooks.pop,
              private_step.PrivateStep.release)  # fmt: skip
    with ob.instrumented(ob.ExclusiveTimer(), ob.HeldBytes()):
        assert noise.GaussianNoise.sample is not before[0] and hooks.PerExampleHooks.pop is not before[3]
    after = (noise.GaussianNoise.sample, grads.Factored.sq_norms, hooks._hookable, hooks.PerExampleHooks.pop,
             private_step.PrivateStep.release)  # fmt: skip
    assert after == before


def test_held_bytes_count_a_shared_storage_once(ob: ModuleType) -> None:
    a, d = torch.zeros(4, 3, 8), torch.zeros(4, 3, 2)
    held = ob.HeldBytes()
    held.record({0: grads.Factored(d, a, 2, torch.Size([2, 8])), 1: grads.Factored(d, a, 2, torch.Size([2, 8]))})
    assert held.per_pop == [(a.numel() + d.numel()) * 4]


@pytest.mark.e2e
def test_smoke_run_times_every_part_of_a_dp_step(ob: ModuleType, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        results = ob.main(["--smoke", "--threads", "1", "--out", str(tmp_path / "b.json")])
    finally:
        torch.set_num_threads(threads)
    r = results["mlp_mnist"]
    parts = r["parts_ms"]
    assert r["nonprivate_ms"] > 0 and r["dp_ms"] > 0 and r["held_mib"] > 0 and r["nonprivate_saved_mib"] > 0
    assert set(r["capture_by_layer_type_ms"]) == {"Linear"}
    for scope in ("noise", "norms", "clipped sums", "capture", "glue"):
        assert parts[scope] > 0, scope
    assert sum(parts.values()) == pytest.approx(r["dp_ms"])
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["benchmark"] == "overhead_breakdown" and "mlp_mnist" in record["results"]
    assert "| mlp_mnist (64) |" in (tmp_path / "b.md").read_text()
