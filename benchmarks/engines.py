"""Step time and peak memory of the clipping engines, side by side with Opacus and non-private training.

Run (the table in ``docs/clipping_engines.md``), or a smoke run::

    .venv/bin/python benchmarks/engines.py --out benchmarks/results/engines_cpu.json
    .venv/bin/python benchmarks/engines.py --quick --models mlp --out engines_quick.json

Workloads (random data, fixed seeds, the same model and data for every runner):

* ``mlp``: 4 x (Linear(512, 512) + Tanh) and a Linear(512, 10) head, batch 256;
* ``mlp_mnist``: the MNIST MLP 784-512-512-10 (ReLU), batch 64;
* ``linear_stack``: 4 x (Linear(256, 256) + Tanh) and a Linear(256, 10) head applied to each of
  T = 64 rows of every example, the logits averaged over the rows, batch 32 (where flat clipping
  holds every layer's output gradient until the last norm is known);
* ``cnn``: ``SmallCNN(1, 32)`` (two Conv + GroupNorm blocks) on 1x28x28, batch 256;
* ``gptneo``: a Hugging Face GPT-Neo causal LM from a config (4 layers, width 256, 8 heads,
  sequence 128, vocabulary 8192, untied head), batch 32, loss = each sequence's mean token loss;
* ``gpt2``: a Hugging Face GPT-2 (Conv1D layers) from a config, the same sizes as ``gptneo``;
* ``vit``: a Hugging Face ViT classifier from a config (6 layers, width 256, 8 heads, 32x32
  images, patch 4), batch 32.

Runners: ``nonprivate`` (Lightning, no DP), ``dp_<engine>`` (dplightning's ``DPStrategy`` with
each clipping engine) and ``opacus_hooks`` / ``opacus_ghost`` (Opacus' ``make_private`` with
``grad_sample_mode="hooks"`` / ``"ghost"``, driving a plain loop). All use AdamW(lr=1e-4); the
DP runners use σ = 1, C = 1, flat clipping and Poisson sampling with q = B / N. Every
measurement runs in a fresh process; see ``_harness.py`` for how time and memory are taken.
Time ratios use each runner's median step time scaled to the nominal batch B (step time × B /
the step's rows), since Poisson batches vary by about √B rows; the ``cpu/*`` ratios use the
process' CPU time per step instead of wall-clock gaps (with ``--threads 1`` the step's own work,
without steal or other processes; it still moves with what other tenants do to the caches and
memory bandwidth: ± 0.1–0.2 on the DP/non-private ratio between runs on the 2-core VM).

``train_runner`` is what ``gpu_validation.py`` reuses on a GPU: the same runners with a
:class:`Placement` (accelerator and precision) other than the CPU tables' fp32.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import opacus
import torch
import torch.nn.functional as F
from _harness import StepClock, in_fresh_process, measured, quiet_trainer, summarise, write_report
from _outputs import default_result
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.models import SmallCNN
from dplightning.privacy.grad_sample import available_engines

NUM_CLASSES, VOCAB, SEQ = 10, 8192, 128
PRECISIONS = ("32-true", "bf16-mixed")  # what the Opacus loop reproduces with autocast


@dataclass(frozen=True)
class Placement:
    """Where and in which precision a runner trains; the CPU tables use the default.

    Attributes:
        accelerator: Lightning's accelerator name, ``"cpu"`` or ``"gpu"`` (one CUDA device).
        precision: Lightning's precision, ``"32-true"`` or ``"bf16-mixed"`` (autocast in the Opacus loop).
    """

    accelerator: str = "cpu"
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if self.accelerator not in ("cpu", "gpu"):
            raise ValueError(f"accelerator must be 'cpu' or 'gpu', got {self.accelerator!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}.")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if self.accelerator == "gpu" else "cpu")

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA kernels run asynchronously; CPU work does not)."""
        if self.accelerator == "gpu":
            torch.cuda.synchronize()

    def autocast(self) -> Any:
        """The Opacus loop's forward context: Lightning's ``bf16-mixed`` is autocast to bfloat16."""
        if self.precision == "32-true":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


CPU = Placement()


@dataclass(frozen=True)
class Workload:
    """A model, its inputs and its per-example loss."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], Tensor]
    batch: int
    language_model: bool = False

    def data(self, n: int) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        x = self.inputs(n, g)
        return (
            TensorDataset(x)
            if self.language_model
            else TensorDataset(x, torch.randint(0, NUM_CLASSES, (n,), generator=g))
        )


def _mlp() -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.Tanh())], nn.Linear(512, NUM_CLASSES))


def _mlp_mnist() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, NUM_CLASSES))


class _RowMean(nn.Module):
    """``[n, T, k]`` logits per row -> ``[n, k]``, their mean over the rows."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


def _linear_stack(width: int = 256) -> nn.Module:
    blocks = [m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*blocks, nn.Linear(width, NUM_CLASSES), _RowMean())


class _HF(nn.Module):
    """A Hugging Face model returning logits (position ids passed explicitly, as Opacus needs them)."""

    def __init__(self, model: nn.Module, language_model: bool) -> None:
        super().__init__()
        self.model, self.language_model = model, language_model

    def forward(self, x: Tensor) -> Tensor:
        if self.language_model:
            positions = torch.arange(x.shape[1], device=x.device).repeat(x.shape[0], 1)  # contiguous, for Opacus
            return self.model(input_ids=x, position_ids=positions).logits
        return self.model(pixel_values=x).logits


def _gptneo(seq: int = SEQ) -> nn.Module:
    """The GPT-Neo workload's model, for sequences of up to ``seq`` tokens."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        num_layers=4, hidden_size=256, num_heads=8, vocab_size=VOCAB, max_position_embeddings=seq,
        attention_types=[[["global", "local"], 2]], window_size=64, embed_dropout=0.0, attention_dropout=0.0,
        resid_dropout=0.0, tie_word_embeddings=False,  # Opacus' ghost mode refuses tied embeddings
    )  # fmt: skip
    return _HF(GPTNeoForCausalLM(config), language_model=True)


def _gpt2(seq: int = SEQ) -> nn.Module:
    """GPT-2's layout (Hugging Face ``Conv1D`` layers) at the GPT-Neo workload's sizes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4, n_embd=256, n_head=8, vocab_size=VOCAB, n_positions=seq, embd_pdrop=0.0, attn_pdrop=0.0,
        resid_pdrop=0.0, tie_word_embeddings=False,  # as gptneo: Opacus' ghost mode refuses tied embeddings
    )  # fmt: skip
    return _HF(GPT2LMHeadModel(config), language_model=True)


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
        intermediate_size=1024, num_labels=NUM_CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _HF(ViTForImageClassification(config), language_model=False)


WORKLOADS = {
    "mlp": Workload(_mlp, lambda n, g: torch.randn(n, 512, generator=g), 256),
    "mlp_mnist": Workload(_mlp_mnist, lambda n, g: torch.randn(n, 784, generator=g), 64),
    "linear_stack": Workload(_linear_stack, lambda n, g: torch.randn(n, 64, 256, generator=g), 32),
    "cnn": Workload(lambda: SmallCNN(1, 32, NUM_CLASSES), lambda n, g: torch.randn(n, 1, 28, 28, generator=g), 256),
    "gptneo": Workload(_gptneo, lambda n, g: torch.randint(0, VOCAB, (n, SEQ), generator=g), 32, language_model=True),
    "gpt2": Workload(_gpt2, lambda n, g: torch.randint(0, VOCAB, (n, SEQ), generator=g), 32, language_model=True),
    "vit": Workload(_vit, lambda n, g: torch.randn(n, 3, 32, 32, generator=g), 32),
}
RUNNERS = ["nonprivate", *(f"dp_{e}" for e in available_engines()), "dp_auto_replay", "opacus_hooks", "opacus_ghost"]
"""``dp_<engine>``: DPStrategy with that clipping engine; ``dp_auto_replay``: ``auto`` with ``clip_replay=True``."""


def per_example_loss(logits: Tensor, batch: list[Tensor], language_model: bool) -> Tensor:
    """Each example's loss: cross-entropy, or a sequence's mean next-token loss."""
    if language_model:
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch[0][:, 1:], reduction="none").mean(1)
    return F.cross_entropy(logits, batch[1], reduction="none")


class Task(pl.LightningModule):
    """The workload's model under Lightning; the loss sums per-example losses over max(n, 1)."""

    def __init__(self, net: nn.Module, language_model: bool) -> None:
        super().__init__()
        self.net, self.language_model = net, language_model

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        losses = per_example_loss(self.net(batch[0]), batch, self.language_model)
        return losses.sum() / max(len(losses), 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _lightning(
    runner: str, net: nn.Module, w: Workload, loader: DataLoader, steps: int, clipping: str, place: Placement,
    callbacks: Sequence[pl.Callback] = (),
) -> StepClock:  # fmt: skip
    strategy: Any = "auto"
    if runner.startswith("dp_"):
        engine = runner[3:].removesuffix("_replay")
        strategy = dplightning.DPStrategy(
            noise_multiplier=1.0, max_grad_norm=1.0, clipping_engine=engine, clipping=clipping,
            clip_replay=runner.endswith("_replay"),
        )  # fmt: skip
    clock = StepClock(steps, sync=place.synchronize)
    # The replay refuses a step whose second backward pass differs bit for bit from the first; on a GPU
    # that needs deterministic kernels (the strategy warns without them). Only for this runner's fit.
    deterministic = runner.endswith("_replay") and place.accelerator != "cpu"
    trainer = quiet_trainer(
        strategy=strategy, accelerator=place.accelerator, devices=1, precision=place.precision, max_steps=1000,
        callbacks=[clock, *callbacks], num_sanity_val_steps=0, deterministic="warn" if deterministic else None,
    )  # fmt: skip
    try:
        trainer.fit(Task(net, w.language_model), loader)
    finally:
        if deterministic:  # Lightning sets these for the process; the next runner must not inherit them
            torch.use_deterministic_algorithms(False)
    return clock


def _register_vit_sampler_with_opacus() -> None:
    # Opacus has no sampler for ViTEmbeddings' own parameters; give it dplightning's, so that it runs at all.
    from opacus.grad_sample import register_grad_sampler
    from transformers.models.vit.modeling_vit import ViTEmbeddings

    from dplightning.privacy.grad_sample.samplers import LayerCall, registered_sampler

    ours = registered_sampler(ViTEmbeddings.__new__(ViTEmbeddings))
    assert ours is not None
    register_grad_sampler(ViTEmbeddings)(
        lambda layer, acts, backprops: ours(layer, LayerCall(tuple(acts)), [backprops])
    )


def _opacus(
    runner: str, net: nn.Module, w: Workload, loader: DataLoader, steps: int, clipping: str, place: Placement
) -> StepClock:
    if clipping != "flat":
        raise ValueError("The Opacus runners are measured with flat clipping only.")
    _register_vit_sampler_with_opacus()
    net = net.to(place.device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    common = dict(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True)
    engine = opacus.PrivacyEngine(accountant="prv")
    criterion = None
    if runner == "opacus_ghost":
        net, opt, criterion, loader = engine.make_private(
            module=net, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost",
            **common,
        )  # fmt: skip
    else:
        net, opt, loader = engine.make_private(module=net, optimizer=opt, data_loader=loader, **common)
    clock = StepClock(steps, sync=place.synchronize)
    for batch in loader:
        if clock.tick(len(batch[0])):
            break
        batch = [t.to(place.device, non_blocking=True) for t in batch]
        opt.zero_grad(set_to_none=True)
        with place.autocast():
            logits = net(batch[0])
            if criterion is None:
                loss = per_example_loss(logits, batch, w.language_model).mean()
            elif w.language_model:
                rows, tokens, vocab = logits.shape
                flat = logits[:, :-1].reshape(-1, vocab)
                loss = criterion(flat, batch[0][:, 1:].reshape(-1), shape=(rows, tokens - 1, vocab))
            else:
                loss = criterion(logits, batch[1])
        loss.backward()
        opt.step()
    return clock


def dataset_rows(w: Workload, steps: int, warmup: int) -> int:
    """N of :func:`train_runner`'s data: every step falls in the first epoch (q = B / N)."""
    return w.batch * (warmup + steps + 3)


def train_runner(
    runner: str, w: Workload, steps: int, warmup: int, clipping: str = "flat", place: Placement = CPU,
    callbacks: Sequence[pl.Callback] = (),
) -> StepClock:  # fmt: skip
    """Train ``w`` with ``runner`` for ``warmup + steps`` recorded steps (and one closing step); its clock.

    Every step falls in the first epoch (q = B / N with N = B x (warmup + steps + 3)). The
    model is built on ``place``'s device from seed 0, so every runner starts from the same one.
    ``callbacks`` join the Lightning runners' Trainer (e.g. to read the DP strategy's engine
    table); the Opacus runners have no Trainer and ignore them.
    """
    if runner not in RUNNERS:
        raise ValueError(f"Unknown runner {runner!r}; choose one of {RUNNERS}.")
    loader = DataLoader(w.data(dataset_rows(w, steps, warmup)), batch_size=w.batch, shuffle=True)
    torch.manual_seed(0)
    with place.device:
        net = w.build()
    if runner.startswith("opacus"):
        return _opacus(runner, net, w, loader, warmup + steps, clipping, place)
    return _lightning(runner, net, w, loader, warmup + steps, clipping, place, callbacks)


def measure(
    runner: str, workload: str, steps: int, warmup: int, threads: int, clipping: str = "flat"
) -> dict[str, Any]:
    """One runner on one workload in this (fresh) process: its timed steps and memory."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(threads)
    w = WORKLOADS[workload]
    return measured(lambda: (train_runner(runner, w, steps, warmup, clipping), warmup))


RATIOS = [
    ("nonprivate", "time"), ("opacus_hooks", "time"), ("nonprivate", "cpu"), ("opacus_hooks", "cpu"),
    ("nonprivate", "peak"), ("nonprivate", "growth"),
]  # fmt: skip


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    # Time at the nominal batch: a DP runner's Poisson batches vary around it (_harness.summarise).
    # "cpu": the process' CPU time per step, without a shared VM's steal (meaningful with one thread).
    keys = {"time": "median_ms_at_batch", "cpu": "median_cpu_ms_at_batch"}
    keys |= {"peak": "peak_rss_mib", "growth": "rss_growth_mib"}
    return {
        runner: {
            f"{what}/{base}": r[keys[what]] / results[base][keys[what]] for base, what in RATIOS if base in results
        }
        for runner, r in results.items()
    }


def _table(workload: str, results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]], args: Any) -> str:
    w = WORKLOADS[workload]
    head = (
        f"{workload}: batch {w.batch}, {args.repeats} x {args.steps} timed steps (after {args.warmup} warm-up), "
        f"{args.threads} threads"
    )
    cols = ["median ms", "ms at B", "x non-priv", "x opacus hk", "CPU ms at B", "x non-priv", "x opacus hk"]
    cols += ["peak RSS", "x non-priv", "RSS growth", "x non-priv"]
    lines = [head, f"  {'runner':<22}" + "".join(c.rjust(12) for c in cols)]
    for runner, r in results.items():
        q = ratios[runner]
        cells = [
            f"{r['median_ms']:.1f}", f"{r['median_ms_at_batch']:.1f}", f"{q.get('time/nonprivate', float('nan')):.2f}",
            f"{q.get('time/opacus_hooks', float('nan')):.2f}", f"{r['median_cpu_ms_at_batch']:.1f}",
            f"{q.get('cpu/nonprivate', float('nan')):.2f}", f"{q.get('cpu/opacus_hooks', float('nan')):.2f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{q.get('peak/nonprivate', float('nan')):.2f}", f"{r['rss_growth_mib']:+.0f}",
            f"{q.get('growth/nonprivate', float('nan')):.2f}",
        ]  # fmt: skip
        lines.append(f"  {runner:<22}" + "".join(c.rjust(12) for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=RUNNERS)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per runner, interleaved")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-other-cpu", type=float, default=5.0, help="retry a repeat above this %% (100 = never)")
    parser.add_argument("--clipping", default="flat", help="clipping policy of the dp_* runners (Opacus: flat only)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat of 3 steps after 1 warm-up")
    parser.add_argument("--out", type=Path, default=default_result("engines_cpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 3, 1, 1
    results: dict[str, dict[str, dict[str, Any]]] = {}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for workload in args.models:
        runs: dict[str, list[dict[str, Any]]] = {r: [] for r in args.runners}
        for _ in range(args.repeats):
            for runner in args.runners:
                job = (runner, workload, args.steps, args.warmup, args.threads, args.clipping)
                runs[runner].append(in_fresh_process(measure, job, args.max_other_cpu, f"{workload}/{runner}"))
        results[workload] = {r: summarise(v, expected_rows=WORKLOADS[workload].batch) for r, v in runs.items()}
        ratios[workload] = _ratios(results[workload])
        print(_table(workload, results[workload], ratios[workload], args), end="\n\n", flush=True)
    write_report(args.out, "engines", args.threads, vars(args), results=results, ratios=ratios)


if __name__ == "__main__":
    main()
