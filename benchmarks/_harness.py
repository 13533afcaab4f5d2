"""What the benchmarks share: one step clock, one quiet Trainer, fresh processes, summaries, provenance.

Timing: a step's time is the gap between two step starts, recorded by ``perf_counter`` once
the batch is fetched (``Callback.on_train_batch_start`` under Lightning, the loop body's top
otherwise, through :meth:`StepClock.tick`); on a GPU the clock synchronizes before each reading.
Trainers that only measure come from :func:`quiet_trainer` (no logger, checkpoints, progress bar
or model summary), so that no run times a logger's writes or a bar's redraws. Memory: the peak
RSS of the measuring process (``ru_maxrss``), each measurement in a fresh ``spawn`` process so
that allocator state and hooks never leak between runners, and its growth over the RSS just
before training. Interference: the share of the machine's
CPU other processes used meanwhile (``/proc/stat``); above a threshold the measurement is
retried, as one busy core slows threaded steps many-fold. Provenance: every result file
carries :func:`provenance` (the command, the machine and versions, the git commit and its
uncommitted files); :func:`write_report` writes it, and scripts that write their own JSON merge it in.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from itertools import pairwise
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import opacus
import torch

import dplightning

TRIES, RETRY_PAUSE_S = 6, 30.0
ENV_PREFIXES = ("MALLOC_", "OMP_", "MKL_", "LD_PRELOAD", "PYTHONPATH")  # settings that change the timings
ROOT = Path(__file__).resolve().parents[1]
# A logger's writes, checkpoints, a progress bar's redraws and the summary's pass over the module are not the step.
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A Trainer without logger, checkpointing, progress bar or model summary.

    Args:
        **kwargs: ``pl.Trainer`` arguments; they override the quiet defaults.
    """
    return pl.Trainer(**{**QUIET, **kwargs})


def batch_rows(batch: Any) -> int:
    """Rows of a batch: a tuple's first tensor, or a mapping's first value (a tokenized batch)."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return len(first)


class StepClock(pl.Callback):
    """Records when each training batch starts and its rows; stops training after ``steps`` steps.

    Args:
        steps: Steps to record; the batch after them only closes the last gap.
        sync: Called before each reading, e.g. ``torch.cuda.synchronize`` so that a step's
            queued GPU kernels count in its own gap.
    """

    def __init__(self, steps: int, sync: Callable[[], None] | None = None) -> None:
        self.steps = steps
        self.sync = sync
        self.starts: list[float] = []
        self.cpu: list[float] = []  # the process' CPU seconds at each start (all its threads)
        self.rows: list[int] = []

    def tick(self, rows: int) -> bool:
        """Record a step start; return whether it only closes the last step (time to stop)."""
        if self.sync is not None:
            self.sync()
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.rows.append(rows)
        return len(self.starts) > self.steps

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.tick(batch_rows(batch)):
            trainer.should_stop = True  # this batch still runs, untimed; then fit ends

    def step_ms(self, warmup: int) -> list[float]:
        """Milliseconds per timed step, the first ``warmup`` gaps dropped."""
        return [1e3 * (b - a) for a, b in pairwise(self.starts)][warmup:]

    def step_cpu_ms(self, warmup: int) -> list[float]:
        """CPU milliseconds of this process per timed step (all threads), the first ``warmup`` dropped.

        With one thread this is the step's compute without the time the VM gave to others (steal,
        other processes), which wall-clock gaps include; with more, idle workers' spinning counts.
        """
        return [1e3 * (b - a) for a, b in pairwise(self.cpu)][warmup:]


def usage() -> tuple[float, float, float]:
    """(peak RSS MiB of this process, busy CPU seconds of the whole machine incl. steal, CPU seconds of ours)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_maxrss / 1024, busy, own.ru_utime + own.ru_stime  # ru_maxrss is in KiB on Linux


def measured(train: Callable[[], tuple[StepClock, int]]) -> dict[str, Any]:
    """Run ``train`` (returning its clock and the warm-up gaps to drop) in this process; time and memory."""
    (rss0, busy0, own0), wall = usage(), time.perf_counter()
    clock, warmup = train()
    (rss1, busy1, own1), wall = usage(), time.perf_counter() - wall
    foreign = max(busy1 - busy0 - (own1 - own0), 0.0) / (wall * (os.cpu_count() or 1))
    return {
        "step_ms": clock.step_ms(warmup),
        "step_cpu_ms": clock.step_cpu_ms(warmup),
        "step_rows": clock.rows[warmup:-1],  # the rows of each timed step, aligned with step_ms
        "mean_batch_rows": statistics.fmean(clock.rows[warmup:-1]),
        "peak_rss_mib": rss1,
        "rss_growth_mib": rss1 - rss0,
        "foreign_cpu_pct": 100 * foreign,
        "threads": torch.get_num_threads(),
    }


def in_fresh_process(
    fn: Callable[..., dict[str, Any]], args: tuple[Any, ...], max_other_cpu: float, label: str
) -> dict[str, Any]:
    """``fn(*args)`` in a fresh ``spawn`` process, retried while other processes took too much CPU."""
    for attempt in range(1, TRIES + 1):
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            run = pool.submit(fn, *args).result()
        run["attempts"] = attempt
        if run["foreign_cpu_pct"] <= max_other_cpu or attempt == TRIES:
            return run
        print(f"  [{label}: other processes used {run['foreign_cpu_pct']:.0f}% CPU, retrying]", file=sys.stderr)
        time.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def at_batch(step_ms: Sequence[float], rows: Sequence[int], batch: int) -> list[float]:
    """Each step's time scaled to the nominal batch, step time × B / the step's rows (empty batches left out)."""
    return [t * batch / r for t, r in zip(step_ms, rows) if r > 0]


def summarise(runs: list[dict[str, Any]], expected_rows: int | None = None) -> dict[str, Any]:
    """Pooled statistics of several repeats of one runner.

    With ``expected_rows`` (the nominal batch B), also ``median_ms_at_batch``: the median over
    the steps of step time × B / the step's rows (``median_cpu_ms_at_batch``: of CPU time). A
    Poisson batch of expected size B varies by about √B rows from step to step, so with a few
    timed steps the raw median of a DP runner moves with its draws of the batch size (and a
    non-private runner always has B); the scaled median compares runners at the same rows,
    assuming a step's time is proportional to them.
    """
    steps = [t for run in runs for t in run["step_ms"]]
    scaled = {}
    if expected_rows is not None:
        for clock, key in (("step_ms", "median_ms_at_batch"), ("step_cpu_ms", "median_cpu_ms_at_batch")):
            timed = [run for run in runs if clock in run]
            per_step = [t for run in timed for t in at_batch(run[clock], run["step_rows"], expected_rows)]
            scaled[key] = statistics.median(per_step) if per_step else math.nan
    return {
        "median_ms": statistics.median(steps), "mean_ms": statistics.fmean(steps),
        "stdev_ms": statistics.stdev(steps) if len(steps) > 1 else 0.0,
        "repeat_median_ms": [statistics.median(run["step_ms"]) for run in runs], **scaled,
        "mean_batch_rows": statistics.fmean(run["mean_batch_rows"] for run in runs),
        **{key: max(run[key] for run in runs) for key in ("peak_rss_mib", "rss_growth_mib", "foreign_cpu_pct")},
        "runs": runs,
    }  # fmt: skip


def write_report(path: Path, name: str, threads: int, settings: dict[str, Any], **results: Any) -> None:
    """Write the JSON record of one benchmark run: the command, the machine, the settings and the results."""
    shown = {k: _shown_path(Path(v)) if _is_path(v) else v for k, v in settings.items() if k != "out"}
    report = {"benchmark": name, **provenance(threads), **shown, **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def _is_path(value: Any) -> bool:
    return isinstance(value, Path) or (isinstance(value, str) and os.path.isabs(value))


def _shown_path(path: Path) -> str:
    """A setting's path as the record shows it: relative to the repository, else ``<path>`` (no machine paths)."""
    if not path.is_absolute():
        return path.as_posix()
    resolved = path.resolve()
    return resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else "<path>"


def provenance(threads: int, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every result file carries: ``{"command": ..., "environment": ...}`` (machine, versions, commit).

    Args:
        threads: The torch threads of the measuring processes.
        argv: The script and its arguments (default ``sys.argv``), for a ``main(argv)`` called in-process.
    """
    return {"command": command(argv), "environment": environment(threads)}


def provenance_line(record: Mapping[str, Any]) -> str:
    """One markdown line with a record's provenance, for tables written beside its JSON."""
    env = record["environment"]
    source = env["dplightning"]
    commit = (source["commit"] or "unknown")[:12] + (" (uncommitted changes)" if source["dirty"] else "")
    return (f"Command: `{record['command']}`; commit {commit}; {env['cpu']}, {env['threads']} thread(s); "
            f"torch {env['torch']}, Python {env['python']}.\n")  # fmt: skip


def command(argv: Sequence[str] | None = None) -> str:
    """``python SCRIPT ARGS``: the script relative to the repository, other absolute paths as ``<path>``."""
    script, *args = sys.argv if argv is None else argv
    path = Path(script).resolve()
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    return " ".join(["python", shown, *("<path>" if os.path.isabs(a) else a for a in args)])


def environment(threads: int) -> dict[str, Any]:
    """Versions, CPU, threads and the environment variables that change timings."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return {
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "opacus": opacus.__version__, "dplightning": source(), "platform": platform.platform(),
        "cpu": models[0] if models else platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
        "threads": threads, "env": _timing_env(),
    }  # fmt: skip


def _timing_env() -> dict[str, str]:
    """The timing-relevant variables; path-valued ones only as "set" (no machine paths in results)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    return {k: "set" if k in ("PYTHONPATH", "LD_PRELOAD") else v for k, v in env.items()}


def source() -> dict[str, Any]:
    """The git commit of the dplightning measured and its uncommitted files (no machine paths in results)."""
    root = Path(dplightning.__file__).resolve().parents[1]

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on the machine (the copy measured may have no .git either: then "")
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain").splitlines()}
