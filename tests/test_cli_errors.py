"""The dplightning command: --data is optional, configuration errors are one line, every option has help."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import dplightning
from dplightning.cli import TRACEBACK_ENV, build_cli
from dplightning.cli import main as cli_main

MODULE = f"{__name__}.OwnLoaders"


class OwnLoaders(pl.LightningModule):
    """A module that brings its own train loader (no DataModule), as many Lightning projects do."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.fail = fail

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.fail:
            raise ValueError("a bug in the user's own training_step")
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction="sum") / max(len(y), 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randint(0, 2, (32,), generator=generator))
        return DataLoader(data, batch_size=8)


def _fit_args(*strategy: str, steps: int = 2) -> list[str]:
    return ["fit", "--model", MODULE, "--trainer.strategy", "dplightning.DPStrategy", *strategy,
            "--trainer.max_steps", str(steps), "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false"]  # fmt: skip


UNREACHABLE = ("--trainer.strategy.target_epsilon", "0.005")


def test_fit_without_data_trains_on_the_module_s_own_loader(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = build_cli(_fit_args("--trainer.strategy.noise_multiplier", "1.0"))
    assert cli.datamodule is None and isinstance(cli.trainer.strategy, dplightning.DPStrategy)
    assert cli.trainer.strategy.steps == 2 and cli.trainer.strategy.sample_rate == 8 / 32  # Poisson-wrapped


def test_a_dplightning_configuration_error_is_one_line_and_exit_status_2(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(_fit_args(*UNREACHABLE))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"dplightning: error: target_epsilon = 0\.005 is out of reach .* \(--traceback for the full "
                        r"traceback\)", last)  # fmt: skip


def test_traceback_flag_or_variable_gives_the_full_traceback(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(ValueError, match="out of reach"):
        cli_main([*_fit_args(*UNREACHABLE), "--traceback"])
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="out of reach"):
        cli_main(_fit_args(*UNREACHABLE))


def test_an_error_raised_outside_dplightning_keeps_its_traceback(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(ValueError, match="a bug in the user's own training_step"):
        cli_main([*_fit_args("--trainer.strategy.noise_multiplier", "1.0"), "--model.fail", "true"])


def test_every_audit_option_is_described(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["audit", "--help"])
    options = capsys.readouterr().out.split("options:")[1]
    blocks = re.split(r"\n  (?=-)", options)[1:]  # one block per option: its flags, then its help text
    assert len(blocks) >= 15
    for block in blocks:
        flags, _, text = block.partition("  ")
        described = re.sub(r"\(?default: [^)]*\)?", "", " ".join(text.split()))
        if not described.strip():  # a long flag puts its help on the next line
            flags, _, text = block.partition("\n")
            described = re.sub(r"\(?default: [^)]*\)?", "", " ".join(text.split()))
        assert len(described.split()) >= 4, f"undescribed: {flags.strip()}"


def test_a_shipped_config_is_found_by_name_from_any_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dplightning import configs
    from dplightning.cli import _shipped_configs

    monkeypatch.chdir(tmp_path)  # outside the repository: no configs/ folder here
    quickstart = str(configs.ROOT / "quickstart.yaml")
    assert _shipped_configs(["fit", "--config", "quickstart"]) == ["fit", "--config", quickstart]
    assert _shipped_configs(["fit", "--config=configs/quickstart.yaml"]) == ["fit", f"--config={quickstart}"]
    assert "quickstart" in configs.names() and "grape/vit_digits_dp_grape" in configs.names()
    (tmp_path / "quickstart").write_text("a file of the user's own wins")
    assert _shipped_configs(["fit", "-c", "quickstart"]) == ["fit", "-c", "quickstart"]
    assert configs.find("../pyproject.toml") is None and configs.find("/etc/passwd") is None


def test_a_missing_config_is_one_line_and_exit_status_2(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", "no_such.yaml"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "no config file 'no_such.yaml'" in err


def test_a_missing_extra_names_the_extra_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dplightning.cli as cli

    def dispatch(argv: list[str], cli_args: list[str] | None) -> None:
        try:  # what jsonargparse does with a class that failed to build: a ValueError caused by the ImportError
            raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
        except ModuleNotFoundError as err:
            raise ValueError("Does not validate against any of the Union subtypes") from err

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "pip install 'dplightning[hf]'" in err and len(err.splitlines()) == 1


def test_privacy_report_on_a_missing_file_is_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["privacy-report", str(tmp_path / "typo.ckpt")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.endswith("no checkpoint file '" + str(tmp_path / "typo.ckpt") + "'")


def test_the_command_drops_lightning_s_adverts(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import logging

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        cli_main(_fit_args("--trainer.strategy.noise_multiplier", "1.0"))
    assert any("No target_epsilon" in m for m in caplog.messages)  # our own lines still come through
    assert not [m for m in caplog.messages if m.startswith("💡")]
