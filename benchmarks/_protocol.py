"""The comparison protocol every method benchmark uses: tuned arms, paired seeds, pre-registered claims.

An experiment compares *arms* (e.g. DP-Adam and DP-Muon), each a callable
``run(hparams, seed, split) -> metric`` with a hyperparameter grid fixed before any run:

1. **Selection.** Every grid point of every arm runs on ``split="val"`` (rows carved from
   the *training* data, see :func:`validation_split`) for each tuning seed; each arm keeps the
   grid point with the best mean over the tuning seeds. The test split is never passed here.
   An arm declared ``fixed`` (one grid point chosen before the experiment, e.g. by another
   pre-registered experiment) makes no selection run, and the outputs give the reason.
2. **Final runs.** The pre-registered criteria are stored in the record before the first
   final run; then every arm runs at its selected hyperparameters on ``split="test"`` for the
   same ``>= 5`` final seeds. Runs are *paired*: seed ``s`` must give every arm the same Poisson
   sampling and noise seeds (fine for public benchmark data; the outputs say so), so the
   per-seed differences cancel the shared randomness.
3. **Results.** Per arm mean ± sd; per pair of arms the paired differences with a 90 %
   t-interval. A verdict says "A beats B" only when the lower 90 % bound of the improvement
   of A over B is above 0, else "not shown at this scale" with the interval.

Outputs per experiment (default folders from ``_outputs.py``): ``NAME.json`` (every run, the
split each number came from, provenance, criteria and verdicts), ``NAME.md`` (tables) and
``NAME.png`` (per-seed points per arm; paired differences with their intervals). The JSON is
rewritten after every run; rerunning the same experiment resumes, skipping recorded runs. A
record made with other settings (arms, grids, seeds, metric, ``settings``) is refused, and so
is a change of the criteria once the final runs have started.

Example (runs in a second; a real arm trains a model)::

    import random
    from _protocol import Arm, Criterion, Experiment, run_experiment

    def noisy(offset):
        def run(hparams, seed, split):
            rng = random.Random(seed)  # the same seed for every arm: paired
            return {"accuracy": 0.7 + offset - 100 * (hparams["lr"] - 0.01) ** 2 + rng.gauss(0, 0.02)}
        return run

    grid = [{"lr": 0.005}, {"lr": 0.01}, {"lr": 0.02}]
    experiment = Experiment(
        name="demo", metric="accuracy",
        arms=[Arm("A", noisy(0.1), grid), Arm("B", noisy(0.0), grid)],
        criteria=[Criterion("A", "B")],
    )
    result = run_experiment(experiment)  # writes outputs/benchmarks/demo.{json,md}, outputs/figures/demo.png
    print(result["criteria"][0]["verdict"])  # "A beats B: ..."
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Any

from _harness import provenance
from _outputs import default_figures, default_result
from scipy import stats

LEVEL = 0.90  # two-sided level of every paired interval; its lower bound decides a claim
MIN_FINAL_SEEDS = 5
SELECT, FINAL, RECHECK = "select", "final", "recheck"
VAL, TEST = "val", "test"
PAIRING = (
    "Final runs are paired: seed s gives every arm the same Poisson sampling and noise seeds "
    "(fine for public benchmark data), and differences are taken per seed."
)

Metric = float | Mapping[str, float]
RunFn = Callable[[Mapping[str, Any], int, str], Metric]


class ProtocolError(ValueError):
    """An experiment that the protocol refuses to run or resume."""


@dataclass(frozen=True)
class Arm:
    """One contender: its run callable and its pre-registered hyperparameter grid.

    Args:
        name: Label in the outputs.
        run: ``run(hparams, seed, split)`` trains once and returns the metric (a float) or
            several metrics (a mapping holding the experiment's ``metric``). With ``split="val"``
            it must evaluate on rows carved from the training data and never read the test
            split; with ``split="test"`` on the test split. ``seed`` must fix the Poisson
            sampling and the noise, identically for every arm.
        grid: Hyperparameter points (JSON-serialisable mappings), fixed before any run.
        fixed: Why the arm's one grid point was fixed before the experiment (e.g. "selected by
            the pre-registered experiment X"): such an arm makes no selection run, and the
            outputs give the reason. ``None`` (the default): the grid is tuned, even a one-point grid.
    """

    name: str
    run: RunFn
    grid: Sequence[Mapping[str, Any]]
    fixed: str | None = None

    def __post_init__(self) -> None:
        if self.fixed is not None and (not self.fixed or len(self.grid) != 1):
            raise ProtocolError(f"arm {self.name!r}: fixed= needs a reason and exactly one grid point")


@dataclass(frozen=True)
class Criterion:
    """A claim written before the final runs: ``better`` beats (or is not worse than) ``worse``.

    The *improvement* is ``better - worse`` (``worse - better`` for a metric where lower is
    better), per paired seed. Superiority (``margin=0``, the default) passes when the lower 90 %
    paired bound of the improvement is above 0. Non-inferiority (``margin > 0``) passes when that
    bound is above ``-margin`` and, if ``mean_margin`` is set, the mean improvement is at least
    ``-mean_margin``.

    Args:
        better: The arm claimed better (or not worse).
        worse: The reference arm.
        margin: The non-inferiority margin on the lower bound (0: a superiority claim).
        mean_margin: The margin on the mean improvement of a non-inferiority claim.
    """

    better: str
    worse: str
    margin: float = 0.0
    mean_margin: float | None = None

    def __post_init__(self) -> None:
        if self.margin < 0 or (self.mean_margin is not None and (self.mean_margin < 0 or not self.margin)):
            raise ProtocolError(f"margins must be >= 0, and mean_margin needs a margin: {self}")

    def text(self, metric: str, higher_is_better: bool) -> str:
        """The claim in words, as it is stored before the final runs."""
        diff = f"{self.better} - {self.worse}" if higher_is_better else f"{self.worse} - {self.better}"
        if not self.margin:
            return (
                f"{self.better} beats {self.worse} on {metric} if the lower {LEVEL:.0%} paired t-bound "
                f"of ({diff}) over the final seeds is above 0"
            )
        mean = f"the mean of ({diff}) is >= {-self.mean_margin:g} and " if self.mean_margin is not None else ""
        return (
            f"{self.better} is non-inferior to {self.worse} on {metric} if {mean}the lower {LEVEL:.0%} paired "
            f"t-bound of ({diff}) over the final seeds is above {-self.margin:g}"
        )

    def judge(self, improvement: Mapping[str, float], span: str) -> tuple[float, bool, str | None]:
        """(lower bound of the improvement, passed, verdict or None for the superiority wording)."""
        bound = improvement["low"]
        if not self.margin:
            return bound, bound > 0, None
        mean_ok = self.mean_margin is None or improvement["mean"] >= -self.mean_margin
        passed = bound > -self.margin and mean_ok
        word = "is non-inferior to" if passed else "is not shown non-inferior to"
        return bound, passed, f"{self.better} {word} {self.worse} at this scale ({span})"


@dataclass(frozen=True)
class Experiment:
    """Arms, grids, seeds and criteria of one comparison.

    Args:
        name: Names the output files; a rerun with the same name resumes.
        arms: The contenders (distinct names).
        criteria: Pre-registered claims (see :class:`Criterion`).
        metric: The metric that selects hyperparameters and that the differences compare.
        higher_is_better: Direction of ``metric`` (False for a loss).
        tuning_seeds: Seeds of the selection runs (mean over them per grid point).
        final_seeds: Paired seeds of the final runs, at least 5.
        settings: Anything else the results depend on (data sizes, ε, steps); part of the
            record's identity, so a changed setting cannot resume an old record.
        pairing: What the final runs share per seed, as the outputs state it (the default says
            every arm gets the same Poisson sampling and noise seeds; say less when arms sample
            differently).
    """

    name: str
    arms: Sequence[Arm]
    criteria: Sequence[Criterion]
    metric: str = "metric"
    higher_is_better: bool = True
    tuning_seeds: Sequence[int] = (100,)
    final_seeds: Sequence[int] = (0, 1, 2, 3, 4)
    settings: Mapping[str, Any] = field(default_factory=dict)
    pairing: str = PAIRING

    def __post_init__(self) -> None:
        names = [arm.name for arm in self.arms]
        if len(names) < 2 or len(set(names)) != len(names):
            raise ProtocolError(f"an experiment needs at least two arms with distinct names, got {names}")
        if len(set(self.final_seeds)) < MIN_FINAL_SEEDS:
            raise ProtocolError(f"final runs need >= {MIN_FINAL_SEEDS} distinct paired seeds, got {self.final_seeds}")
        if not self.tuning_seeds:
            raise ProtocolError("selection needs at least one tuning seed")
        for arm in self.arms:
            if not arm.grid:
                raise ProtocolError(f"arm {arm.name!r} has an empty grid")
        for c in self.criteria:
            if c.better not in names or c.worse not in names or c.better == c.worse:
                raise ProtocolError(f"criterion {c} must name two different arms of {names}")

    def identity(self) -> dict[str, Any]:
        """What a record must match to be resumed (the criteria are checked separately)."""
        return json.loads(json.dumps({
            "name": self.name, "metric": self.metric, "higher_is_better": self.higher_is_better,
            "arms": {arm.name: [dict(hp) for hp in arm.grid] for arm in self.arms},
            "tuning_seeds": list(self.tuning_seeds), "final_seeds": list(self.final_seeds),
            "settings": dict(self.settings),
        }, sort_keys=True))  # fmt: skip

    def criteria_record(self) -> list[dict[str, Any]]:
        """The criteria as stored at the start of the final runs."""
        records = []
        for c in self.criteria:
            record: dict[str, Any] = {"better": c.better, "worse": c.worse}
            if c.margin:  # superiority claims keep the record's original form (older records resume)
                record.update(margin=c.margin, mean_margin=c.mean_margin)
            records.append({**record, "text": c.text(self.metric, self.higher_is_better)})
        return records


def replication(experiment: Experiment, record_path: Path, seeds: Sequence[int]) -> Experiment:
    """``experiment`` again on new final seeds, every arm fixed at what its complete record selected.

    Nothing is tuned again and nothing else changes: the arms' runs, the criteria and the settings
    are the original's, fixed before any replication run (the settings name the record replicated,
    so the replication is a record of its own). Only the final seeds are new.

    Raises:
        ProtocolError: If the record is not complete, is of another experiment, or a seed was
            already used by it (for tuning or for the final runs).
    """
    record = json.loads(Path(record_path).read_text())
    if record.get("status") != "complete":
        raise ProtocolError(f"{record_path} is not a complete record: there is nothing to replicate")
    if record.get("identity") != experiment.identity():
        raise ProtocolError(f"{record_path} is the record of another experiment (or of other settings)")
    reused = sorted(set(seeds) & (set(experiment.tuning_seeds) | set(experiment.final_seeds)))
    if reused:
        raise ProtocolError(f"seeds {reused} were used by {experiment.name}; a replication needs new seeds")
    source = {"experiment": record["experiment"], "digest": record["digest"],
              "commit": record["environment"]["dplightning"]["commit"]}  # fmt: skip
    why = f"selected by {record['experiment']} (digest {record['digest'][:12]})"
    arms = [replace(a, grid=[record["selection"][a.name]["hparams"]], fixed=why) for a in experiment.arms]
    return replace(experiment, name=f"{experiment.name}_replication", arms=arms, final_seeds=tuple(seeds),
                   settings={**experiment.settings, "replicates": source})  # fmt: skip


def validation_split(n_train: int, fraction: float = 0.1, seed: int = 0) -> tuple[list[int], list[int]]:
    """Carve a validation split from the training rows: (train indices, validation indices).

    The carve seed is fixed per experiment (not the run seed), so every arm and every tuning
    seed is selected on the same rows.
    """
    if not 0 < fraction < 1 or n_train < 2:
        raise ProtocolError(f"cannot carve a fraction {fraction} of {n_train} training rows")
    order = list(range(n_train))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(fraction * n_train))
    return sorted(order[n_val:]), sorted(order[:n_val])


def paired_interval(diffs: Sequence[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean, sd and two-sided t-interval of paired differences (n - 1 degrees of freedom)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else math.nan
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n) if n > 1 else math.nan  # JSON-safe
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "level": level}


def verdict(a: str, b: str, interval: Mapping[str, float], higher_is_better: bool) -> str:
    """The wording rule: a claim only when the interval of (a - b) excludes 0; otherwise the interval."""
    lo, hi = interval["low"], interval["high"]
    a_better = lo > 0 if higher_is_better else hi < 0
    b_better = hi < 0 if higher_is_better else lo > 0
    span = _span(a, b, interval)
    if a_better:
        return f"{a} beats {b} ({span})"
    if b_better:
        return f"{b} beats {a} ({span})"
    return f"not shown at this scale ({span})"


def _span(a: str, b: str, interval: Mapping[str, Any]) -> str:
    lo, hi = interval["low"], interval["high"]
    return f"{LEVEL:.0%} paired interval of {a} - {b}: [{lo:+.4g}, {hi:+.4g}], n = {interval['n']}"


def run_experiment(
    experiment: Experiment,
    out: Path | None = None,
    figures: Path | None = None,
    threads: int | None = None,
    workers: int = 1,
    borrow: Mapping[str, Path] | None = None,
) -> dict[str, Any]:
    """Run (or resume) an experiment and write its JSON, markdown table and figure.

    Args:
        experiment: The comparison.
        out: The JSON path; the markdown goes next to it. Default ``_outputs.default_result``.
        figures: The figure folder. Default ``_outputs.default_figures``.
        threads: Recorded in the provenance (default: torch's thread count).
        workers: Runs at once, each in a forked worker process (the selection runs of every arm
            together, then the final runs); this process alone writes the record, after every
            run. Results do not depend on it: each run is fixed by its arm, hyperparameters and seed.
        borrow: ``{arm name: record path}``: take that arm's selection and final runs from another
            experiment's record instead of running them (see :func:`borrow_runs`), so a new arm is
            paired with runs already made. The arm's first final seed is rerun here (phase
            "recheck"); a rerun that does not reproduce the borrowed metric exactly stops the
            experiment, since the pairing would then be void.

    Returns:
        The record as written to the JSON.

    Raises:
        ProtocolError: The record at ``out`` has other settings, or other criteria once its
            final runs have started, or a run returned no ``metric``, or a borrowed arm's record
            does not match or does not reproduce.
    """
    if workers < 1:
        raise ProtocolError(f"workers must be >= 1, got {workers}")
    out = out or default_result(f"{experiment.name}.json")
    record = _load_or_start(experiment, out, threads)
    for name, path in (borrow or {}).items():
        borrow_runs(experiment, record, name, path)
    done = {_key(r["phase"], r["arm"], r["hparams"], r["seed"]): r for r in record["runs"]}

    def keep(run: dict[str, Any]) -> None:
        done[_key(run["phase"], run["arm"], run["hparams"], run["seed"])] = run
        record["runs"].append(run)
        _write_json(out, record)

    def run_all(jobs: list[Job]) -> None:
        _run_jobs(experiment, [j for j in jobs if _key(j[1], j[0].name, j[2], j[3]) not in done], workers, keep)

    def run_once(arm: Arm, phase: str, hparams: Mapping[str, Any], seed: int) -> dict[str, float]:
        run_all([(arm, phase, hparams, seed)])
        return done[_key(phase, arm.name, hparams, seed)]["metrics"]

    # A fixed arm's one point was chosen before the experiment: no selection run (the outputs say why).
    run_all([(a, SELECT, h, s) for a in experiment.arms if a.fixed is None for h in a.grid
             for s in experiment.tuning_seeds])  # fmt: skip
    record["selection"] = _select(experiment, run_once)
    _start_final(experiment, record, out)
    # Seed-major, so a crash leaves complete pairs behind.
    selected = {a.name: record["selection"][a.name]["hparams"] for a in experiment.arms}
    first = experiment.final_seeds[0]
    rechecks = [(a, RECHECK, selected[a.name], first) for a in experiment.arms if a.name in (borrow or {})]
    run_all(rechecks + [(a, FINAL, selected[a.name], s) for s in experiment.final_seeds for a in experiment.arms])
    for arm, _, hparams, seed in rechecks:
        _check_reproduced(experiment, record, done, arm.name, hparams, seed, out)
    record.update(_results(experiment, record))
    record["status"] = "complete"
    _write_json(out, record)
    _write_markdown(out.with_suffix(".md"), record)
    _write_figure((figures or default_figures()) / f"{experiment.name}.png", record)
    return record


def borrow_runs(experiment: Experiment, record: dict[str, Any], arm: str, path: Path) -> None:
    """Copy ``arm``'s selection and final runs from the record at ``path`` into ``record``.

    Refused unless the other record is complete and its experiment matches this one on
    everything the arm's runs depend on: the metric and its direction, the tuning and final
    seeds, the arm's grid, and every setting (``settings["arms"]`` compared for this arm only).
    Copied runs keep their metrics and carry ``borrowed_from`` (the other experiment, its digest
    and commit); the provenance goes to ``record["borrowed"]``.
    """
    other = json.loads(Path(path).read_text())
    mine, theirs = experiment.identity(), other.get("identity", {})
    if other.get("status") != "complete":
        raise ProtocolError(f"cannot borrow {arm!r} from {path}: that experiment is not complete")

    def shared(identity: Mapping[str, Any]) -> dict[str, Any]:
        settings = dict(identity.get("settings", {}))
        arms = settings.pop("arms", {})
        return {
            "metric": identity.get("metric"), "higher_is_better": identity.get("higher_is_better"),
            "tuning_seeds": identity.get("tuning_seeds"), "final_seeds": identity.get("final_seeds"),
            "grid": identity.get("arms", {}).get(arm),
            "arm_settings": arms.get(arm) if isinstance(arms, Mapping) else None, "settings": settings,
        }  # fmt: skip

    if arm not in mine["arms"] or shared(mine) != shared(theirs):
        differs = sorted(k for k, v in shared(mine).items() if shared(theirs).get(k) != v)
        raise ProtocolError(f"cannot borrow {arm!r} from {path}: the experiments differ in {differs or ['arms']}")
    source = {"experiment": other["experiment"], "digest": other["digest"],
              "commit": other["environment"]["dplightning"]["commit"]}  # fmt: skip
    have = {_key(r["phase"], r["arm"], r["hparams"], r["seed"]) for r in record["runs"]}
    for run in other["runs"]:
        if run["arm"] == arm and run["phase"] in (SELECT, FINAL):
            if _key(run["phase"], arm, run["hparams"], run["seed"]) not in have:
                record["runs"].append({**run, "borrowed_from": source})
    record.setdefault("borrowed", {})[arm] = {**source, "path": Path(path).name}


def _check_reproduced(
    experiment: Experiment, record: dict[str, Any], done: Mapping[str, Any], arm: str,
    hparams: Mapping[str, Any], seed: int, out: Path,
) -> None:  # fmt: skip
    """Compare a borrowed final run with its rerun here; store the check, and stop if they differ."""
    borrowed = done[_key(FINAL, arm, hparams, seed)]["metrics"][experiment.metric]
    rerun = done[_key(RECHECK, arm, hparams, seed)]["metrics"][experiment.metric]
    record["borrowed"][arm]["recheck"] = {"seed": seed, "borrowed": borrowed, "rerun": rerun,
                                          "reproduced": borrowed == rerun}  # fmt: skip
    _write_json(out, record)
    if borrowed != rerun:
        raise ProtocolError(
            f"{arm!r}: the borrowed final run at seed {seed} gave {experiment.metric}={borrowed}, a rerun here "
            f"{rerun}: the runs are not reproducible, so borrowing them would not pair them; run the arm instead"
        )


Job = tuple[Arm, str, Mapping[str, Any], int]  # arm, phase, hyperparameters, seed
_FORKED: tuple[Experiment, list[Job]] | None = None  # what forked workers read (set before the fork)


def _run_jobs(experiment: Experiment, jobs: list[Job], workers: int, keep: Callable[[dict[str, Any]], None]) -> None:
    """Run ``jobs`` (in order with one worker) and hand each finished run to ``keep`` in this process."""
    if workers == 1 or len(jobs) <= 1:
        for arm, phase, hparams, seed in jobs:
            keep(_timed_run(experiment, arm, phase, hparams, seed))
        return
    global _FORKED
    _FORKED = (experiment, jobs)  # arms hold closures, which cannot be pickled: forked workers inherit them
    try:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            futures = [pool.submit(_forked_job, i) for i in range(len(jobs))]
            for future in as_completed(futures):
                keep(future.result())
    finally:
        _FORKED = None


def _forked_job(index: int) -> dict[str, Any]:
    if _FORKED is None:
        raise ProtocolError("a protocol worker started without its jobs (workers need the 'fork' start method)")
    experiment, jobs = _FORKED
    arm, phase, hparams, seed = jobs[index]
    return _timed_run(experiment, arm, phase, hparams, seed)


def _key(phase: str, arm: str, hparams: Mapping[str, Any], seed: int) -> str:
    return json.dumps([phase, arm, dict(hparams), seed], sort_keys=True)


def _load_or_start(experiment: Experiment, out: Path, threads: int | None) -> dict[str, Any]:
    identity = experiment.identity()
    if out.exists():
        record = json.loads(out.read_text())
        if record.get("identity") != identity:
            raise ProtocolError(
                f"{out} records experiment {record.get('identity')}, not {identity}: "
                "give the changed experiment a new name (or move the old record away)"
            )
        return record
    import torch  # only for the thread count in the provenance

    return {
        "experiment": experiment.name, "identity": identity,
        "digest": hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16],
        **provenance(threads or torch.get_num_threads()),  # outside the identity: a resume may run elsewhere
        "criteria_registered": experiment.criteria_record(), "pairing": experiment.pairing,
        "status": "selection", "runs": [],
    }  # fmt: skip


def _timed_run(experiment: Experiment, arm: Arm, phase: str, hparams: Mapping[str, Any], seed: int) -> dict[str, Any]:
    split = VAL if phase == SELECT else TEST
    start = time.perf_counter()
    value = arm.run(hparams, seed, split)
    seconds = time.perf_counter() - start
    metrics = {experiment.metric: float(value)} if isinstance(value, int | float) else dict(value)
    if experiment.metric not in metrics:
        raise ProtocolError(f"arm {arm.name!r} returned {sorted(metrics)}, without the metric {experiment.metric!r}")
    metrics = {k: float(v) for k, v in metrics.items()}
    print(
        f"[{experiment.name}] {phase} arm={arm.name} hparams={json.dumps(dict(hparams), sort_keys=True)} "
        f"seed={seed} split={split} {experiment.metric}={metrics[experiment.metric]:.4f} {seconds:.1f}s",
        flush=True,
    )
    return {"phase": phase, "arm": arm.name, "hparams": dict(hparams), "seed": seed, "split": split,
            "metrics": metrics, "seconds": seconds}  # fmt: skip


def _select(experiment: Experiment, run_once: Callable[..., dict[str, float]]) -> dict[str, Any]:
    """Each arm's grid on the validation split; the best mean over the tuning seeds wins (NaN loses)."""
    selection = {}
    sign = 1.0 if experiment.higher_is_better else -1.0
    for arm in experiment.arms:
        if arm.fixed is not None:
            selection[arm.name] = {"hparams": dict(arm.grid[0]), "val_mean": None, "grid": [], "at_grid_edge": False,
                                   "fixed": arm.fixed}  # fmt: skip
            continue
        scores = []
        for hparams in arm.grid:
            values = [run_once(arm, SELECT, hparams, seed)[experiment.metric] for seed in experiment.tuning_seeds]
            scores.append({"hparams": dict(hparams), "val_mean": statistics.fmean(values), "split": VAL})
        best = max(scores, key=lambda s: -math.inf if math.isnan(s["val_mean"]) else sign * s["val_mean"])
        # A best point at an end of a grid of >= 3 may have its optimum outside the grid: the outputs say so.
        at_edge = len(scores) >= 3 and best in (scores[0], scores[-1])
        selection[arm.name] = {"hparams": best["hparams"], "val_mean": best["val_mean"], "grid": scores,
                               "at_grid_edge": at_edge}  # fmt: skip
    return selection


def _start_final(experiment: Experiment, record: dict[str, Any], out: Path) -> None:
    """Store the criteria with the start of the final runs; on resume, refuse changed criteria."""
    criteria = experiment.criteria_record()
    started = record.get("final_started")
    if started is None:
        record["final_started"] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "criteria": criteria}
        record["status"] = "final"
        _write_json(out, record)
    elif started["criteria"] != criteria:
        raise ProtocolError(
            f"the criteria changed after the final runs started: registered {started['criteria']}, now {criteria}"
        )


def _results(experiment: Experiment, record: dict[str, Any]) -> dict[str, Any]:
    final = {(r["arm"], r["seed"]): r["metrics"] for r in record["runs"] if r["phase"] == FINAL}
    seeds, metric = list(experiment.final_seeds), experiment.metric
    arms = {}
    for arm in experiment.arms:
        per_seed = [final[arm.name, s] for s in seeds]
        arms[arm.name] = {
            "hparams": record["selection"][arm.name]["hparams"],
            "metrics": {k: _mean_sd([m[k] for m in per_seed]) for k in per_seed[0]},
            "per_seed": {str(s): m[metric] for s, m in zip(seeds, per_seed)},
        }
    pairs = []
    registered = {frozenset((c.better, c.worse)) for c in experiment.criteria}
    for a, b in combinations([arm.name for arm in experiment.arms], 2):
        diffs = [final[a, s][metric] - final[b, s][metric] for s in seeds]
        interval = paired_interval(diffs)
        # Only a registered comparison gets a verdict; any other pair is described, never "beats".
        said = (verdict(a, b, interval, experiment.higher_is_better) if frozenset((a, b)) in registered
                else f"not registered, described only ({_span(a, b, interval)})")  # fmt: skip
        pairs.append({"a": a, "b": b, "diffs": diffs, **interval, "verdict": said})
    by_pair = {(p["a"], p["b"]): p for p in pairs}
    criteria = []
    for c, registered in zip(experiment.criteria, record["final_started"]["criteria"]):
        diff = _oriented(by_pair.get((c.better, c.worse)) or by_pair[c.worse, c.better], c.better)
        sign = 1.0 if experiment.higher_is_better else -1.0
        lo, hi = sorted((sign * diff["low"], sign * diff["high"]))
        improvement = {"mean": sign * diff["mean"], "low": lo, "high": hi}
        bound, passed, text = c.judge(improvement, _span(c.better, c.worse, diff))
        text = text or verdict(c.better, c.worse, diff, experiment.higher_is_better)
        criteria.append({**registered, "lower_bound": bound, "passed": bool(passed), "verdict": text})
    return {"arms": arms, "pairs": pairs, "criteria": criteria}


def _oriented(pair: Mapping[str, Any], first: str) -> dict[str, Any]:
    """The interval of (first - other) from a pair stored either way round."""
    if pair["a"] == first:
        return dict(pair)
    return {**pair, "mean": -pair["mean"], "low": -pair["high"], "high": -pair["low"]}


def _mean_sd(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else math.nan}


def _write_json(path: Path, record: Mapping[str, Any]) -> None:
    """Write atomically (a crash mid-write leaves the previous record, never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def _hp(hparams: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in hparams.items()) or "-"


def _write_markdown(path: Path, record: Mapping[str, Any]) -> None:
    identity, metric = record["identity"], record["identity"]["metric"]
    seeds = identity["final_seeds"]
    env = record["environment"]
    lines = [
        f"# {record['experiment']}: {metric} ({'higher' if identity['higher_is_better'] else 'lower'} is better)", "",
        f"Command: `{record['command']}`; commit {env['dplightning']['commit'] or 'unknown'}"
        f"{' (uncommitted changes)' if env['dplightning']['dirty'] else ''}; {env['cpu']}, {env['threads']} threads.",
        "", record.get("pairing", PAIRING), "",
        "Pre-registered criteria (stored before the final runs):", "",
        *[f"- {c['text']}: **{'passed' if c['passed'] else 'not passed'}**; {c['verdict']}"
          for c in record["criteria"]],
        "", f"## Final runs (test split, selected hyperparameters, {len(seeds)} paired seeds)", "",
        f"| arm | hyperparameters | {metric} mean ± sd | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---|---|" + "---|" * len(seeds),
    ]  # fmt: skip
    for name, arm in record["arms"].items():
        m = arm["metrics"][metric]
        cells = " | ".join(f"{arm['per_seed'][str(s)]:.4f}" for s in seeds)
        lines.append(f"| {name} | {_hp(arm['hparams'])} | {m['mean']:.4f} ± {m['sd']:.4f} | {cells} |")
    lines += ["", f"## Paired differences ({LEVEL:.0%} t-intervals)", "",
              "| A - B | mean | sd | interval | verdict |", "|---|---|---|---|---|"]  # fmt: skip
    for p in record["pairs"]:
        lines.append(f"| {p['a']} - {p['b']} | {p['mean']:+.4f} | {p['sd']:.4f} | "
                     f"[{p['low']:+.4f}, {p['high']:+.4f}] | {p['verdict']} |")  # fmt: skip
    for name, source in record.get("borrowed", {}).items():
        check = source.get("recheck", {})
        lines += [
            "",
            f"{name}: runs borrowed from `{source['path']}` (commit {source['commit'] or 'unknown'}); "
            f"its seed-{check.get('seed')} final run rerun here gave {check.get('rerun')} against "
            f"{check.get('borrowed')} borrowed ({'' if check.get('reproduced') else 'NOT '}reproduced).",
        ]
    edges = [name for name, sel in record["selection"].items() if sel.get("at_grid_edge")]
    if edges:
        lines += ["", f"Selected at an end of its pre-registered grid (optimum maybe outside it): {', '.join(edges)}."]
    lines += ["", "## Selection (validation split, never the test split; mean over tuning seeds "
              f"{identity['tuning_seeds']})", "",
              f"| arm | hyperparameters | val {metric} | selected |", "|---|---|---|---|"]  # fmt: skip
    for name, sel in record["selection"].items():
        if sel.get("fixed"):
            reason = sel["fixed"] if isinstance(sel["fixed"], str) else "fixed before the experiment"
            lines += ["", f"{name} ({_hp(sel['hparams'])}): no selection run, {reason}."]
    for name, sel in record["selection"].items():
        for s in sel["grid"]:
            chosen = ("yes (grid edge)" if sel.get("at_grid_edge") else "yes") if s["hparams"] == sel["hparams"] else ""
            lines.append(f"| {name} | {_hp(s['hparams'])} | {s['val_mean']:.4f} | {chosen} |")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def _write_figure(path: Path, record: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, seeds = record["identity"]["metric"], record["identity"]["final_seeds"]
    names, pairs = list(record["arms"]), record["pairs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.5 + 0.45 * max(len(names), len(pairs))))
    for s in seeds:  # one line per seed joins the paired points
        left.plot(range(len(names)), [record["arms"][n]["per_seed"][str(s)] for n in names], "o-", alpha=0.6,
                  label=f"seed {s}")  # fmt: skip
    means = [record["arms"][n]["metrics"][metric]["mean"] for n in names]
    left.plot(range(len(names)), means, "k_", markersize=24, label="mean")
    left.set_xticks(range(len(names)), names, rotation=35, ha="right")
    left.set_ylabel(f"test {metric}")
    left.set_title("final runs per paired seed")
    left.legend(fontsize=7)
    y = range(len(pairs))
    mean = [p["mean"] for p in pairs]
    err = [[p["mean"] - p["low"] for p in pairs], [p["high"] - p["mean"] for p in pairs]]
    right.errorbar(mean, y, xerr=err, fmt="o", capsize=4)
    right.axvline(0, color="grey", linestyle="--")
    right.set_yticks(list(y), [f"{p['a']} - {p['b']}" for p in pairs])
    right.set_xlabel(f"paired difference of {metric} ({LEVEL:.0%} t-interval)")
    right.set_title("paired differences")
    fig.suptitle(record["experiment"])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
