"""Where a DP step's extra time and memory go, per model of the engine suite (CPU).

    .venv/bin/python benchmarks/overhead_breakdown.py --out benchmarks/results/overhead_breakdown_cpu.json
    .venv/bin/python benchmarks/overhead_breakdown.py --smoke --out breakdown_smoke.json   # seconds

For each workload of ``engines.py`` the non-private runner and one DP runner (``--engine``, default
``auto``; flat clipping, σ = 1, C = 1) train in this process, one after the other, and the DP run
times the parts of the mechanism with wall-clock scopes around the library's own functions (the
functions are wrapped here, the library is unchanged):

* ``noise``: :meth:`GaussianNoise.sample`, one Gaussian per parameter;
* ``norms``: ``sq_norms`` of the per-example gradients (ghost-norm Grams or formed gradients);
* ``clipped sums``: ``weighted_sum``, Σ_i c_i g_i; it *replaces* autograd's weight gradients, which
  the DP run does not compute, so it is not all overhead;
* ``capture``: the per-layer hooks' work once a layer's output gradient arrives (the engine's
  factors or formed per-example gradients);
* ``output copies``: the copies hooks hand on where a hook on the layer's output would fail;
* ``glue``: the rest of the strategy's per-step code (taking the captured gradients, clip factors,
  buckets, writing ``p.grad``), exclusive of the parts above.

Scopes are exclusive (a scope inside another pauses it), so they add up; ``other`` is the DP step
minus all scopes: forward, backward without the weight gradients, the optimizer and Lightning. Only
the timed steps count (``--warmup`` >= 2 leaves out the verified first steps). Times are medians
of step time × B / the step's rows (Poisson batches vary); the scope times are means over the timed
steps, scaled the same way. Memory: ``held MiB`` is the per-example state the hooks hand over at the
clip point of one step (factors A and Δ, formed gradients; each storage counted once), which flat
clipping keeps until every layer's norm is known. CPU only: the scopes do not synchronise a GPU.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import at_batch, write_report
from _outputs import default_result
from engines import WORKLOADS, train_runner

from dplightning.privacy import mechanism, noise
from dplightning.privacy.grad_sample import grads, hooks
from dplightning.strategies import private_step

SCOPES = ("noise", "norms", "clipped sums", "capture", "output copies", "glue")
SUITE = ("mlp_mnist", "linear_stack", "vit", "gptneo", "gpt2")


class ExclusiveTimer:
    """Wall-clock time per label, exclusive of nested labels; re-entering an active label is not timed again."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(SCOPES, 0.0)
        self.by_type: dict[str, float] = {}  # capture time per layer type (inclusive)
        self._stack: list[list[Any]] = []  # [label, start of its current exclusive stretch]

    def reset(self) -> None:
        self.seconds, self.by_type = dict.fromkeys(SCOPES, 0.0), {}

    @contextmanager
    def scope(self, label: str) -> Iterator[None]:
        if any(frame[0] == label for frame in self._stack):
            yield
            return
        now = time.perf_counter()
        if self._stack:
            parent = self._stack[-1]
            self.seconds[parent[0]] += now - parent[1]
        self._stack.append([label, now])
        try:
            yield
        finally:
            label, start = self._stack.pop()
            now = time.perf_counter()
            self.seconds[label] += now - start
            if self._stack:
                self._stack[-1][1] = now


def _wrap(owner: Any, name: str, label: str, timer: ExclusiveTimer) -> Callable[[], None]:
    """Time ``owner.name`` under ``label``; returns the undo."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with timer.scope(label):
            return original(*args, **kwargs)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def _wrap_capture(timer: ExclusiveTimer) -> Callable[[], None]:
    """Time the hooks' work per layer call under ``capture``, and per layer type in ``timer.by_type``."""
    original = hooks.PerExampleHooks._on_output_grads

    @functools.wraps(original)
    def timed(self: hooks.PerExampleHooks, layer: torch.nn.Module, *args: Any) -> None:
        start = time.perf_counter()
        with timer.scope("capture"):
            original(self, layer, *args)
        kind = type(layer).__name__
        timer.by_type[kind] = timer.by_type.get(kind, 0.0) + time.perf_counter() - start

    hooks.PerExampleHooks._on_output_grads = timed  # type: ignore[method-assign]
    return lambda: setattr(hooks.PerExampleHooks, "_on_output_grads", original)


class HeldBytes:
    """Bytes of the per-example state handed over at each clip point (each storage once)."""

    def __init__(self) -> None:
        self.per_pop: list[int] = []

    def record(self, handed: dict[Any, grads.PerExampleGrad]) -> None:
        storages: dict[int, int] = {}
        for g in handed.values():
            for t in _tensors(g):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.per_pop.append(sum(storages.values()))


class SavedActivations(pl.Callback):
    """Bytes autograd saves for backward in one non-private step (each storage once, parameters left out).

    Enter :meth:`recording` around the run; the callback closes one step's count at every batch end.
    """

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._seen: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self._seen[storage.data_ptr()] = storage.nbytes()
        return t

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._seen = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.per_step.append(sum(n for ptr, n in self._seen.items() if ptr not in params))


def _tensors(g: grads.PerExampleGrad) -> list[torch.Tensor]:
    if isinstance(g, grads.Summed):
        return [t for part in g.parts for t in _tensors(part)]
    if isinstance(g, grads.Factored):
        return [g.left, g.right]
    if isinstance(g, grads.Dense):
        return [g.value]
    return []


@contextmanager
def instrumented(timer: ExclusiveTimer, held: HeldBytes) -> Iterator[None]:
    """The library's per-step functions wrapped with ``timer``'s scopes; ``held`` sees every hand-over."""
    undo = [_wrap(noise.GaussianNoise, "sample", "noise", timer)]
    for cls in (grads.Dense, grads.Factored, grads.Summed):
        undo += [_wrap(cls, "sq_norms", "norms", timer), _wrap(cls, "weighted_sum", "clipped sums", timer)]
    undo += [
        _wrap_capture(timer),
        _wrap(hooks, "_hookable", "output copies", timer),
        _wrap(private_step.PrivateStep, "after_backward", "glue", timer),
        _wrap(private_step.PrivateStep, "release", "glue", timer),
        _wrap(mechanism.GradientPrivatizer, "accumulate", "glue", timer),
    ]
    original_pop = hooks.PerExampleHooks.pop

    def pop(self: hooks.PerExampleHooks, rows_per_unit: int = 1) -> dict[Any, grads.PerExampleGrad]:
        handed = original_pop(self, rows_per_unit)
        held.record(handed)
        return handed

    hooks.PerExampleHooks.pop = pop  # type: ignore[method-assign]
    undo.append(lambda: setattr(hooks.PerExampleHooks, "pop", original_pop))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


class TimedSteps(pl.Callback):
    """Resets the scopes when the first timed step starts (after ``warmup`` steps)."""

    def __init__(self, timer: ExclusiveTimer, held: HeldBytes, warmup: int) -> None:
        self.timer, self.held, self.warmup = timer, held, warmup

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            self.timer.reset()
            self.held.per_pop.clear()


def breakdown(workload: str, engine: str, steps: int, warmup: int) -> dict[str, Any]:
    """Non-private and DP step time of ``workload``, and the DP step's parts."""
    w = WORKLOADS[workload]
    saved = SavedActivations()
    with saved.recording():
        plain = train_runner("nonprivate", w, steps, warmup, callbacks=[saved])
    timer, held = ExclusiveTimer(), HeldBytes()
    with instrumented(timer, held):
        dp = train_runner(f"dp_{engine}", w, steps, warmup, callbacks=[TimedSteps(timer, held, warmup)])
    plain_ms = statistics.median(at_batch(plain.step_ms(warmup), plain.rows[warmup:-1], w.batch))
    rows = dp.rows[warmup:-1]
    dp_ms = statistics.median(at_batch(dp.step_ms(warmup), rows, w.batch))
    # The closing batch (after the last timed step) runs whole too, so the scopes cover steps + 1 batches.
    scale = w.batch / max(statistics.fmean(dp.rows[warmup:]), 1e-9)  # the scopes' means at the nominal batch
    parts = {k: 1e3 * v / (steps + 1) * scale for k, v in timer.seconds.items()}
    parts["other"] = dp_ms - sum(parts.values())
    return {
        "batch": w.batch, "nonprivate_ms": plain_ms, "dp_ms": dp_ms, "dp_over_nonprivate": dp_ms / plain_ms,
        "parts_ms": parts, "parts_over_nonprivate": {k: v / plain_ms for k, v in parts.items()},
        "capture_by_layer_type_ms": {k: 1e3 * v / (steps + 1) * scale
                                     for k, v in sorted(timer.by_type.items(), key=lambda kv: -kv[1])},
        "held_mib": statistics.median(held.per_pop) / 2**20 if held.per_pop else 0.0,
        "nonprivate_saved_mib": statistics.median(saved.per_step[warmup:]) / 2**20,
        "mean_dp_rows": statistics.fmean(rows),
    }  # fmt: skip


def markdown(results: dict[str, dict[str, Any]], engine: str) -> str:
    head = ["workload (B)", "non-private ms", f"dp_{engine} ms", "×", *SCOPES, "other", "held MiB",
            "non-private saved MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        cells = [
            f"{name} ({r['batch']})", f"{r['nonprivate_ms']:.1f}", f"{r['dp_ms']:.1f}",
            f"{r['dp_over_nonprivate']:.2f}",
            *(f"{r['parts_ms'][k]:.1f} ({r['parts_over_nonprivate'][k]:+.2f})" for k in (*SCOPES, "other")),
            f"{r['held_mib']:.1f}", f"{r['nonprivate_saved_mib']:.1f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        "Cells: ms per step at the nominal batch and, in brackets, as a share of the non-private step. 'other' is "
        "the DP step minus the scopes (forward, backward without weight gradients, optimizer, Lightning); compare "
        "it with the non-private step. 'held': the per-example state flat clipping keeps at the clip point; "
        "'saved': what autograd saves for backward in a non-private step (its activations)."
    )
    lines += ["", note, ""]
    for name, r in results.items():
        shown = ", ".join(f"{k} {v:.1f}" for k, v in list(r["capture_by_layer_type_ms"].items())[:6])
        lines.append(f"- {name}: capture ms per step by layer type: {shown}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(SUITE))
    parser.add_argument("--engine", default="auto", help="the DP runner's clipping engine")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2: the verified steps)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help="the MLP for 2 timed steps: the code path only")
    parser.add_argument("--out", type=Path, default=default_result("overhead_breakdown_cpu.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.steps, args.warmup = ["mlp_mnist"], 2, 2
    if args.warmup < 2:
        parser.error("--warmup must be >= 2: the first two steps are verified and would be timed")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.models:
        results[name] = breakdown(name, args.engine, args.steps, args.warmup)
        print(f"{name}: {results[name]['dp_over_nonprivate']:.2f}x", flush=True)
    table = markdown(results, args.engine)
    print(table)
    write_report(args.out, "overhead_breakdown", args.threads, vars(args), results=results)
    args.out.with_suffix(".md").write_text(table)
    return results


if __name__ == "__main__":
    main()
