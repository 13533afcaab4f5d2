"""Peak memory and step time of DP-GRAPE vs DP-Adam vs non-private Adam, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/grape_memory.py                 # both models, every runner
    OMP_NUM_THREADS=1 python benchmarks/grape_memory.py --models vit --steps 4
    OMP_NUM_THREADS=1 python benchmarks/grape_memory.py --curve --out benchmarks/results/grape_memory_curve_cpu.json \
        --figures docs/figures          # peak memory against the batch size, planner beside it

Models (random weights from a config, random inputs and labels, 10 classes):

* ``vit``: Hugging Face ``ViTForImageClassification``, 6 layers, width 256, FFN 1024, 4 heads,
  3x32x32 images in 4x4 patches (65 tokens);
* ``roberta``: a RoBERTa-like encoder (``RobertaForSequenceClassification``), 6 layers, width
  256, FFN 1024, 4 heads, vocabulary 8192, 64 tokens.

Runners, all through ``Trainer.fit`` with the same AdamW hyperparameters:

* ``adam``: non-private AdamW (``strategy="auto"``);
* ``dp-adam``: ``dplightning.DPStrategy`` with ``torch.optim.AdamW``, engine ``auto`` (the default:
  book-keeping / ghost norms where they pay, so per-example weight gradients are *not* formed);
* ``dp-adam-inst``: the same with ``clipping_engine="instantiate"``: every per-example gradient
  formed, as Opacus' hooks store them (the storage of the issue's "DP-Adam (Opacus hooks)");
* ``opacus-hooks``: Opacus 1.6 ``make_private`` (hooks mode: per-example gradients stored on every
  parameter) driving a plain loop with ``torch.optim.AdamW``; ViT's embeddings get dplightning's
  sampler, as in ``engines.py`` (Opacus has none);
* ``dp-grape``: ``DPStrategy`` with ``dplightning.optim.DPGrape`` (``--rank``, T = 100).

Every DP runner: σ = 1, C = 1, flat clipping, ``poisson_sampling=False`` (every batch has exactly
B rows, the shape compared), ``verify_gradients="never"`` (the default's two verification steps
keep autograd's full ``p.grad``, a one-off of the first steps, not the steady state measured).

**Peak memory** is the largest running total of the CPU allocator's live bytes over the whole fit
(``torch.profiler`` memory events, ``Total Allocated``; the method of ``memory_plan_check.py``),
profiling from before the model is built, in a fresh process per measurement: weights, optimizer
states, buckets, activations, per-example gradients and temporaries, without the interpreter and
libraries that peak RSS mixes in. **Step time** is measured in *another* fresh process without the
profiler (``_harness.StepClock``: the gap between step starts, warm-up dropped), one thread.
**Largest batch in a budget**: peak memory is affine in the batch, so it is measured at two batch
sizes per runner and the fit's largest batch under ``--budget-mib`` is reported (``--check-largest``
measures it once at that batch, to check the fit).

**The curve** (``--curve``): peak memory of every runner at each batch of ``--batches`` (default
1, 2, 8, 32, 128), each point in a fresh process as above, no timing. Beside every DP point of
``roberta`` stands the planner's estimate (``dplightning.planning.memory.plan`` of the same
shape as a ``DPSequenceClassifier`` fit config: engine ``auto`` for ``dp-adam`` and ``dp-grape``,
``instantiate`` for ``dp-adam-inst``); the planner models Hugging Face text models only, so the
ViT and the two non-dplightning runners have no estimate. The figure plots peak MiB against B
per model; the JSON also holds DP-GRAPE's ratio to every other runner at every B.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _harness import StepClock, in_fresh_process, measured, quiet_trainer, summarise, write_report
from _outputs import default_figures, default_result
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

RUNNERS = ("adam", "dp-adam", "dp-adam-inst", "opacus-hooks", "dp-grape")
MODELS = {
    "vit": dict(model_type="vit", image_size=32, patch_size=4, num_channels=3, hidden_size=256, num_hidden_layers=6,
                num_attention_heads=4, intermediate_size=1024, num_labels=10, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0),
    "roberta": dict(model_type="roberta", vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                    intermediate_size=1024, max_position_embeddings=80, num_labels=10, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pad_token_id=1),
}  # fmt: skip
TOKENS = 64
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)


class _Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        super().__init__()
        fields = dict(config)
        config_ = AutoConfig.for_model(fields.pop("model_type"), **fields)
        self.model = AutoModelForSequenceClassification.from_config(config_)

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


class _Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module, optimizer: str, rank: int) -> None:
        super().__init__()
        self.net, self.optimizer_name, self.rank = net, optimizer, rank

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction="sum") / max(len(y), 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "dp-grape":
            from dplightning.optim import DPGrape

            return DPGrape(self.parameters(), rank=self.rank, refresh_every=100, **HYPER)
        return torch.optim.AdamW(self.parameters(), **HYPER)


def _build(model: str, runner: str, rank: int) -> _Classifier:
    torch.manual_seed(0)
    if model == "vit":
        from dplightning.models import HFImageClassifier

        net: nn.Module = HFImageClassifier(MODELS["vit"])
    else:
        net = _Encoder(MODELS["roberta"])
    return _Classifier(net, runner, rank)


def _data(model: str, batch: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = batch * (steps + 2)
    x = torch.rand(n, 3, 32, 32, generator=g) if model == "vit" else torch.randint(3, 8192, (n, TOKENS), generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=g)), batch_size=batch, shuffle=True)


def _trainer(runner: str, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    import dplightning

    strategy: Any = "auto"
    if runner != "adam":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = dplightning.DPStrategy(
                noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, verify_gradients="never",
                clipping_engine="instantiate" if runner == "dp-adam-inst" else "auto",
            )  # fmt: skip
    return quiet_trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=callbacks)


def _quiet() -> None:
    import logging

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def _opacus_fit(module: _Classifier, loader: DataLoader, clock: StepClock) -> None:
    import opacus
    from engines import _register_vit_sampler_with_opacus

    _register_vit_sampler_with_opacus()
    net, opt = module.net, torch.optim.AdamW(module.net.parameters(), **HYPER)
    engine = opacus.PrivacyEngine(accountant="prv")
    net, opt, loader = engine.make_private(
        module=net, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False
    )
    for x, y in loader:
        if clock.tick(len(x)):
            break
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(net(x), y, reduction="sum") / max(len(y), 1)).backward()
        opt.step()


def _fit(model: str, runner: str, batch: int, rank: int, steps: int, clock: StepClock | None = None) -> _Classifier:
    module = _build(model, runner, rank)
    data = _data(model, batch, steps)
    if runner == "opacus-hooks":
        _opacus_fit(module, data, clock or StepClock(steps))
    else:
        _trainer(runner, steps + (clock is not None), [clock] if clock else []).fit(module, data)
    return module


def peak_memory(model: str, runner: str, batch: int, rank: int, steps: int) -> dict[str, Any]:
    """Peak live CPU tensor bytes of ``steps`` steps (this process), by the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    _quiet()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        module = _fit(model, runner, batch, rank, steps)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    cpu = [e for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == 0]
    totals = [e["args"]["Total Allocated"] for e in cpu]
    params = sum(p.numel() for p in module.parameters())
    return {"peak_mib": max(totals) / 2**20, "params": params, "foreign_cpu_pct": 0.0}


def step_time(model: str, runner: str, batch: int, rank: int, steps: int, warmup: int) -> dict[str, Any]:
    """Step times of ``warmup + steps`` steps (this process, no profiler)."""
    _quiet()

    def train() -> tuple[StepClock, int]:
        clock = StepClock(warmup + steps)
        _fit(model, runner, batch, rank, warmup + steps, clock)
        return clock, warmup

    return measured(train)


def _largest_batch(points: dict[int, float], budget: float) -> int:
    (b1, m1), (b2, m2) = sorted(points.items())
    slope = (m2 - m1) / (b2 - b1)
    return max(int(math.floor(b1 + (budget - m1) / slope)), 0) if slope > 0 else -1


def planned_mib(model: str, runner: str, batch: int, rank: int) -> float | None:
    """The planner's peak for ``runner`` at ``batch`` (MiB), or ``None`` where it has no model of the run."""
    if model != "roberta" or runner not in ("dp-adam", "dp-adam-inst", "dp-grape"):
        return None
    from dplightning.planning.memory import plan

    grape = runner == "dp-grape"
    args = {**HYPER, "betas": list(HYPER["betas"]), **({"rank": rank, "refresh_every": 100} if grape else {})}
    optimizer = {"class_path": "dplightning.optim.DPGrape" if grape else "torch.optim.AdamW", "init_args": args}
    strategy = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "poisson_sampling": False, "verify_gradients": "never",
                "clipping_engine": "instantiate" if runner == "dp-adam-inst" else "auto"}  # fmt: skip
    config = {
        "trainer": {"accelerator": "cpu", "precision": "32-true",
                    "strategy": {"class_path": "dplightning.DPStrategy", "init_args": strategy}},
        "model": {"class_path": "dplightning.tasks.DPSequenceClassifier",
                  "init_args": {"config": dict(MODELS["roberta"]), "num_labels": 10, "optimizer": optimizer}},
        "data": {"init_args": {"batch_size": batch, "max_length": TOKENS}},
    }  # fmt: skip
    return plan(config).peak / 2**20


def curve(
    models: list[str], runners: list[str], batches: list[int], rank: int, steps: int,
    save: Callable[[dict[str, Any]], None], done: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Measured (fresh process per point) and planned peak MiB of every runner at every batch.

    ``save`` gets the results after every point, so a crash loses one point; ``done`` holds the
    points of an earlier run of the same settings, which are kept instead of measured again.
    """
    results: dict[str, Any] = done or {}
    for model in models:
        rows = results.setdefault(model, {})
        for runner in runners:
            points = rows.setdefault(runner, {})
            for b in batches:
                if str(b) in points:
                    continue
                got = in_fresh_process(peak_memory, (model, runner, b, rank, steps), 100.0, f"{model}/{runner}/B={b}")
                planned = planned_mib(model, runner, b, rank)
                points[str(b)] = {"measured_mib": got["peak_mib"], "planned_mib": planned}
                note = f", planner {planned:.1f} ({planned / got['peak_mib'] - 1:+.0%})" if planned else ""
                print(f"{model}/{runner} B={b}: {got['peak_mib']:.1f} MiB{note}", flush=True)
                save(results)
        if "dp-grape" in rows:
            rows["dp-grape_ratio"] = {
                other: {b: rows["dp-grape"][b]["measured_mib"] / rows[other][b]["measured_mib"] for b in rows[other]}
                for other in runners if other != "dp-grape"
            }  # fmt: skip
    return results


def curve_markdown(results: dict[str, Any]) -> str:
    """The curve as markdown tables: measured MiB (planner in brackets) and DP-GRAPE's ratio, per model."""
    lines = []
    for model, rows in results.items():
        runners = [r for r in rows if r in RUNNERS]
        batches = list(rows[runners[0]])
        lines += [f"**{model}**: peak MiB (planner)", "", "| runner | " + " | ".join(f"B={b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]  # fmt: skip
        for runner in runners:
            cells = []
            for b in batches:
                point = rows[runner][b]
                planned = f" ({point['planned_mib']:.0f})" if point["planned_mib"] else ""
                cells.append(f"{point['measured_mib']:.0f}{planned}")
            lines.append(f"| {runner} | " + " | ".join(cells) + " |")
        for other, ratios in rows.get("dp-grape_ratio", {}).items():
            lines.append(f"| dp-grape ÷ {other} | " + " | ".join(f"{ratios[b]:.2f}" for b in batches) + " |")
        lines.append("")
    return "\n".join(lines)


def curve_figure(results: dict[str, Any], path: Path) -> None:
    """Peak MiB against B, one panel per model; measured solid, the planner's estimate dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items()):
        for i, (runner, points) in enumerate((r, p) for r, p in rows.items() if r in RUNNERS):
            batches = [int(b) for b in points]
            color = f"C{i}"
            ax.plot(batches, [p["measured_mib"] for p in points.values()], "o-", color=color, label=runner)
            planned = [(int(b), p["planned_mib"]) for b, p in points.items() if p["planned_mib"]]
            if planned:
                ax.plot(*zip(*planned), "x--", color=color, alpha=0.7, label=f"{runner} (planner)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B (rows per step)")
        ax.set_ylabel("peak allocated MiB (CPU, fp32)")
        ax.set_title(model)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("DP-GRAPE peak memory against the batch size (measured; planner dashed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--small-batch", type=int, default=8, help="second batch of the affine memory fit")
    parser.add_argument("--rank", type=int, default=16, help="DP-GRAPE's r")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=512.0)
    parser.add_argument("--check-largest", action="store_true", help="measure the peak at the fitted largest batch")
    parser.add_argument("--max-other-cpu", type=float, default=100.0, help="retry above this foreign CPU share (%%)")
    parser.add_argument("--curve", action="store_true", help="peak memory at every --batches point (no timing)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8, 32, 128], help="the curve's batches")
    parser.add_argument("--figures", type=Path, default=default_figures(), help="the curve's figure folder")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: outputs/benchmarks/)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.curve:
        out = args.out or default_result("grape_memory_curve_cpu.json")
        settings = {**vars(args), "figures": str(args.figures)}
        done = None
        if out.exists():  # resume a run of the same settings (a crash loses one point, not the curve)
            old = json.loads(out.read_text())
            same = all(old.get(k) == settings[k] for k in ("rank", "memory_steps"))
            done = old["results"] if same and old.get("benchmark") == "grape_memory_curve" else None
            if done is None:
                raise SystemExit(f"{out} holds another benchmark or other settings: move it away or pick --out")
        measured: list[bool] = []

        def save(r: dict[str, Any]) -> None:
            measured.append(True)
            write_report(out, "grape_memory_curve", 1, settings, results=r)

        results = curve(args.models, args.runners, args.batches, args.rank, args.memory_steps, save, done)
        if measured:  # a rerun that measures nothing keeps the record's command and environment
            write_report(out, "grape_memory_curve", 1, settings, results=results)
        curve_figure(results, args.figures / f"{out.stem}.png")
        print(curve_markdown(results))
        return
    args.out = args.out or default_result("grape_memory_cpu.json")
    results: dict[str, Any] = {}
    for model in args.models:
        rows: dict[str, Any] = {}
        for runner in args.runners:
            label = f"{model}/{runner}"
            mem = {
                b: in_fresh_process(peak_memory, (model, runner, b, args.rank, args.memory_steps), 100.0, label)
                for b in (args.small_batch, args.batch)
            }
            timing = summarise([in_fresh_process(step_time, (model, runner, args.batch, args.rank, args.steps,
                                                             args.warmup), args.max_other_cpu, label)])  # fmt: skip
            largest = _largest_batch({b: m["peak_mib"] for b, m in mem.items()}, args.budget_mib)
            check = (
                in_fresh_process(peak_memory, (model, runner, largest, args.rank, args.memory_steps), 100.0, label)
                if largest > 0 and args.check_largest
                else None
            )
            rows[runner] = {
                "params": mem[args.batch]["params"],
                "peak_mib": {str(b): m["peak_mib"] for b, m in mem.items()},
                "median_step_ms": timing["median_ms"],
                "step_ms": timing["runs"][0]["step_ms"],
                "foreign_cpu_pct": timing["foreign_cpu_pct"],
                "largest_batch_in_budget": largest,
                "peak_mib_at_largest": check["peak_mib"] if check else None,
            }
            print(f"{label}: peak {rows[runner]['peak_mib'][str(args.batch)]:.1f} MiB at B={args.batch}, "
                  f"{timing['median_ms']:.0f} ms/step, largest batch in {args.budget_mib:.0f} MiB: {largest}",
                  flush=True)  # fmt: skip
        results[model] = rows
        _print_table(model, rows, args)
        write_report(args.out, "grape_memory", 1, vars(args), results=results)  # after each model


def _print_table(model: str, rows: dict[str, Any], args: argparse.Namespace) -> None:
    base = rows.get("dp-adam")
    head = f"| {model} runner | peak MiB (B={args.batch}) | vs DP-Adam | step ms | vs DP-Adam | "
    head += f"largest B in {args.budget_mib:.0f} MiB |"
    print(head + "\n|" + "---|" * 6)
    for runner, r in rows.items():
        peak, ms = r["peak_mib"][str(args.batch)], r["median_step_ms"]
        rel = ("", "")
        if base:
            rel = (f"{peak / base['peak_mib'][str(args.batch)]:.2f}x", f"{ms / base['median_step_ms']:.2f}x")
        print(f"| {runner} | {peak:.1f} | {rel[0]} | {ms:.0f} | {rel[1]} | {r['largest_batch_in_budget']} |")


if __name__ == "__main__":
    main()
