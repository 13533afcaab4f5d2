"""benchmarks/_protocol.py: verdicts on arms with known differences, splits, resuming, pre-registration."""

from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from scipy import stats

GRID = [{"lr": 0.005}, {"lr": 0.01}, {"lr": 0.02}]


@pytest.fixture
def proto(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("_protocol")


def arm_fn(offset: float, noise: float, calls: list[tuple[str, float, int, str]], name: str) -> Callable[..., Any]:
    """A synthetic arm: a per-seed shared draw (paired) + offset + its own small noise; best at lr = 0.01."""

    def run(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        calls.append((name, hparams["lr"], seed, split))
        shared = random.Random(seed).gauss(0, 0.05)  # the same for every arm at this seed
        own = random.Random(f"{name}-{seed}-{split}").gauss(0, noise)
        penalty = 100 * (hparams["lr"] - 0.01) ** 2
        return {"accuracy": 0.7 + offset + shared + own - penalty, "loss": 1.0 - offset}

    return run


def experiment(proto: ModuleType, offset: float, calls: list, name: str = "t", **kw: Any) -> Any:
    arms = [proto.Arm("A", arm_fn(offset, 0.01, calls, "A"), GRID), proto.Arm("B", arm_fn(0.0, 0.01, calls, "B"), GRID)]
    return proto.Experiment(name=name, arms=arms, metric="accuracy", criteria=[proto.Criterion("A", "B")], **kw)


def run(proto: ModuleType, exp: Any, tmp_path: Path) -> dict[str, Any]:
    return proto.run_experiment(exp, out=tmp_path / f"{exp.name}.json", figures=tmp_path / "fig")


def test_known_difference_is_claimed_and_covered(proto: ModuleType, tmp_path: Path) -> None:
    result = run(proto, experiment(proto, 0.1, []), tmp_path)
    (pair,) = result["pairs"]
    assert pair["low"] > 0 and pair["low"] < 0.1 < pair["high"]
    assert pair["verdict"].startswith("A beats B")
    (criterion,) = result["criteria"]
    assert criterion["passed"] and criterion["verdict"].startswith("A beats B")
    assert {arm["hparams"]["lr"] for arm in result["arms"].values()} == {0.01}  # selection found the optimum
    assert (tmp_path / "t.md").read_text().count("A beats B") >= 2
    assert (tmp_path / "fig" / "t.png").stat().st_size > 0
    assert result["pairing"] == proto.PAIRING and "paired" in (tmp_path / "t.md").read_text()
    assert result["environment"]["dplightning"]["commit"] is not None and result["command"].startswith("python")


def test_equal_arms_are_not_claimed(proto: ModuleType, tmp_path: Path) -> None:
    result = run(proto, experiment(proto, 0.0, []), tmp_path)
    (pair,) = result["pairs"]
    assert pair["low"] < 0 < pair["high"]
    assert pair["verdict"].startswith("not shown at this scale") and "beats" not in pair["verdict"]
    assert not result["criteria"][0]["passed"]


def test_lower_is_better_metric_flips_the_claim(proto: ModuleType, tmp_path: Path) -> None:
    """On a loss, the arm with the lower values is the one that beats the other."""
    exp = experiment(proto, 0.1, [], name="loss")
    exp = proto.Experiment(name="loss", arms=exp.arms, metric="loss", higher_is_better=False,
                           criteria=[proto.Criterion("B", "A")])  # fmt: skip
    result = run(proto, exp, tmp_path)
    assert result["pairs"][0]["verdict"].startswith("A beats B")  # A's loss is 0.1 lower
    assert not result["criteria"][0]["passed"] and result["criteria"][0]["verdict"].startswith("A beats B")


def test_selection_never_sees_the_test_split(proto: ModuleType, tmp_path: Path) -> None:
    calls: list[tuple[str, float, int, str]] = []
    exp = experiment(proto, 0.1, calls, tuning_seeds=(100, 101))
    result = run(proto, exp, tmp_path)
    first_test = next(i for i, c in enumerate(calls) if c[3] == "test")
    selection, final = calls[:first_test], calls[first_test:]
    assert len(selection) == 2 * len(GRID) * 2 and {c[3] for c in selection} == {"val"}
    assert {c[3] for c in final} == {"test"} and {c[1] for c in final} == {0.01}
    assert sorted(c[2] for c in final) == sorted(2 * list(exp.final_seeds))
    for r in result["runs"]:
        assert r["split"] == ("val" if r["phase"] == "select" else "test")


def test_interval_matches_scipy_on_the_listed_runs(proto: ModuleType, tmp_path: Path) -> None:
    result = run(proto, experiment(proto, 0.1, [], final_seeds=range(7)), tmp_path)
    final = {(r["arm"], r["seed"]): r["metrics"]["accuracy"] for r in result["runs"] if r["phase"] == "final"}
    diffs = [final["A", s] - final["B", s] for s in range(7)]
    (pair,) = result["pairs"]
    assert pair["diffs"] == pytest.approx(diffs, abs=0)
    low, high = stats.t.interval(0.90, len(diffs) - 1, loc=statistics.fmean(diffs), scale=stats.sem(diffs))
    assert (pair["low"], pair["high"]) == pytest.approx((low, high), rel=1e-12)
    for name in ("A", "B"):
        values = [final[name, s] for s in range(7)]
        stored = result["arms"][name]["metrics"]["accuracy"]
        assert (stored["mean"], stored["sd"]) == pytest.approx((statistics.fmean(values), statistics.stdev(values)))


def test_interval_is_plain_floats_so_judgements_serialise(proto: ModuleType) -> None:
    """Comparisons against its ends are Python bools, which ``json.dumps`` accepts (numpy's are refused)."""
    interval = proto.paired_interval([0.1, 0.3, 0.2, 0.25])
    assert all(type(interval[k]) is float for k in ("mean", "sd", "low", "high"))
    json.dumps({"beats": interval["high"] < 1.0})


def crashing(fn: Callable[..., Any], after: int) -> Callable[..., Any]:
    """``fn`` that raises on its call number ``after + 1`` (a crashed run)."""
    count = [0]

    def run(*args: Any) -> Any:
        count[0] += 1
        if count[0] > after:
            raise RuntimeError("crash")
        return fn(*args)

    return run


def with_arm_a(proto: ModuleType, exp: Any, fn: Callable[..., Any], **kw: Any) -> Any:
    arms = [proto.Arm("A", fn, GRID), exp.arms[1]]
    return proto.Experiment(name=exp.name, arms=arms, metric=exp.metric, criteria=kw.get("criteria", exp.criteria))


def test_a_crashed_experiment_resumes_without_recomputing(proto: ModuleType, tmp_path: Path) -> None:
    calls: list[tuple[str, float, int, str]] = []
    exp = experiment(proto, 0.1, calls)
    reference = run(proto, experiment(proto, 0.1, [], name="t"), tmp_path / "ref")
    crashed = with_arm_a(proto, exp, crashing(exp.arms[0].run, after=len(GRID) + 2))  # crash in the final runs
    with pytest.raises(RuntimeError, match="crash"):
        run(proto, crashed, tmp_path)
    recorded = json.loads((tmp_path / "t.json").read_text())["runs"]
    assert len(recorded) == len(calls) and any(r["phase"] == "final" for r in recorded)  # all completed runs kept
    calls.clear()
    result = run(proto, exp, tmp_path)
    total = 2 * len(GRID) + 2 * 5
    assert len(calls) == total - len(recorded)  # only the missing runs ran
    assert len(result["runs"]) == total and result["pairs"][0]["diffs"] == reference["pairs"][0]["diffs"]
    calls.clear()
    run(proto, exp, tmp_path)
    assert calls == []  # a complete record reruns nothing


def test_criteria_cannot_change_once_final_runs_started(proto: ModuleType, tmp_path: Path) -> None:
    exp = experiment(proto, 0.1, [])
    with pytest.raises(RuntimeError, match="crash"):
        run(proto, with_arm_a(proto, exp, crashing(exp.arms[0].run, after=len(GRID) + 1)), tmp_path)
    assert json.loads((tmp_path / "t.json").read_text())["final_started"]["criteria"][0]["better"] == "A"
    changed = with_arm_a(proto, exp, exp.arms[0].run, criteria=[proto.Criterion("B", "A")])
    with pytest.raises(proto.ProtocolError, match="criteria changed"):
        run(proto, changed, tmp_path)


def test_criteria_may_change_during_selection(proto: ModuleType, tmp_path: Path) -> None:
    exp = experiment(proto, 0.1, [])
    with pytest.raises(RuntimeError, match="crash"):
        run(proto, with_arm_a(proto, exp, crashing(exp.arms[0].run, after=1)), tmp_path)
    assert "final_started" not in json.loads((tmp_path / "t.json").read_text())
    result = run(proto, with_arm_a(proto, exp, exp.arms[0].run, criteria=[proto.Criterion("B", "A")]), tmp_path)
    assert result["final_started"]["criteria"][0]["better"] == "B" and not result["criteria"][0]["passed"]


def test_a_record_with_other_settings_is_refused(proto: ModuleType, tmp_path: Path) -> None:
    run(proto, experiment(proto, 0.1, []), tmp_path)
    with pytest.raises(proto.ProtocolError, match="new name"):
        run(proto, experiment(proto, 0.1, [], settings={"epsilon": 8}), tmp_path)


@pytest.mark.parametrize("kw", [{"final_seeds": (0, 1, 2, 3)}, {"final_seeds": (0, 0, 1, 2, 3)}, {"tuning_seeds": ()}])
def test_too_few_seeds_are_refused(proto: ModuleType, kw: dict[str, Any]) -> None:
    with pytest.raises(proto.ProtocolError):
        experiment(proto, 0.1, [], **kw)


def test_validation_split_is_carved_from_train(proto: ModuleType) -> None:
    train, val = proto.validation_split(100, 0.2, seed=3)
    assert len(val) == 20 and sorted(train + val) == list(range(100))
    assert proto.validation_split(100, 0.2, seed=3) == (train, val)


def test_a_diverged_grid_point_is_never_selected(proto: ModuleType, tmp_path: Path) -> None:
    """A run that diverges (NaN) loses the selection, also as the first grid point."""
    calls: list[tuple[str, float, int, str]] = []
    base = arm_fn(0.1, 0.01, calls, "A")

    def run_a(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return {"accuracy": float("nan")} if hparams["lr"] == 0.005 else base(hparams, seed, split)

    exp = with_arm_a(proto, experiment(proto, 0.1, calls), run_a)
    result = run(proto, exp, tmp_path)
    assert result["arms"]["A"]["hparams"] == {"lr": 0.01} and result["criteria"][0]["passed"]


def test_a_run_without_the_metric_is_refused(proto: ModuleType, tmp_path: Path) -> None:
    exp = with_arm_a(proto, experiment(proto, 0.1, []), lambda hparams, seed, split: {"loss": 1.0})
    with pytest.raises(proto.ProtocolError, match="without the metric 'accuracy'"):
        run(proto, exp, tmp_path)


def test_a_selection_at_the_end_of_its_grid_is_flagged(proto: ModuleType, tmp_path: Path) -> None:
    """Arm A's optimum (lr 0.02) is the grid's last point: flagged in the JSON and the markdown; B's is inside."""
    calls: list[tuple[str, float, int, str]] = []
    base = arm_fn(0.1, 0.01, calls, "A")

    def run_a(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return {"accuracy": base(hparams, seed, split)["accuracy"] + 10 * hparams["lr"]}  # rises along the grid

    result = run(proto, with_arm_a(proto, experiment(proto, 0.1, calls), run_a), tmp_path)
    assert result["selection"]["A"]["at_grid_edge"] and not result["selection"]["B"]["at_grid_edge"]
    table = (tmp_path / "t.md").read_text()
    assert "optimum maybe outside it): A." in table and "| A | lr=0.02 | " in table and "yes (grid edge)" in table


def test_forked_workers_give_the_same_record_as_one_process(proto: ModuleType, tmp_path: Path) -> None:
    base = arm_fn(0.1, 0.01, [], "A")

    def run_a(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return {**base(hparams, seed, split), "pid": os.getpid()}

    serial = run(proto, with_arm_a(proto, experiment(proto, 0.1, [], name="serial"), run_a), tmp_path)
    parallel = proto.run_experiment(
        with_arm_a(proto, experiment(proto, 0.1, [], name="parallel"), run_a),
        out=tmp_path / "parallel.json", figures=tmp_path, workers=2,
    )  # fmt: skip
    pids = {r["metrics"]["pid"] for r in parallel["runs"] if r["arm"] == "A"}
    assert os.getpid() not in pids and len(pids) >= 2  # forked workers ran them, two at a time

    def runs(record: dict[str, Any]) -> list[tuple]:
        keys = ("phase", "arm", "seed")
        return sorted((*(r[k] for k in keys), r["hparams"]["lr"], r["metrics"]["accuracy"]) for r in record["runs"])

    assert len(parallel["runs"]) == 2 * 3 + 2 * 5 and runs(parallel) == runs(serial)
    assert parallel["selection"] == serial["selection"] and parallel["criteria"] == serial["criteria"]
    assert {r["phase"] for r in json.loads((tmp_path / "parallel.json").read_text())["runs"]} == {"select", "final"}
    with pytest.raises(proto.ProtocolError, match="workers"):
        proto.run_experiment(experiment(proto, 0.1, [], name="w0"), out=tmp_path / "w0.json", workers=0)


@pytest.mark.parametrize(
    ("offset", "noise", "passes"), [(-0.01, 0.01, True), (-0.035, 0.001, False), (-0.1, 0.01, False)]
)
def test_non_inferiority_needs_the_mean_and_the_bound_within_their_margins(
    proto: ModuleType, tmp_path: Path, offset: float, noise: float, passes: bool
) -> None:
    """A = B + offset (± noise), margins 0.03 on the mean and 0.05 on the lower bound.

    At -0.035 with little noise the bound (about -0.036) clears -0.05 but the mean misses -0.03.
    """
    criterion = proto.Criterion("A", "B", margin=0.05, mean_margin=0.03)
    exp = proto.Experiment(
        name="ni", metric="accuracy", criteria=[criterion],
        arms=[proto.Arm("A", arm_fn(offset, noise, [], "A"), GRID), proto.Arm("B", arm_fn(0.0, noise, [], "B"), GRID)],
    )  # fmt: skip
    result = run(proto, exp, tmp_path)
    c = result["criteria"][0]
    assert c["passed"] is passes and c["margin"] == 0.05 and "non-inferior" in c["text"]
    if offset == -0.035:
        assert c["lower_bound"] > -0.05  # the mean alone fails it
    assert ("is non-inferior to B" in c["verdict"]) is passes
    pair = result["pairs"][0]
    assert c["lower_bound"] == pytest.approx(pair["low"]) and abs(pair["mean"] - offset) < 0.02


def test_non_inferiority_on_a_loss_uses_the_improvement(proto: ModuleType, tmp_path: Path) -> None:
    """Lower is better: A's loss 0.01 above B's is a -0.01 improvement, non-inferior at a 0.05 margin."""

    def loss_arm(offset: float, name: str) -> Callable[..., Any]:
        def run_(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
            shared = random.Random(seed).gauss(0, 0.05)
            return {"loss": 1.0 + offset + shared + random.Random(f"{name}-{seed}").gauss(0, 0.005)}

        return run_

    exp = proto.Experiment(
        name="ni_loss", metric="loss", higher_is_better=False,
        criteria=[proto.Criterion("A", "B", margin=0.05), proto.Criterion("A", "B")],
        arms=[proto.Arm("A", loss_arm(0.01, "A"), GRID[:1]), proto.Arm("B", loss_arm(0.0, "B"), GRID[:1])],
    )  # fmt: skip
    non_inferior, superior = run(proto, exp, tmp_path)["criteria"]
    assert non_inferior["passed"] and -0.05 < non_inferior["lower_bound"] < 0
    assert not superior["passed"] and "not shown at this scale" in superior["verdict"]
    with pytest.raises(proto.ProtocolError, match="margin"):
        proto.Criterion("A", "B", mean_margin=0.03)


def three_arms(proto: ModuleType, name: str, calls: list, settings: dict[str, Any], c_offset: float = 0.05) -> Any:
    """Arms A and B as in :func:`experiment` plus a new arm C; B is the arm another record lends."""
    arms = [proto.Arm(n, arm_fn(o, 0.01, calls, n), GRID) for n, o in (("B", 0.0), ("C", c_offset))]
    return proto.Experiment(name=name, arms=arms, metric="accuracy", criteria=[proto.Criterion("C", "B")],
                            settings=settings)  # fmt: skip


def test_a_borrowed_arm_is_not_rerun_and_gives_the_record_it_would_have(proto: ModuleType, tmp_path: Path) -> None:
    settings = {"data": "x", "arms": {"A": "adam", "B": "muon"}}
    run(proto, experiment(proto, 0.0, [], name="old", settings=settings), tmp_path)
    calls: list = []
    new_settings = {"data": "x", "arms": {"B": "muon", "C": "grape"}}
    borrowed = proto.run_experiment(
        three_arms(proto, "new", calls, new_settings), out=tmp_path / "new.json", figures=tmp_path,
        borrow={"B": tmp_path / "old.json"},
    )  # fmt: skip
    # B ran once here, the recheck of its first final seed on the test split; C ran fully.
    assert [c for c in calls if c[0] == "B"] == [("B", 0.01, 0, "test")]
    assert borrowed["borrowed"]["B"]["recheck"]["reproduced"] is True
    assert all(r.get("borrowed_from", {}).get("experiment") == "old" for r in borrowed["runs"] if r["arm"] == "B"
               and r["phase"] != "recheck")  # fmt: skip
    fresh = run(proto, three_arms(proto, "fresh", [], new_settings), tmp_path)
    assert borrowed["arms"] == fresh["arms"] and borrowed["criteria"] == fresh["criteria"]
    assert "borrowed from `old.json`" in (tmp_path / "new.md").read_text()


def test_borrowing_from_another_setting_or_an_unreproducible_run_is_refused(proto: ModuleType, tmp_path: Path) -> None:
    run(proto, experiment(proto, 0.0, [], name="old", settings={"data": "x", "arms": {"B": "muon"}}), tmp_path)
    old = tmp_path / "old.json"
    for settings, why in (({"data": "y", "arms": {"B": "muon"}}, "settings"),
                          ({"data": "x", "arms": {"B": "muon-flat"}}, "arm_settings")):  # fmt: skip
        with pytest.raises(proto.ProtocolError, match=why):
            proto.run_experiment(three_arms(proto, "n", [], settings), out=tmp_path / "n.json", borrow={"B": old})
    record = json.loads(old.read_text())
    for r in record["runs"]:  # the lender's final runs no longer match what the arm gives now
        if r["arm"] == "B" and r["phase"] == "final":
            r["metrics"]["accuracy"] += 0.001
    old.write_text(json.dumps(record))
    with pytest.raises(proto.ProtocolError, match="not reproducible"):
        proto.run_experiment(three_arms(proto, "m", [], {"data": "x", "arms": {"B": "muon"}}),
                             out=tmp_path / "m.json", borrow={"B": old})  # fmt: skip
    record["status"] = "final"
    old.write_text(json.dumps(record))
    with pytest.raises(proto.ProtocolError, match="not complete"):
        proto.run_experiment(three_arms(proto, "k", [], {"data": "x", "arms": {"B": "muon"}}),
                             out=tmp_path / "k.json", borrow={"B": old})  # fmt: skip


def test_an_experiment_states_its_own_pairing(proto: ModuleType, tmp_path: Path) -> None:
    """Arms that sample differently must not be described as sharing batches and noise."""
    exp = experiment(proto, 0.1, [], name="own")
    own = proto.Experiment(name="own", arms=exp.arms, metric="accuracy", criteria=exp.criteria,
                           pairing="seed s shares the model init only")  # fmt: skip
    record = run(proto, own, tmp_path)
    text = (tmp_path / "own.md").read_text()
    assert record["pairing"] == "seed s shares the model init only" and "shares the model init only" in text
    assert proto.PAIRING not in text


def test_a_fixed_arm_makes_no_selection_run_and_says_why(proto: ModuleType, tmp_path: Path) -> None:
    calls: list = []
    why = "selected by experiment X"
    arms = [
        proto.Arm("A", arm_fn(0.1, 0.01, calls, "A"), GRID),
        proto.Arm("B", arm_fn(0.0, 0.01, calls, "B"), GRID[1:2], fixed=why),
    ]
    exp = proto.Experiment(name="fixed", arms=arms, metric="accuracy", criteria=[proto.Criterion("A", "B")])
    record = run(proto, exp, tmp_path)
    assert not [c for c in calls if c[0] == "B" and c[3] == "val"]
    assert len([c for c in calls if c[0] == "A" and c[3] == "val"]) == len(GRID)
    assert record["selection"]["B"] == {"hparams": GRID[1], "val_mean": None, "grid": [], "at_grid_edge": False,
                                        "fixed": why}  # fmt: skip
    assert [c[2] for c in calls if c[0] == "B"] == list(exp.final_seeds)
    assert f"B (lr=0.01): no selection run, {why}." in (tmp_path / "fixed.md").read_text()


def test_a_one_point_grid_is_still_tuned_unless_fixed(proto: ModuleType, tmp_path: Path) -> None:
    calls: list = []
    arms = [
        proto.Arm("A", arm_fn(0.1, 0.01, calls, "A"), GRID[1:2]),
        proto.Arm("B", arm_fn(0.0, 0.01, calls, "B"), GRID),
    ]
    record = run(proto, proto.Experiment(name="one", arms=arms, metric="accuracy", criteria=[]), tmp_path)
    assert [c for c in calls if c[0] == "A" and c[3] == "val"] and record["selection"]["A"]["grid"]
    with pytest.raises(proto.ProtocolError, match="fixed= needs"):
        proto.Arm("C", arm_fn(0.0, 0.01, calls, "C"), GRID[1:2], fixed="")
    with pytest.raises(proto.ProtocolError, match="exactly one grid point"):
        proto.Arm("C", arm_fn(0.0, 0.01, calls, "C"), GRID, fixed="why")


def test_a_replication_reruns_the_selected_points_on_new_seeds_only(proto: ModuleType, tmp_path: Path) -> None:
    """Issue 44: a fragile result is replicated on new seeds, with nothing tuned again."""
    calls: list = []
    original = experiment(proto, 0.02, calls)
    first = run(proto, original, tmp_path)
    calls.clear()
    again = proto.replication(original, tmp_path / "t.json", seeds=[10, 11, 12, 13, 14])
    record = run(proto, again, tmp_path)
    assert not [c for c in calls if c[3] == "val"]  # no selection run
    assert sorted({c[2] for c in calls}) == [10, 11, 12, 13, 14]
    assert {c[1] for c in calls} == {first["selection"][a]["hparams"]["lr"] for a in ("A", "B")}
    assert record["experiment"] == "t_replication" and record["identity"]["settings"]["replicates"]["digest"]
    assert [c["text"] for c in record["criteria_registered"]] == [c["text"] for c in first["criteria_registered"]]
    with pytest.raises(proto.ProtocolError, match="new seeds"):
        proto.replication(original, tmp_path / "t.json", seeds=[0, 10, 11, 12, 13])
    with pytest.raises(proto.ProtocolError, match="another experiment"):
        proto.replication(experiment(proto, 0.02, calls, name="other"), tmp_path / "t.json", seeds=range(10, 15))


def test_a_comparison_nobody_registered_is_described_never_claimed(proto: ModuleType, tmp_path: Path) -> None:
    """Issue 44: generated tables printed "A beats B" for pairs without a pre-registered criterion."""
    calls: list = []
    arms = [proto.Arm(n, arm_fn(off, 0.005, calls, n), GRID) for n, off in (("A", 0.2), ("B", 0.0), ("C", 0.1))]
    exp = proto.Experiment(name="three", arms=arms, metric="accuracy", criteria=[proto.Criterion("A", "B")])
    record = run(proto, exp, tmp_path)
    verdicts = {(p["a"], p["b"]): p["verdict"] for p in record["pairs"]}
    assert verdicts["A", "B"].startswith("A beats B")
    assert verdicts["A", "C"].startswith("not registered") and "beats" not in verdicts["A", "C"]
    assert (
        "C beats" not in (tmp_path / "three.md").read_text() and "A beats C" not in (tmp_path / "three.md").read_text()
    )
