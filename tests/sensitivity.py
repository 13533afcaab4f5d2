"""The neighbouring-data sensitivity harness: record on D, replay on D′ through the release seam.

A cell of the feature matrix (mechanism, engine, clip_replay, accumulation, Lightning control
flow, loss form) trains twice with identical randomness: on D, recording every release's
clipped sum and output at the seam (:mod:`dplightning.privacy.release`), and on D′, where one
canary example's contribution is removed (its loss weight is 0, so sampling and shapes stay
the same), with each release's output replaced by D's. Both runs then follow one trajectory,
and the clipped sums differ only by the canary. The cell passes if

* every release's difference is at most Δ (what the ledger charges one participation),
* for a correlated mechanism, ‖C·(X − X′)‖ over the run is at most the charged run
  sensitivity (the whole run audited as one Gaussian mechanism on C·X),
* the two runs took the same decisions: every runtime check's accept/refuse in the same order
  (the seam's decision events), the same number of releases with the same declared index, σΔ,
  Δ and q·N, and the same refusal (if any) at the same point,

or both runs were refused before their first release. The canary is large, so each
participation is clipped to exactly Δ: a leak shows as a ratio above 1.
"""

from __future__ import annotations

import random
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import combinations
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.privacy.release import Decision, Release, observe_decisions, observe_releases
from tests.helpers import make_trainer

N, T, D, CLASSES, CANARY, PARTITIONS = 12, 3, 4, 3, 0, 2
TOLERANCE = 1e-5

FACTORS: dict[str, list[Any]] = {
    "mechanism": ["gaussian", "band_mf", "blt"],
    "engine": ["instantiate", "book_keeping", "auto"],
    "clip_replay": [False, True],
    "accumulation": [1, 2],
    "control": ["plain", "cut", "limit_train_batches", "validation", "reload", "odd_max_steps"],
    "loss": ["per_example", "masked_token_mean"],
    "rate": [1.0, 0.5],
    "precision": ["32-true", "bf16-mixed"],
    "clipping": ["flat", "per_layer"],
    "optimizer": ["sgd", "dpgrape", "dpmuon"],
    "processes": [1, 2],
}
"""The harness' feature matrix."""


def pairwise_cover(factors: Mapping[str, Sequence[Any]], seed: int = 0, tries: int = 64) -> list[dict[str, Any]]:
    """Rows that hold every pair of levels of every two factors at least once (a greedy covering design).

    Each row starts from a pair not yet covered (so every row makes progress) and fills the
    other factors with the levels that cover most uncovered pairs among ``tries`` random fills.
    """
    rng = random.Random(seed)
    names = list(factors)

    def pairs(row: Mapping[str, Any]) -> set[tuple[str, Any, str, Any]]:
        return {(a, row[a], b, row[b]) for a, b in combinations(names, 2)}

    uncovered = {(a, va, b, vb) for a, b in combinations(names, 2) for va in factors[a] for vb in factors[b]}
    rows: list[dict[str, Any]] = []
    while uncovered:
        a, va, b, vb = sorted(uncovered, key=repr)[rng.randrange(len(uncovered))]
        best: dict[str, Any] = {}
        for _ in range(tries):
            row = {n: rng.choice(list(factors[n])) for n in names} | {a: va, b: vb}
            if len(pairs(row) & uncovered) > len(pairs(best) & uncovered if best else ()):
                best = row
        rows.append(best)
        uncovered -= pairs(best)
    return rows


def random_cells(factors: Mapping[str, Sequence[Any]], count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` cells drawn uniformly from the matrix (seeded, reproducible)."""
    rng = random.Random(seed)
    return [{n: rng.choice(list(levels)) for n, levels in factors.items()} for _ in range(count)]


# ------------------------------------------------------------------ data and module


def harness_data(canary_weight: float) -> TensorDataset:
    """N sequences of T tokens with 1..T valid ones; example 0 is a large canary of weight ``canary_weight``."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, T, D, generator=g)
    x[CANARY] *= 50.0  # its gradient is far above Δ: each participation is clipped to exactly Δ
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[CANARY] = T
    mask = (torch.arange(T) < lengths[:, None]).float()
    y = torch.randint(0, CLASSES, (N, T), generator=g)
    weight = torch.ones(N)
    weight[CANARY] = canary_weight
    return TensorDataset(x, mask, y, weight)


class HarnessModule(pl.LightningModule):
    """A token MLP whose per-example loss is weighted (weight 0 removes an example's contribution).

    Args:
        loss: ``"per_example"`` (cross-entropy of the token mean) or ``"masked_token_mean"`` (each
            example's mean over its valid tokens).
        control: The Lightning control flow of the cell (``"cut"`` ends epoch 0 after micro-batch 0).
    """

    def __init__(self, loss: str, control: str, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, CLASSES))
        self.loss_form, self.control, self.optimizer_name = loss, control, optimizer

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.control == "cut" and self.current_epoch == 0 and batch_idx == 1 else None

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        x, mask, y, weight = batch
        logits = self.net(x)  # [n, T, classes]
        if self.loss_form == "per_example":
            per_example = F.cross_entropy(logits.mean(1), y[:, 0], reduction="none")
        else:
            per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
            per_example = (per_token * mask).sum(1) / mask.sum(1)
        return (per_example * weight).sum() / max(len(y), 1)

    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        x, _, y, _ = batch
        self.log("val_loss", F.cross_entropy(self.net(x).mean(1), y[:, 0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "dpgrape":
            from dplightning.optim import DPGrape

            return DPGrape(self.parameters(), rank=2, lr=0.05)
        if self.optimizer_name == "dpmuon":
            from dplightning.optim import DPMuon

            return DPMuon(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Data(pl.LightningDataModule):
    def __init__(self, data: TensorDataset, batch_size: int, validation: bool) -> None:
        super().__init__()
        self.data, self.batch_size, self.validation = data, batch_size, validation

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4) if self.validation else []  # type: ignore[return-value]


def batch_size(cell: Mapping[str, Any]) -> int:
    """The loader's batch size per process for the cell's sampling rate (within a part, under cyclic sampling)."""
    parts = 1 if cell["mechanism"] == "gaussian" else PARTITIONS
    return max(1, round(cell["rate"] * N / parts / cell.get("processes", 1)))


# ------------------------------------------------------------------ one run, one cell


@dataclass
class _Recorder:
    """Records every release; in replay, releases the recorded outputs instead."""

    replay: list[Tensor] | None = None
    clipped: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    specs: list[Any] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def __call__(self, release: Release, output: Tensor) -> Tensor | None:
        index = len(self.clipped)
        self.clipped.append(release.clipped_sum.double().cpu())
        self.specs.append(release.spec)
        self.outputs.append(output)
        if self.replay is None:
            return None
        if index >= len(self.replay):
            raise AssertionError(f"D′ made release {index}, which D did not make (a data-dependent release count).")
        return self.replay[index]


class _RankRecorder(pl.Callback):
    """The recorder inside each spawned rank: observes from setup, writes what it saw to ``folder/rank<r>.pt``."""

    def __init__(self, folder: str, replay: list[Tensor] | None) -> None:
        self.folder, self.replay = folder, replay

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.recorder = _Recorder(self.replay)
        self._observing = observe_releases(self.recorder)
        self._observing.__enter__()
        self._deciding = observe_decisions(self.recorder.decisions.append)
        self._deciding.__enter__()

    def _dump(self, trainer: pl.Trainer, refusal: str | None) -> None:
        if getattr(self, "_observing", None) is None:
            return
        self._observing.__exit__(None, None, None)
        self._deciding.__exit__(None, None, None)
        self._observing = None
        r = self.recorder
        torch.save({"clipped": r.clipped, "outputs": r.outputs, "specs": r.specs, "decisions": r.decisions,
                    "refusal": refusal}, f"{self.folder}/rank{trainer.global_rank}.pt")  # fmt: skip

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._dump(trainer, "refused")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._dump(trainer, None)


def _strategy(cell: Mapping[str, Any], seed: int) -> Any:
    extra: dict[str, Any] = {}
    if cell["mechanism"] == "band_mf":
        extra = dict(bands=PARTITIONS)
    elif cell["mechanism"] == "blt":
        extra = dict(blt_buffers=1, cyclic_partitions=PARTITIONS)
    if cell["clip_replay"]:
        extra["clip_replay"] = True
    extra["clipping"] = cell.get("clipping", "flat")
    extra.update(noise_mechanism=cell["mechanism"], noise_multiplier=0.0, max_grad_norm=1.0,
                 clipping_engine=cell["engine"], seed=seed)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and seed= warn by design
        if cell.get("processes", 1) > 1:
            return dplightning.DPDDPStrategy(start_method="spawn", timeout=timedelta(seconds=60), **extra)
        return dplightning.DPStrategy(**extra)


def _trainer_kwargs(cell: Mapping[str, Any]) -> dict[str, Any]:
    k, control = cell["accumulation"], cell["control"]
    kwargs: dict[str, Any] = dict(max_epochs=6, max_steps=-1, accumulate_grad_batches=k, limit_val_batches=0,
                                  precision=cell.get("precision", "32-true"))  # fmt: skip
    if control == "limit_train_batches":
        kwargs["limit_train_batches"] = 2 * k
    elif control == "validation":
        kwargs.update(limit_val_batches=1, val_check_interval=1)  # validation between micro-batches
    elif control == "reload":
        kwargs["reload_dataloaders_every_n_epochs"] = 1
    elif control == "odd_max_steps":
        kwargs["max_steps"] = 5
    return kwargs


@dataclass
class RunResult:
    recorder: _Recorder
    refusal: str | None


def run(cell: Mapping[str, Any], canary_weight: float, replay: list[Tensor] | None, seed: int = 5) -> RunResult:
    """One fit of ``cell`` with the canary's loss weight; ``replay``: the outputs to release instead."""
    torch.manual_seed(seed)
    module = HarnessModule(cell["loss"], cell["control"], cell.get("optimizer", "sgd"))
    data = _Data(harness_data(canary_weight), batch_size(cell), validation=cell["control"] == "validation")
    if cell.get("processes", 1) > 1:
        return _run_ranks(cell, module, data, replay, seed)
    recorder = _Recorder(replay)
    trainer = make_trainer(_strategy(cell, seed), **_trainer_kwargs(cell))
    refusal = None
    with observe_releases(recorder), observe_decisions(recorder.decisions.append), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(module, datamodule=data)
        except (ValueError, RuntimeError, TypeError) as err:
            # The decision, not its details: a refusal's message may quote measured values to the data's owner.
            refusal = f"{type(err).__name__}: {str(err)[:48]}"
    return RunResult(recorder, refusal)


def _run_ranks(
    cell: Mapping[str, Any], module: HarnessModule, data: _Data, replay: list[Tensor] | None, seed: int
) -> RunResult:
    """The fit on ``processes`` spawned gloo ranks; the mechanism's input is the sum of the ranks' clipped sums."""
    world = cell["processes"]
    with tempfile.TemporaryDirectory() as folder:
        trainer = make_trainer(_strategy(cell, seed), devices=world, accelerator="cpu",
                               callbacks=[_RankRecorder(folder, replay)], **_trainer_kwargs(cell))  # fmt: skip
        refused = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                trainer.fit(module, datamodule=data)
            except Exception:  # a rank's refusal, re-raised by the launcher (which rank reports first varies)
                refused = True
        files = [Path(folder) / f"rank{r}.pt" for r in range(world)]
        if refused and not all(f.exists() for f in files):  # the launcher ended the other ranks
            return RunResult(_Recorder(replay), "refused")
        ranks = [torch.load(f, weights_only=False) for f in files]
    recorder = _Recorder(replay)
    recorder.clipped = [sum(parts) for parts in zip(*(r["clipped"] for r in ranks))]  # type: ignore[misc]
    recorder.outputs, recorder.specs = ranks[0]["outputs"], ranks[0]["specs"]
    recorder.decisions = [d for r in ranks for d in r["decisions"]]  # rank by rank
    if len({len(r["clipped"]) for r in ranks}) != 1:
        raise AssertionError(f"The ranks made {[len(r['clipped']) for r in ranks]} releases.")
    return RunResult(recorder, "refused" if refused else None)


@dataclass
class Measured:
    """What a cell measured: the worst ratios of the releases' change to what was charged."""

    releases: int
    refusal: str | None
    per_release: float  # max_t ‖x_t − x′_t‖ / Δ
    run: float | None  # ‖C (X − X′)‖ / (run sensitivity · Δ), correlated mechanisms only
    touched: int  # releases where the canary changed the clipped sum

    @property
    def within(self) -> bool:
        bound = 1 + TOLERANCE
        return self.per_release <= bound and (self.run is None or self.run <= bound)


def measure(cell: Mapping[str, Any]) -> Measured:
    """Record on D, replay on D′, and compare (raises AssertionError on a data-dependent decision)."""
    d = run(cell, 1.0, None)
    neighbour = run(cell, 0.0, d.recorder.outputs)
    a, b = d.recorder, neighbour.recorder
    if d.refusal != neighbour.refusal or len(a.clipped) != len(b.clipped):
        raise AssertionError(
            f"D and D′ decided differently: {len(a.clipped)} vs {len(b.clipped)} releases, refusals "
            f"{d.refusal!r} vs {neighbour.refusal!r}."
        )
    if a.decisions != b.decisions:
        pairs = enumerate(zip(a.decisions, b.decisions))
        first = next((i for i, (x, y) in pairs if x != y), min(len(a.decisions), len(b.decisions)))
        raise AssertionError(f"A check decided differently on D and D′ at its decision {first}: "
                             f"{a.decisions[first:first + 1]} vs {b.decisions[first:first + 1]}.")  # fmt: skip
    for spec, other in zip(a.specs, b.specs):
        declared = (spec.index, spec.mechanism, spec.sensitivity, spec.noise_std, spec.expected_batch_size)
        if declared != (other.index, other.mechanism, other.sensitivity, other.noise_std, other.expected_batch_size):
            raise AssertionError(f"D and D′ declared different releases: {spec} vs {other}.")
    if not a.clipped:
        return Measured(0, d.refusal, 0.0, None, 0)
    delta = a.specs[0].sensitivity
    diffs = torch.stack([x - y for x, y in zip(a.clipped, b.clipped)])  # [releases, d]
    norms = diffs.norm(dim=1)
    run_ratio = None
    if a.specs[0].strategy is not None:
        releases = len(a.clipped)
        c = torch.as_tensor(a.specs[0].strategy, dtype=torch.float64)[:releases, :releases]
        run_ratio = float((c @ diffs).norm() / (a.specs[0].run_sensitivity * delta))
    return Measured(len(a.clipped), d.refusal, float(norms.max() / delta), run_ratio, int((norms > 1e-6).sum()))


def cells(rows: Sequence[Mapping[str, Any]]) -> Iterator[Any]:
    """``rows`` as pytest params with readable ids; cells on several processes are marked ``multiprocess``."""
    import pytest

    for row in rows:
        marks = [pytest.mark.multiprocess] if row.get("processes", 1) > 1 else []
        yield pytest.param(dict(row), id="-".join(str(v) for v in row.values()), marks=marks)
