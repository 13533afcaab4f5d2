"""The fault process (issue 24 item 4): exact share, seeded plans, clean targets, p = 0 unchanged, faulted test set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dplightning.data import ETTDataModule
from dplightning.data.ett import WindowDataset
from dplightning.data.faults import Fault, FaultedWindows, FaultProcess, faulted_rows
from tests.data.test_ett import ETTH1, MONTH, write_csv

IN, H = 8, 4


def windows(n: int = 200, length: int = IN + H, k: int = 7, seed: int = 0) -> WindowDataset:
    series = torch.randn(n + length - 1, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return WindowDataset(series, length)


@pytest.mark.parametrize("rate", [0.01, 0.03, 0.5, 1.0])
def test_exactly_round_p_n_windows_are_faulted_and_the_plan_is_seeded(rate: float) -> None:
    process = FaultProcess(rate=rate, seed=7)
    plan = process.plan(1000, 7)
    assert len(plan) == round(rate * 1000) and all(0 <= i < 1000 for i in plan)
    assert plan == FaultProcess(rate=rate, seed=7).plan(1000, 7)  # same seed, same plan
    assert plan != FaultProcess(rate=rate, seed=8).plan(1000, 7)
    assert plan != process.plan(1000, 7, stream="test")  # the test split draws its own plan
    assert all(0 <= f.channel < 7 for f in plan.values())


def test_a_plan_depends_on_no_data_value() -> None:
    """The plan is drawn before any window is read: two data sets of the same shape get the same faults."""
    process = FaultProcess(rate=0.03, seed=1)
    a = FaultedWindows(windows(seed=0), process, IN)
    b = FaultedWindows(windows(seed=1), process, IN)
    assert a.faults == b.faults and len(a.faults) == round(0.03 * len(a))


def test_kinds_and_sizes_follow_the_pre_registered_ranges() -> None:
    plan = FaultProcess(rate=1.0, seed=0, unit_factors=(10.0, 0.1)).plan(3000, 7)
    by_kind = {kind: [f for f in plan.values() if f.kind == kind] for kind in ("level", "unit", "missing")}
    assert all(800 < len(faults) < 1200 for faults in by_kind.values())  # uniform over the three kinds
    assert all(5.0 <= abs(f.value) <= 20.0 for f in by_kind["level"])
    assert 0.4 < sum(f.value > 0 for f in by_kind["level"]) / len(by_kind["level"]) < 0.6  # both signs
    assert {f.value for f in by_kind["unit"]} == {10.0, 0.1} and {f.value for f in by_kind["missing"]} == {0.0}
    assert {f.channel for f in plan.values()} == set(range(7))
    only = FaultProcess(rate=1.0, kinds=("unit",)).plan(50, 7)
    assert {f.kind for f in only.values()} == {"unit"}


@pytest.mark.parametrize(
    "fault", [Fault("level", 2, -7.5), Fault("unit", 2, 10.0), Fault("missing", 2, 0.0)], ids=lambda f: f.kind
)
def test_a_fault_hits_one_channels_context_only_and_the_clean_copy_stays(fault: Fault) -> None:
    clean_set = windows(n=5)
    data = FaultedWindows(clean_set, FaultProcess(rate=0.0), IN)
    data.faults = {3: fault}
    x, observed, clean = data[3]
    assert torch.equal(clean, clean_set[3])  # the target copy is the clean window
    assert torch.equal(x[IN:], clean[IN:]) and observed[IN:].eq(1).all()  # the horizon is never touched
    others = [c for c in range(7) if c != 2]
    assert torch.equal(x[:, others], clean[:, others]) and observed[:, others].eq(1).all()
    expected = {"level": clean[:IN, 2] - 7.5, "unit": clean[:IN, 2] * 10.0, "missing": torch.zeros(IN)}[fault.kind]
    torch.testing.assert_close(x[:IN, 2], expected.float())
    assert observed[:IN, 2].eq(0 if fault.kind == "missing" else 1).all()
    x0, observed0, clean0 = data[0]  # a window without a fault: the window, a mask of ones and the window
    assert torch.equal(x0, clean0) and observed0.eq(1).all()
    assert faulted_rows([torch.stack(v) for v in zip(data[0], data[3], strict=True)]).tolist() == [False, True]


def test_invalid_processes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"fault rate must be in \[0, 1\]"):
        FaultProcess(rate=1.5)
    with pytest.raises(ValueError, match="non-empty subset"):
        FaultProcess(kinds=("spike",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="level_range"):
        FaultProcess(level_range=(5.0, 1.0))


# ------------------------------------------------------------------ in the ETT data module


def ett(tmp_path: Path, task: str = "forecasting", **faults: Any) -> ETTDataModule:
    write_csv(tmp_path / "ETTh1.csv")
    dm = ETTDataModule(str(tmp_path / "ETTh1.csv"), task=task, input_len=IN, horizon=H, rows_per_month=MONTH,  # type: ignore[arg-type]
                       max_test_windows=20, **faults)  # fmt: skip
    dm.setup()
    return dm


def test_rate_zero_gives_todays_windows_exactly(tmp_path: Path) -> None:
    plain, zero = ett(tmp_path), ett(tmp_path, fault_rate=0.0, test_fault_rate=0.0, fault_seed=3)
    for name in ("train_set", "val_set", "test_set"):
        a, b = getattr(plain, name), getattr(zero, name)
        assert type(a) is type(b) is WindowDataset
        assert all(torch.equal(a[i], b[i]) for i in range(len(a)))
    assert zero.dp_privacy_unit == plain.dp_privacy_unit


@pytest.mark.parametrize(("task", "context"), [("forecasting", IN), ("imputation", IN)])
def test_training_windows_get_faults_validation_never_and_the_test_set_its_own(
    tmp_path: Path, task: str, context: int
) -> None:
    plain = ett(tmp_path, task)
    dm = ett(tmp_path, task, fault_rate=0.03, test_fault_rate=1.0, fault_seed=0)
    assert isinstance(dm.train_set, FaultedWindows) and isinstance(dm.test_set, FaultedWindows)
    assert dm.train_set.context_len == context == dm.context_len
    n = len(plain.train_set)
    assert len(dm.train_set) == n and len(dm.train_set.faults) == round(0.03 * n)
    for i in range(n):  # the clean copy is today's window; faults only where planned
        x, observed, clean = dm.train_set[i]
        assert torch.equal(clean, plain.train_set[i])
        assert (i in dm.train_set.faults) == bool(faulted_rows([x[None], observed[None], clean[None]]))
    assert type(dm.val_set) is WindowDataset and all(torch.equal(dm.val_set[i], plain.val_set[i]) for i in range(5))
    assert len(dm.test_set.faults) == len(dm.test_set) == 20  # rate 1: every test window is faulted
    assert dm.dp_privacy_unit == plain.dp_privacy_unit  # still one training window


def test_faulted_batches_collate_and_reach_the_dp_loader(tmp_path: Path) -> None:
    dm = ett(tmp_path, fault_rate=0.5)
    x, observed, clean = next(iter(dm.train_dataloader()))
    assert x.shape == observed.shape == clean.shape == (64, IN + H, 7)


@pytest.mark.skipif(not ETTH1.exists(), reason="ETTh1.csv not found in ../shared/data/ett/ (real-data check)")
def test_real_etth1_pre_registered_rates() -> None:
    for rate in (0.01, 0.03):
        dm = ETTDataModule(str(ETTH1), input_len=96, horizon=96, fault_rate=rate)
        dm.setup()
        assert isinstance(dm.train_set, FaultedWindows) and len(dm.train_set.faults) == round(rate * 8449)
