"""The privacy record: one writer and one reader of the checkpoint's entry, and the checkpoint I/O that writes it.

``records/previous_records.json`` holds records as the strategy wrote them before
:class:`PrivacyRecord` existed (``records/make_previous_records.py``, run at that commit),
with what ``privacy_of`` and ``privacy-report`` of that time made of them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

import dplightning
from dplightning.cli import main as cli_main
from dplightning.commands.export import privacy_of
from dplightning.commands.report import privacy_report
from dplightning.privacy import record as record_module
from dplightning.privacy.record import (
    CHECKPOINT_KEY,
    REQUIRED_FIELDS,
    REQUIRED_LEDGER_FIELDS,
    IncompletePrivacyRecord,
    NoPrivacyRecord,
    PrivacyRecord,
)
from dplightning.strategies import checkpoint as checkpoint_module
from dplightning.strategies.checkpoint import DPCheckpointIO
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

PREVIOUS = json.loads((Path(__file__).parent / "records" / "previous_records.json").read_text(encoding="utf-8"))
CASES = {case["name"]: case for case in PREVIOUS["cases"]}
N, BATCH = 64, 16


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists), to compare with the stored cases."""
    return json.loads(json.dumps(value))


def _run_report(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["privacy-report", str(path)])
    return int(exit_info.value.code or 0), capsys.readouterr().out


# ---------------------------------------------------------------- records the previous writer wrote


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_record_of_the_previous_writer_reads_and_writes_back_unchanged(name: str) -> None:
    checkpoint = CASES[name]["checkpoint"]
    record = PrivacyRecord.from_checkpoint(checkpoint)
    assert _plain(record.to_dict()) == checkpoint[CHECKPOINT_KEY]
    rewritten: dict[str, Any] = {}
    record.store_in(rewritten)
    assert _plain(rewritten) == {CHECKPOINT_KEY: checkpoint[CHECKPOINT_KEY]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_and_privacy_report_read_a_previous_record_as_they_did(name: str) -> None:
    case = CASES[name]
    assert _plain(privacy_of(case["checkpoint"])) == case["privacy_of"]
    report = privacy_report(case["checkpoint"])
    report.pop("versions_now")
    # The one intended change: the raw count of non-finite examples is no longer reported (finding 51.A2).
    expected = {k: v for k, v in case["report"].items() if k != "nonfinite_examples"}
    assert _plain(report) == expected


def test_the_cli_reads_a_previous_record_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(CASES["band_mf"]["checkpoint"], tmp_path / "old.ckpt")  # loaded with weights_only=True
    code, text = _run_report(tmp_path / "old.ckpt", capsys)
    assert code == 0 and "(matches)" in text and "banded matrix factorization (2 bands" in text


def test_a_record_of_the_first_layout_reads_with_the_documented_defaults() -> None:
    # The first release wrote the required fields only; every later field reads as its default.
    previous = CASES["dp_sgd_rdp"]["checkpoint"]
    first = {name: previous[CHECKPOINT_KEY][name] for name in REQUIRED_FIELDS}
    checkpoint = {"global_step": previous["global_step"], CHECKPOINT_KEY: first}
    record = PrivacyRecord.from_checkpoint(checkpoint)
    assert record.noise_mechanism is None and record.epsilon is None and record.layer_engines == {}
    assert record.unit == {"description": None, "window": None, "stride": None, "rows_per_unit": 1}
    claim = privacy_of(checkpoint)
    assert claim["epsilon"] == CASES["dp_sgd_rdp"]["privacy_of"]["epsilon"]
    assert claim["noise_mechanism"] == CASES["dp_sgd_rdp"]["privacy_of"]["noise_mechanism"]
    report = privacy_report(checkpoint)
    assert report["epsilon_matches"] is None and report["versions"] == {}


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("missing", [*REQUIRED_FIELDS, *(f"ledger.{name}" for name in REQUIRED_LEDGER_FIELDS)])
def test_a_record_without_a_required_field_is_refused_not_defaulted(missing: str) -> None:
    checkpoint = json.loads(json.dumps(CASES["dp_sgd_rdp"]["checkpoint"]))
    entry = checkpoint[CHECKPOINT_KEY]
    parent, _, name = missing.rpartition(".")
    del (entry[parent] if parent else entry)[name]
    with pytest.raises(IncompletePrivacyRecord, match=f"lacks {missing}"):
        PrivacyRecord.from_checkpoint(checkpoint)
    with pytest.raises(IncompletePrivacyRecord, match=f"lacks {missing}"):
        privacy_of(checkpoint)


def test_the_commands_exit_3_on_an_incomplete_record_and_2_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = json.loads(json.dumps(CASES["dp_sgd_rdp"]["checkpoint"]))
    del checkpoint[CHECKPOINT_KEY]["poisson_sampling"]  # read as True before: a finite ε for an unsampled run
    torch.save(checkpoint, tmp_path / "cut.ckpt")
    code, text = _run_report(tmp_path / "cut.ckpt", capsys)
    assert code == 3 and "lacks poisson_sampling" in text
    with pytest.raises(NoPrivacyRecord, match="no privacy ledger"):
        PrivacyRecord.from_checkpoint({"state_dict": {}})
    assert PrivacyRecord.find({"state_dict": {}}) is None


# ---------------------------------------------------------------- the writer in a run


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dplightning.DPStrategy, dict[str, Any]]:
    path = tmp_path_factory.mktemp("record") / "run.ckpt"
    strategy = dp(noise_multiplier=1.3, max_grad_norm=0.7)
    trainer = make_trainer(strategy, max_steps=3)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    trainer.save_checkpoint(path)
    return strategy, torch.load(path, weights_only=True)


def test_the_strategy_writes_its_record_through_the_one_writer(saved: tuple[Any, dict[str, Any]]) -> None:
    strategy, checkpoint = saved
    stored = checkpoint[CHECKPOINT_KEY]
    assert set(stored) == set(PREVIOUS["cases"][0]["checkpoint"][CHECKPOINT_KEY])  # the layout is unchanged
    assert PrivacyRecord.from_checkpoint(checkpoint).to_dict() == stored
    assert stored == strategy.dp_state_dict() == strategy.privacy_record().to_dict()
    assert list(stored["ledger"]["history"]) == [(1.3, BATCH / N, 3)] and stored["run_id"] == strategy._run_id


def test_the_strategy_holds_the_dp_checkpoint_io_around_lightnings(saved: tuple[Any, dict[str, Any]]) -> None:
    strategy, _ = saved
    io = strategy.checkpoint_io
    assert isinstance(io, DPCheckpointIO) and type(io.checkpoint_io) is TorchCheckpointIO
    assert strategy.checkpoint_io is io  # wrapped once


def test_a_local_save_goes_through_the_atomic_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[Path] = []
    atomic = checkpoint_module.atomic_save
    monkeypatch.setattr(checkpoint_module, "atomic_save", lambda obj, path: (written.append(path), atomic(obj, path)))
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=1)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert written == [tmp_path / "run.ckpt"]
    assert PrivacyRecord.from_checkpoint(torch.load(tmp_path / "run.ckpt", weights_only=True)).steps == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]


class _Recording(TorchCheckpointIO):
    """A user's plugin: it writes what it is given, in its own way."""

    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.saved.append(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.parametrize("given_as", ["strategy", "plugin"])
def test_a_users_checkpoint_io_writes_and_the_record_is_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given_as: str
) -> None:
    monkeypatch.setattr(checkpoint_module, "atomic_save", lambda obj, path: pytest.fail("not the user's plugin"))
    user: CheckpointIO = _Recording()
    if given_as == "strategy":
        trainer = make_trainer(dp(noise_multiplier=1.0, checkpoint_io=user), max_steps=1)
    else:
        trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=1, plugins=[user])
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    io = trainer.strategy.checkpoint_io
    assert isinstance(io, DPCheckpointIO) and io.checkpoint_io is user
    assert len(user.saved) == 1 and PrivacyRecord.from_checkpoint(user.saved[0]).steps == 1


def test_resuming_from_an_incomplete_record_is_refused(saved: tuple[Any, dict[str, Any]], tmp_path: Path) -> None:
    _, checkpoint = saved
    cut = {**checkpoint, CHECKPOINT_KEY: {k: v for k, v in checkpoint[CHECKPOINT_KEY].items() if k != "delta"}}
    torch.save(cut, tmp_path / "cut.ckpt")
    trainer = make_trainer(dp(noise_multiplier=1.3), max_steps=4)
    with pytest.raises(IncompletePrivacyRecord, match="lacks delta"):
        trainer.fit(TinyModule(), loader(make_dataset(N), BATCH), ckpt_path=tmp_path / "cut.ckpt")


# ---------------------------------------------------------------- one writer, one reader, no Lightning


def test_the_record_module_imports_no_lightning() -> None:
    # Loaded from its file alone, so that the dplightning package (which registers strategies) is not imported.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('record', {str(Path(record_module.__file__))!r})\n"
        "module = sys.modules['record'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torch', 'dplightning')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _indexes_the_key(tree: ast.AST) -> list[int]:
    """Lines that subscript, ``.get`` or ``in``-test a mapping with ``CHECKPOINT_KEY`` or its value."""

    def is_key(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "CHECKPOINT_KEY") or (
            isinstance(node, ast.Constant) and node.value == CHECKPOINT_KEY
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_key(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
            lines += [node.lineno] if node.args and is_key(node.args[0]) else []
        elif isinstance(node, ast.Compare) and is_key(node.left):
            lines.append(node.lineno)
    return lines


def test_only_the_record_module_writes_or_reads_the_checkpoint_entry() -> None:
    package = Path(dplightning.__file__).parent
    found = {
        str(path.relative_to(package)): lines
        for path in sorted(package.rglob("*.py"))
        if (lines := _indexes_the_key(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert found.keys() == {"privacy/record.py"}, found
