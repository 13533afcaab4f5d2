"""privacy-report and export open a checkpoint someone hands you without running code from it."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from dplightning.cli import main as cli_main
from dplightning.commands.export import SAFE_GLOBALS, load_checkpoint
from dplightning.commands.report import load_report
from dplightning.models.hf import LoraSettings
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer


class _Payload:
    """Unpickling this object opens (creates) ``marker``: code the file makes the loader run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loading") / "run.ckpt"
    trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=2)
    trainer.fit(TinyModule(), loader(make_dataset(64), 16))
    trainer.save_checkpoint(path)
    return path


def _with_hparams(ckpt: Path, path: Path, hparams: dict[str, Any]) -> str:
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["hyper_parameters"] = hparams
    torch.save(checkpoint, path)
    return str(path)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out + captured.err


def test_a_checkpoint_whose_pickle_runs_code_is_refused_without_running_it(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    hostile = _with_hparams(ckpt, tmp_path / "hostile.ckpt", {"lr": _Payload(marker)})
    code, text = _run(["privacy-report", hostile], capsys)
    assert code == 4 and "refused to load the checkpoint" in text and "io.open" in text and not marker.exists()
    code, text = _run(["export", "--ckpt", hostile, "--out", str(tmp_path / "out")], capsys)
    assert code == 4 and "would run code from the file" in text and not marker.exists()
    assert not (tmp_path / "out").exists()
    torch.load(hostile, weights_only=False)  # the payload is live: a full unpickle runs it
    assert marker.exists()


def test_only_allow_listed_records_load_unless_you_trust_the_file(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    own = _with_hparams(ckpt, tmp_path / "own.ckpt", {"lr": Fraction(1, 10)})  # harmless, but not allow-listed
    code, text = _run(["privacy-report", own], capsys)
    assert code == 4 and "fractions.Fraction" in text and "--trust-checkpoint" in text
    code, text = _run(["privacy-report", own, "--trust-checkpoint"], capsys)
    assert code == 0 and "(matches)" in text
    # A plain DP checkpoint and the allow-listed LoRA settings among a module's hyperparameters load as they are.
    assert SAFE_GLOBALS == [LoraSettings]
    assert load_report(ckpt)["steps"] == 2
    lora = _with_hparams(ckpt, tmp_path / "lora.ckpt", {"lora": LoraSettings(r=2, target_modules=["c_attn"])})
    assert load_checkpoint(lora)["hyper_parameters"]["lora"] == LoraSettings(r=2, target_modules=["c_attn"])
