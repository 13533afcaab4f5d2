"""Step time and peak memory against the sequence length T and the batch B, with ``auto``'s engine per layer.

Full run (on 2 idle cores) and a smoke run (tiny sizes, in this process, under a minute)::

    .venv/bin/python benchmarks/scaling_curves.py --out benchmarks/results/scaling_curves_cpu.json \
        --figures docs/figures
    .venv/bin/python benchmarks/scaling_curves.py --smoke --out scaling_smoke.json --figures scaling_smoke

Curves: against T (``--seqs``, default 64 ... 2048) at a fixed batch (``--seq-batch``, 32), and
against B (``--batches``, 8 ... 128) at a fixed T (``--batch-seq``, 64); ``--axis`` picks one or
both. A point on both curves (B = 32, T = 64 by default) is measured once.

Workload ``tokens`` (the default): token ids -> ``Embedding(vocab, width)`` -> ``depth`` x
(``Linear(width, width)`` + Tanh) -> ``Linear(width, 10)``, every layer applied per token, the
logits averaged over the tokens; one label per sequence (cross-entropy). Every hooked layer
therefore sees T rows per example, so the per-layer thresholds of ``auto`` fall at fixed T:
with width 256 the ``Linear(256, 256)`` layers switch from book-keeping to instantiation above
T = 181, the head above T = 35 and the embedding (vocabulary 1024) above T = 362. Workload
``gptneo``: ``engines.py``'s GPT-Neo causal LM with room for the longest T (slow on a CPU).

Runners: ``engines.py``'s (non-private, ``dp_<engine>`` for ``auto``, ``book_keeping``,
``instantiate``, Opacus ``hooks`` and ``ghost``), trained by ``engines.train_runner``: AdamW,
σ = 1, C = 1, flat clipping, Poisson sampling. Every measurement runs in a fresh process
(``_harness.in_fresh_process``: peak RSS and its growth over the RSS before training, step time
by ``StepClock``, retried while other processes take CPU); at each point the runners alternate
over ``--repeats``. The DP strategy's ``verify_gradients`` default checks the first two steps,
so ``--warmup`` should stay >= 2 (the default).

**auto's choice.** In each ``dp_auto`` run a callback reads the strategy's engine of every hooked
layer once the hooks are set up (``DPStrategy.private_step.engines()``, the rows of
``DPStrategy.engine_table()``, which is stored as well). A factored layer's row reads
``book_keeping for T <= N, else instantiate``; N is the largest T for which the ghost norm pays
(2T² < a·b, the rule ``auto`` applies per call), so at a point of T tokens the layer ran
book-keeping if T <= N, else instantiation. Beside it stand the measured time and memory of the
fixed ``book_keeping`` and ``instantiate`` runners at the same point, which of them is cheaper,
and ``auto`` over the cheaper one.

**Skipped points.** Before each point every runner's step time and peak RSS are predicted from
its last two points on the curve (log-log slope clamped to [1, 2]; slope 2 after one point).
A runner predicted above ``--max-step-s`` or ``--max-peak-mib`` is skipped there, with the
prediction as the reason, and so is every larger point of that curve (also after a run that ran
out of memory: a killed process or ``MemoryError``). A run that fails otherwise is recorded as
failed, with its error, and the curve goes on.

**Batches from 8.** Opacus' ghost norm of an embedding fails on an empty Poisson batch (a
reshape of 0 elements, Opacus 1.6), which B = 4 draws here; from B = 8 an empty batch has
probability < 0.1 % per step.

Outputs: the JSON record (provenance, settings, every point: each runner's summary or why it was
skipped, auto's engines, the engine comparison), rewritten after every point; ``NAME.md`` (the
tables); figures ``NAME_time_<axis>.png`` and ``NAME_memory_<axis>.png`` (log-log, one line per
runner; the memory figure plots the peak RSS growth over the RSS before training, as the
~450 MiB of libraries in peak RSS would flatten the curves).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import re
import warnings
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _harness import in_fresh_process, measured, provenance, provenance_line, summarise
from _outputs import default_figures, default_result
from engines import NUM_CLASSES, RUNNERS, VOCAB, Workload, _gptneo, train_runner
from torch import Tensor, nn

import dplightning

AXES = {"seq": "T", "batch": "B"}
FIXED = ("book_keeping", "instantiate")
# Time: the median step scaled to the nominal batch (a DP runner's Poisson batches vary; _harness.summarise).
METRICS = {"time": "median_ms_at_batch", "peak": "peak_rss_mib", "growth": "rss_growth_mib"}
MIN_SLOPE, MAX_SLOPE = 1.0, 2.0  # the cost of a step grows at least linearly, at most as T² (Opacus' Grams)
_AUTO_ROW = re.compile(r"book_keeping for T <= (\d+), else instantiate")


@dataclass(frozen=True)
class Model:
    """The workload's model: ``tokens`` (embedding, Linear stack, head) or ``gptneo``."""

    workload: str = "tokens"
    width: int = 256
    depth: int = 4
    vocab: int = 1024
    max_seq: int = 2048  # GPT-Neo's position table


class TokenStack(nn.Module):
    """Embedding, ``depth`` x (Linear + Tanh) and a Linear head per token; logits averaged over tokens."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.stack = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.stack(self.embed(ids))).mean(1)


def _token_ids(seq: int, vocab: int, n: int, g: torch.Generator) -> Tensor:
    return torch.randint(0, vocab, (n, seq), generator=g)


def workload(model: Model, batch: int, seq: int) -> Workload:
    """``model`` at one point of a curve, as ``engines.train_runner`` takes it."""
    if model.workload == "gptneo":
        ids = functools.partial(_token_ids, seq, VOCAB)
        return Workload(functools.partial(_gptneo, model.max_seq), ids, batch, language_model=True)
    build = functools.partial(TokenStack, model.vocab, model.width, model.depth)
    return Workload(build, functools.partial(_token_ids, seq, model.vocab), batch)


class EngineProbe(pl.Callback):
    """Reads the DP strategy's engine of every hooked layer once fit has set the hooks up."""

    def __init__(self) -> None:
        self.engines: dict[str, str] = {}
        self.table = ""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, dplightning.DPStrategy) and strategy.private_step is not None:
            self.engines = strategy.private_step.engines()
            self.table = strategy.engine_table()


def measure(runner: str, model: Model, batch: int, seq: int, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    """One runner at one point in this (fresh) process: its timed steps, memory and (DP) engines."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    probe = EngineProbe()
    w = workload(model, batch, seq)
    run = measured(lambda: (train_runner(runner, w, steps, warmup, callbacks=[probe]), warmup))
    return {**run, "engines": probe.engines, "engine_table": probe.table}


def auto_engines(engines: dict[str, str], table: str, tokens: int) -> dict[str, Any]:
    """The engine ``auto`` ran on each layer at ``tokens`` rows per example (every layer's T here)."""
    layers = {}
    for name, described in engines.items():
        found = _AUTO_ROW.fullmatch(described)
        limit = int(found[1]) if found else None
        chosen = described if limit is None else ("book_keeping" if tokens <= limit else "instantiate")
        layers[name] = {"described": described, "tokens": tokens, "limit": limit, "engine": chosen}
    return {"layers": layers, "table": table}


def compare_engines(runners: dict[str, Any]) -> dict[str, Any] | None:
    """Per metric: the fixed engines' and auto's values, the cheaper fixed engine, auto over it."""
    names = ["dp_auto", *(f"dp_{e}" for e in FIXED)]
    if any("median_ms" not in runners.get(n, {}) for n in names):
        return None
    out = {}
    for metric, key in METRICS.items():
        values = {e: runners[f"dp_{e}"][key] for e in FIXED}
        cheaper = min(FIXED, key=lambda e: values[e])
        auto = runners["dp_auto"][key]
        ratio = auto / values[cheaper] if values[cheaper] > 0 else None
        out[metric] = {**values, "auto": auto, "cheaper": cheaper, "auto_over_cheaper": ratio}
    return out


def _slope(x0: float, y0: float, x1: float, y1: float) -> float:
    slope = math.log(max(y1, 1e-9) / max(y0, 1e-9)) / math.log(x1 / x0)
    return min(max(slope, MIN_SLOPE), MAX_SLOPE)


def predict(history: list[tuple[int, dict[str, Any]]], x: int) -> dict[str, float] | None:
    """A runner's step ms and peak RSS MiB at axis value ``x`` from its measured points below it (ascending)."""
    history = [(v, r) for v, r in history if "median_ms" in r]  # a shared point may follow a skipped one
    if not history:
        return None
    x1, last = history[-1]
    growth1 = max(last["rss_growth_mib"], 1.0)
    slope_t = slope_m = MAX_SLOPE
    if len(history) > 1:
        x0, prev = history[-2]
        slope_t = _slope(x0, prev["median_ms"], x1, last["median_ms"])
        slope_m = _slope(x0, max(prev["rss_growth_mib"], 1.0), x1, growth1)
    scale = x / x1
    base = last["peak_rss_mib"] - last["rss_growth_mib"]
    return {"step_ms": last["median_ms"] * scale**slope_t, "peak_rss_mib": base + growth1 * scale**slope_m}


def skip_reason(history: list[tuple[int, dict[str, Any]]], x: int, args: argparse.Namespace) -> str | None:
    """Why a runner is not measured at ``x`` (``None``: it is); ``history`` holds its earlier points of the curve."""
    if history and ("skipped" in history[-1][1] or history[-1][1].get("out_of_memory")):
        return f"not measured: its point at {history[-1][0]} was skipped or ran out of memory"
    guess = predict(history, x)
    if guess is None:
        return None
    if guess["step_ms"] > 1e3 * args.max_step_s:
        return f"predicted {guess['step_ms'] / 1e3:.1f} s per step > --max-step-s {args.max_step_s:g}"
    if guess["peak_rss_mib"] > args.max_peak_mib:
        return f"predicted peak RSS {guess['peak_rss_mib']:.0f} MiB > --max-peak-mib {args.max_peak_mib:g}"
    return None


def measure_point(
    batch: int, seq: int, history: dict[str, list[tuple[int, dict[str, Any]]]], x: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Every runner at (B, T), interleaved over the repeats; skipped and failed runners say why."""
    model = args.model
    point: dict[str, Any] = {"batch": batch, "seq": seq, "runners": {}}
    reasons = {r: skip_reason(history.get(r, []), x, args) for r in args.runners}
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in args.runners if reasons[r] is None}
    failed: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for runner in [r for r in runs if r not in failed]:
            job = (runner, model, batch, seq, args.steps, args.warmup, args.threads)
            try:
                runs[runner].append(_run(job, args, f"B={batch} T={seq} {runner}"))
            except Exception as error:  # the curve goes on without this runner's point
                memory = isinstance(error, (BrokenProcessPool, MemoryError))  # a killed process: most likely OOM
                failed[runner] = {"failed": f"{type(error).__name__}: {error}", "out_of_memory": memory}
    for runner in args.runners:
        if reasons[runner] is not None:
            point["runners"][runner] = {"skipped": reasons[runner]}
        elif runner in failed:
            point["runners"][runner] = failed[runner]
        else:
            tables = [(r.pop("engines"), r.pop("engine_table")) for r in runs[runner]]
            point["runners"][runner] = summarise(runs[runner], expected_rows=batch)
            guess = predict(history.get(runner, []), x)
            point["runners"][runner]["predicted"] = guess
            if runner == "dp_auto":
                point["auto_engines"] = auto_engines(*tables[0], seq)
    point["engines"] = compare_engines(point["runners"])
    return point


def _run(job: tuple[Any, ...], args: argparse.Namespace, label: str) -> dict[str, Any]:
    if args.smoke:  # seconds, not a measurement: no fresh interpreter (each costs seconds of imports)
        return measure(*job)
    return in_fresh_process(measure, job, args.max_other_cpu, label)


def axis_points(axis: str, args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(axis value, B, T) of every point of a curve, ascending."""
    if axis == "seq":
        return [(t, args.seq_batch, t) for t in sorted(args.seqs)]
    return [(b, b, args.batch_seq) for b in sorted(args.batches)]


def run_curves(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Both curves (or one), a point measured once if both hold it; ``save`` gets the curves after every point."""
    axes = list(AXES) if args.axis == "both" else [args.axis]
    done: dict[tuple[int, int], dict[str, Any]] = {}
    curves: dict[str, Any] = {}
    for axis in axes:
        fixed = {"batch": args.seq_batch} if axis == "seq" else {"seq": args.batch_seq}
        curve = curves[axis] = {"fixed": fixed, "values": [], "points": {}}
        history: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for x, batch, seq in axis_points(axis, args):
            if (batch, seq) not in done:
                done[batch, seq] = measure_point(batch, seq, history, x, args)
            point = curve["points"][str(x)] = done[batch, seq]
            curve["values"].append(x)
            for runner, result in point["runners"].items():
                history.setdefault(runner, []).append((x, result))
            _print_point(point)
            save(curves)
    return curves


def _print_point(point: dict[str, Any]) -> None:
    cells = []
    for runner, r in point["runners"].items():
        cells.append(f"{runner} {r['median_ms_at_batch']:.0f} ms {r['peak_rss_mib']:.0f} MiB" if "median_ms" in r else
                     f"{runner} {_cell(r, 'median_ms', '')}")  # fmt: skip
    print(f"B={point['batch']} T={point['seq']}: " + "; ".join(cells), flush=True)


def _auto_cell(point: dict[str, Any]) -> str:
    layers = point.get("auto_engines", {}).get("layers", {})
    by_engine: dict[str, list[str]] = {}
    for name, layer in layers.items():
        # GPT-Neo's blocks as one: transformer.h.*.mlp.c_fc
        by_engine.setdefault(layer["engine"], []).append(re.sub(r"\.\d+\.", ".*.", name.removeprefix("net.")))
    return "; ".join(f"{e}: {', '.join(dict.fromkeys(names))}" for e, names in by_engine.items()) or "n/a"


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return format(r[key], fmt) if key in r else ("failed" if "failed" in r else "skipped")


TABLES = (("median ms per step at the nominal batch (× B / rows)", "median_ms_at_batch", ".0f"),
          ("median ms per step (raw)", "median_ms", ".0f"), ("peak RSS MiB", "peak_rss_mib", ".0f"),
          ("peak RSS growth MiB", "rss_growth_mib", ".0f"))  # fmt: skip


def markdown(record: dict[str, Any]) -> str:
    """The tables of a record: per curve, each runner's time and memory, then auto's engines against the fixed ones."""
    lines = ["# Step time and peak memory against T and B", "", provenance_line(record)]
    model = ", ".join(f"{k} {v}" for k, v in record["model"].items())
    lines += [f"Workload: {model}; {record['repeats']} x {record['steps']} timed steps after "
              f"{record['warmup']} warm-up per runner and point, {record['threads']} thread(s).", ""]  # fmt: skip
    notes: list[str] = []
    for axis, curve in record["curves"].items():
        symbol, fixed = AXES[axis], ", ".join(f"{k} = {v}" for k, v in curve["fixed"].items())
        points = [curve["points"][str(x)] for x in curve["values"]]
        head = "| runner | " + " | ".join(f"{symbol}={x}" for x in curve["values"]) + " |"
        rule = "|---|" + "---|" * len(points)
        for title, key, fmt in TABLES:
            lines += [f"## {title} against {symbol} ({fixed})", "", head, rule]
            for runner in record["runners"]:
                lines.append(
                    f"| {runner} | " + " | ".join(_cell(p["runners"][runner], key, fmt) for p in points) + " |"
                )
            lines.append("")
        lines += [f"## auto's engine per layer against {symbol} ({fixed})", "",
                  "| point | auto ran | ms bk / inst / auto | cheaper | auto ÷ cheaper | growth MiB bk / inst / auto | "
                  "cheaper | auto ÷ cheaper |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for x, p in zip(curve["values"], points):
            e = p["engines"]
            if e is None:
                lines.append(f"| {symbol}={x} | {_auto_cell(p)} | skipped | | | | | |")
                continue
            t, g = e["time"], e["growth"]
            lines.append(
                f"| {symbol}={x} | {_auto_cell(p)} | {t['book_keeping']:.0f} / {t['instantiate']:.0f} / "
                f"{t['auto']:.0f} | {t['cheaper']} | {_ratio(t)} | {g['book_keeping']:.0f} / {g['instantiate']:.0f} / "
                f"{g['auto']:.0f} | {g['cheaper']} | {_ratio(g)} |"
            )
        lines.append("")
        for x, p in zip(curve["values"], points):
            notes += [f"- {symbol}={x}, {r}: {v.get('skipped') or 'failed: ' + v['failed']}"
                      for r, v in p["runners"].items() if "median_ms" not in v]  # fmt: skip
    if notes:
        lines += ["## Not measured", "", *dict.fromkeys(notes), ""]
    return "\n".join(lines)


def _ratio(metric: dict[str, Any]) -> str:
    return "n/a" if metric["auto_over_cheaper"] is None else f"{metric['auto_over_cheaper']:.2f}"


PLOTS = (("time", "median_ms_at_batch", "median ms per step at the nominal batch (× B / rows)"),
         ("memory", "rss_growth_mib", "peak RSS growth over the RSS before training (MiB)"))  # fmt: skip


def figures(record: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    """Per curve: time and memory (peak RSS growth) against the axis, log-log, one line per runner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for axis, curve in record["curves"].items():
        symbol, fixed = AXES[axis], ", ".join(f"{k} = {v}" for k, v in curve["fixed"].items())
        for metric, key, label in PLOTS:
            fig, ax = plt.subplots(figsize=(6.5, 4.5))
            for runner in record["runners"]:
                xy = [(x, curve["points"][str(x)]["runners"][runner].get(key)) for x in curve["values"]]
                xy = [(x, y) for x, y in xy if y is not None and y > 0]
                if xy:
                    ax.plot(*zip(*xy), "o-", label=runner)
            if axis == "seq":
                _mark_auto_switches(ax, curve)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(curve["values"], [str(x) for x in curve["values"]])
            ax.set_xlabel(f"{symbol} ({'tokens per example' if axis == 'seq' else 'rows per step'})")
            ax.set_ylabel(label)
            ax.set_title(f"{metric} against {symbol} ({fixed}); {record['model']['workload']}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = folder / f"{stem}_{metric}_{axis}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
            plt.close(fig)
            paths.append(path)
    return paths


def _mark_auto_switches(ax: Any, curve: dict[str, Any]) -> None:
    """Dotted lines where auto switches layers from book-keeping to instantiation (their thresholds N)."""
    limits: dict[int, list[str]] = {}
    for p in curve["points"].values():
        for name, layer in p.get("auto_engines", {}).get("layers", {}).items():
            if layer["limit"] is not None and name not in limits.get(layer["limit"], []):
                limits.setdefault(layer["limit"], []).append(name)
    low, high = min(curve["values"]), max(curve["values"])
    for limit, names in sorted(limits.items()):
        if low <= limit < high:
            ax.axvline(limit + 0.5, color="grey", linestyle=":", linewidth=1)
            shown = ", ".join(n.removeprefix("net.") for n in names[:3]) + (", ..." if len(names) > 3 else "")
            ax.text(limit + 0.5, 0.02, f" auto: instantiate above T={limit} ({shown})", rotation=90, fontsize=6,
                    transform=ax.get_xaxis_transform(), va="bottom", color="grey",
                    bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})  # fmt: skip


SMOKE = dict(width=16, depth=2, vocab=64, seqs=[8, 16], seq_batch=8, batches=[8, 16], batch_seq=8, steps=2, warmup=2,
             repeats=1, threads=1)  # fmt: skip
"""Tiny sizes whose auto choices differ per layer (stack and head switch between T = 8 and 16, the embedding not)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--axis", choices=["seq", "batch", "both"], default="both")
    parser.add_argument("--workload", choices=["tokens", "gptneo"], default="tokens")
    parser.add_argument("--width", type=int, default=256, help="tokens: width of the embedding and the stack")
    parser.add_argument("--depth", type=int, default=4, help="tokens: Linear + Tanh blocks")
    parser.add_argument("--vocab", type=int, default=1024, help="tokens: vocabulary of the embedding")
    parser.add_argument("--seqs", nargs="+", type=int, default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--seq-batch", type=int, default=32, help="B of the curve against T")
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    parser.add_argument("--batch-seq", type=int, default=64, help="T of the curve against B")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=RUNNERS)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (>= 2: verified steps)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per runner and point, interleaved")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-other-cpu", type=float, default=5.0, help="retry a repeat above this %% (100 = never)")
    parser.add_argument("--max-step-s", type=float, default=30.0, help="skip a point predicted slower per step")
    parser.add_argument("--max-peak-mib", type=float, default=8192.0, help="skip a point predicted above this peak")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat, in this process (seconds)")
    parser.add_argument("--out", type=Path, default=default_result("scaling_curves_cpu.json"))
    parser.add_argument("--figures", type=Path, default=default_figures(), help="folder of the figures")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    args.runners = list(dict.fromkeys(args.runners))
    args.model = Model(args.workload, args.width, args.depth, args.vocab, max(args.seqs + [args.batch_seq]))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure the curves, write the JSON (after every point), the markdown tables and the figures."""
    args = _parse(argv)
    settings = {**{k: v for k, v in vars(args).items() if k not in ("model", "out")}, "model": asdict(args.model)}
    if args.workload == "gptneo":  # engines.py's GPT-Neo config, with room for the longest T
        settings["model"] = {"workload": "gptneo", "max_seq": args.model.max_seq}
    else:
        del settings["model"]["max_seq"]

    # The command of this call, also when main(argv) runs inside another program (a test).
    origin = provenance(args.threads, None if argv is None else [__file__, *argv])

    def save(curves: dict[str, Any]) -> None:
        record = {"benchmark": "scaling_curves", **origin, **settings, "curves": curves}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")  # settings hold paths

    run_curves(args, save)
    record = json.loads(args.out.read_text())
    args.out.with_suffix(".md").write_text(markdown(record))
    for path in figures(record, args.figures, args.out.stem):
        print(f"wrote {path}")
    print(f"wrote {args.out.with_suffix('.md')}")
    return record


if __name__ == "__main__":
    main()
