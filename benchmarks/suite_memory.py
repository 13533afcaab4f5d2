"""Allocator-level peak memory of the engine suite: what a step adds beyond the parameters and the data.

Run (the memory columns of "Against the targets" in ``docs/clipping_engines.md``), or a smoke run::

    python benchmarks/suite_memory.py --out benchmarks/results/suite_memory_cpu.json
    python benchmarks/suite_memory.py --smoke --out suite_memory_smoke.json

Peak RSS (``engines.py``) includes the interpreter, the libraries and what the C allocator keeps,
and on the 2-core VM it moved by more than the effect being measured (two GPT-2 repeats peaked
1,150 MiB apart). This script measures what the issue's targets are stated in: the live bytes of
every CPU tensor storage, from ``torch.profiler``'s memory events (the running ``Total Allocated``,
as ``memory_plan_check.py`` does), in one fresh process per runner and workload.

Each training batch start is marked in the trace. A step's peak is the largest running total from
its mark to the next, less the bytes of the model's parameters and buffers and of the data set's
tensors (built again outside the profiler to count them): what the runner adds, including what it
allocates before its first step (the DP buckets, Opacus' wrappers). Steps are reported in two
groups: the first ``--warmup`` steps (for the DP runners these include the two verified steps
and the coupling probe's replay) and the steady steps after them. A DP runner's Poisson batch
varies by about √B rows, and its memory with it, so each step's peak is also scaled to the nominal
batch (peak × B / rows): the first steps' figure is the largest of these, the steady figure their
median.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import statistics
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from _harness import at_batch, write_report
from _outputs import default_result
from engines import RUNNERS, WORKLOADS, Placement, Workload, dataset_rows, train_runner

MARK = "dpl_step_start"
MIB = 2.0**20
SMOKE_RUNNERS = ("nonprivate", "dp_auto")
SUITE = ("mlp_mnist", "linear_stack", "vit", "gptneo", "gpt2")
"""The models of the performance issue's suite."""


@dataclass(frozen=True)
class Marked(Placement):
    """The CPU placement, marking each step start in the profiler's trace (the clock calls it before each reading)."""

    def synchronize(self) -> None:
        with torch.profiler.record_function(MARK):
            pass


def step_peaks(trace: dict[str, Any]) -> list[float]:
    """The peak running total of each marked step (bytes).

    Args:
        trace: A Chrome trace exported by ``torch.profiler`` with ``profile_memory=True``.
    """
    events = trace["traceEvents"]
    memory = sorted(
        (e["ts"], e["args"]["Total Allocated"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    )
    marks = sorted(e["ts"] for e in events if e.get("name") == MARK)
    if len(marks) < 2 or not memory:
        raise RuntimeError(
            f"The trace has {len(marks)} step marks and {len(memory)} memory events: nothing to measure."
        )
    times = [ts for ts, _ in memory]
    peaks = []
    for start, end in zip(marks, marks[1:]):
        first, stop = bisect.bisect_left(times, start), bisect.bisect_left(times, end)
        held = [memory[first - 1][1]] if first else []  # a step without events holds what was there
        peaks.append(float(max([*held, *(total for _, total in memory[first:stop])])))
    return peaks


def own_bytes(w: Workload, steps: int, warmup: int) -> int:
    """Bytes of the workload's parameters and buffers and of its data set (what every runner holds anyway)."""
    torch.manual_seed(0)
    net = w.build()
    data = w.data(dataset_rows(w, steps, warmup))
    tensors = [*net.parameters(), *net.buffers(), *data.tensors]
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def measure(runner: str, workload: str, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    """One runner on one workload, profiled in this (fresh) process."""
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    w: Workload = WORKLOADS[workload]
    baseline = own_bytes(w, steps, warmup)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        clock = train_runner(runner, w, steps, warmup, place=Marked())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        peaks = step_peaks(json.loads(path.read_text()))
    rows = clock.rows[: len(peaks)]
    above = [(p - baseline) / MIB for p in peaks]
    first = at_batch(above[:warmup], rows[:warmup], w.batch)
    steady = at_batch(above[warmup:], rows[warmup:], w.batch)
    return {
        "parameters_and_data_mib": baseline / MIB,
        "step_peak_mib": above,
        "step_rows": rows,
        "first_steps_peak_mib": max(above[:warmup], default=float("nan")),
        "first_steps_peak_mib_at_batch": max(first, default=float("nan")),
        "steady_peak_mib_at_batch": statistics.median(steady) if steady else float("nan"),
    }


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    base = results.get("nonprivate")
    if base is None:
        return {}
    keys = ("first_steps_peak_mib_at_batch", "steady_peak_mib_at_batch")
    return {r: {k: v[k] / base[k] for k in keys} for r, v in results.items()}


def _table(workload: str, results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]]) -> str:
    lines = [
        f"{workload}: batch {WORKLOADS[workload].batch}, MiB beyond parameters and data",
        f"  {'runner':<16}{'first at B':>12}{'x':>7}{'steady at B':>13}{'x':>7}",
    ]
    for runner, r in results.items():
        x = ratios.get(runner, {})
        lines.append(
            f"  {runner:<16}{r['first_steps_peak_mib_at_batch']:>12.1f}"
            f"{x.get('first_steps_peak_mib_at_batch', float('nan')):>7.2f}"
            f"{r['steady_peak_mib_at_batch']:>13.1f}{x.get('steady_peak_mib_at_batch', float('nan')):>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(SUITE))
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=["nonprivate", "dp_auto", "opacus_hooks"])
    parser.add_argument("--steps", type=int, default=4, help="steady steps after the first ones")
    parser.add_argument("--warmup", type=int, default=3, help="first steps (the DP runners verify two)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CI: the MLP, non-private and dp_auto, 1 + 2 steps")
    parser.add_argument("--out", type=Path, default=default_result("suite_memory_cpu.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.runners, args.warmup, args.steps = ["mlp_mnist"], list(SMOKE_RUNNERS), 1, 2
    results: dict[str, dict[str, dict[str, Any]]] = {}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for workload in args.models:
        results[workload] = {}
        for runner in args.runners:
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                job = pool.submit(measure, runner, workload, args.steps, args.warmup, args.threads)
                results[workload][runner] = job.result()
        ratios[workload] = _ratios(results[workload])
        print(_table(workload, results[workload], ratios[workload]), end="\n\n", flush=True)
    write_report(args.out, "suite_memory", args.threads, vars(args), results=results, ratios=ratios)
    return results


if __name__ == "__main__":
    main()
