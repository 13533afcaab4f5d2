"""``dplightning privacy-report``: ε recomputed from the ledger with Opacus, provenance recorded at save."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from opacus.accountants import RDPAccountant
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dplightning.cli import main as cli_main
from dplightning.commands.export import privacy_of
from dplightning.commands.report import format_report, load_report
from dplightning.data import ETTDataModule
from dplightning.privacy.accounting import compute_epsilon
from dplightning.privacy.provenance import UNDECLARED_UNIT, PrivacyUnit, describe_privacy_unit
from dplightning.strategies._dp import CHECKPOINT_KEY
from dplightning.strategies.accounting import InconsistentLedger
from dplightning.tasks import DPDiffusion
from tests.data.test_ett import MONTH, write_csv
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer
from tests.tasks.test_diffusion import images, tiny_net

N, BATCH, STEPS = 64, 16, 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("report") / "run.ckpt"
    trainer = make_trainer(dp(noise_multiplier=1.3, accountant="rdp", max_grad_norm=0.7), max_steps=STEPS)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    trainer.save_checkpoint(path)
    return str(path)


def _reference_epsilon(delta: float) -> float:
    acc = RDPAccountant()
    acc.history = [(1.3, BATCH / N, STEPS)]
    return acc.get_epsilon(delta=delta)


def test_report_recomputes_epsilon_and_shows_the_mechanism(ckpt: str) -> None:
    report = load_report(ckpt)
    delta = 1 / (10 * N)
    assert report["delta"] == pytest.approx(delta)
    assert report["epsilon"] == pytest.approx(_reference_epsilon(delta), rel=1e-12)  # Opacus, built independently
    assert report["epsilon_stored"] == pytest.approx(report["epsilon"], rel=1e-12) and report["epsilon_matches"]
    assert (report["noise_multiplier"], report["sample_rate"], report["steps"]) == (1.3, BATCH / N, STEPS)
    assert report["accountant"] == "rdp" and report["num_samples"] == N and report["global_step"] == STEPS
    assert report["clipping"] == "flat" and report["max_grad_norm"] == 0.7
    assert set(report["layer_engines"]) == {"net.0", "net.2"}
    assert report["privacy_unit"] == UNDECLARED_UNIT and report["seeded"] is False and report["not_covered"] == {}
    assert report["versions"]["opacus"] == metadata.version("opacus")
    assert report["versions_now"] == {}  # written by what is installed


def test_cli_prints_text_and_json_and_flags_a_tampered_epsilon(ckpt: str, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["privacy-report", ckpt])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "(matches)" in text and "rdp" in text and "net.0" in text
    with pytest.raises(SystemExit):
        cli_main(["privacy-report", ckpt, "--json"])
    assert json.loads(capsys.readouterr().out)["steps"] == STEPS

    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint[CHECKPOINT_KEY]["epsilon"] /= 2  # a claim lower than the ledger supports
    torch.save(checkpoint, tmp_path / "tampered.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["privacy-report", str(tmp_path / "tampered.ckpt")])
    assert exit_info.value.code == 1 and "MISMATCH" in capsys.readouterr().out


def test_a_checkpoint_without_ledger_is_reported_as_such(tmp_path, capsys) -> None:
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["privacy-report", str(tmp_path / "plain.ckpt")])
    assert exit_info.value.code == 2 and "no privacy ledger" in capsys.readouterr().out


def _fit_and_save(path: Path, module: pl.LightningModule, data: Any, steps: int = 2, **strategy: Any) -> str:
    trainer = make_trainer(dp(**{"noise_multiplier": 1.0, **strategy}), max_steps=steps, limit_val_batches=0)
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    return str(path)


def _run_report(path: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["privacy-report", path])
    return exit_info.value.code, capsys.readouterr().out


# ---------------------------------------------------------------- the privacy unit


class _Images(TensorDataset):
    """Images whose dataset declares its privacy unit."""

    dp_privacy_unit = "one training image"


def test_a_dpdm_unit_is_one_image_with_k_forward_rows_not_k_rows(tmp_path: Path) -> None:
    module = DPDiffusion(tiny_net(), noise_multiplicity=4, num_classes=3, optimizer=lambda p: torch.optim.SGD(p, 0.1))
    ckpt = _fit_and_save(tmp_path / "dpdm.ckpt", module, DataLoader(_Images(*images(8).tensors), batch_size=4))
    unit = load_report(ckpt)["privacy_unit"]
    assert "privacy unit of 4 consecutive rows" not in unit  # the old claim: a unit made of rows of the split
    assert unit.startswith("one training image; each unit is 4 consecutive rows of the forward batch")
    assert torch.load(ckpt, weights_only=False)[CHECKPOINT_KEY]["privacy_unit"] == {
        "description": "one training image", "window": None, "stride": None, "rows_per_unit": 4
    }  # fmt: skip


class _WindowRegression(pl.LightningModule):
    """A per-window loss over ``[B, L, 7]`` ETT windows (sum over windows / max(B, 1))."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(7, 1)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.net(batch).square().mean((1, 2)).sum() / max(len(batch), 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_ett_run_records_its_window_unit_and_stride_and_says_one_row_is_in_many_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_csv(tmp_path / "ETTh1.csv")
    data = ETTDataModule(str(tmp_path / "ETTh1.csv"), input_len=8, horizon=4, rows_per_month=MONTH, batch_size=16)
    ckpt = _fit_and_save(tmp_path / "ett.ckpt", _WindowRegression(), data)
    state = torch.load(ckpt, weights_only=False)[CHECKPOINT_KEY]
    assert state["privacy_unit"] == {
        "description": "one training window of 12 consecutive rows (8 input + 4 horizon)",
        "window": 12, "stride": 1, "rows_per_unit": 1,
    }  # fmt: skip
    assert "mean and std of the training rows" in state["not_covered"]["normalisation"]
    code, text = _run_report(ckpt, capsys)
    assert code == 0 and "one row of the training split" not in text
    assert "one training window of 12 consecutive rows (8 input + 4 horizon); training windows of 12 rows start " \
        "every 1 row(s), so one row of the series lies in up to 12 windows" in " ".join(text.split())  # fmt: skip
    assert "normalisation: the per-channel mean and std of the training rows" in text


def test_the_standard_ett_settings_say_how_many_windows_hold_one_row() -> None:
    forecast = ETTDataModule("ETTh1.csv", horizon=96).dp_privacy_unit  # the file is read only at setup
    assert forecast == PrivacyUnit("one training window of 192 consecutive hourly rows (96 input + 96 horizon)", 192, 1)
    assert "lies in up to 192 windows" in describe_privacy_unit({**vars(forecast), "rows_per_unit": 1})
    disjoint = ETTDataModule("ETTm1.csv", task="imputation", train_stride=96, mean=[0.0] * 7, std=[1.0] * 7)
    text = describe_privacy_unit({**vars(disjoint.dp_privacy_unit), "rows_per_unit": 1})
    assert text.startswith("one training window of 96 consecutive 15-minute rows;") and "any single row" in text
    assert disjoint.dp_not_covered == {}  # public statistics
    with pytest.raises(ValueError, match="length and stride together"):
        PrivacyUnit("one window", window=8)


# ---------------------------------------------------------------- the test seed


def test_a_seeded_run_warns_at_fit_and_the_report_says_so(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="FOR TESTS ONLY.*does not hold against anyone who knows the seed"):
        ckpt = _fit_and_save(tmp_path / "seeded.ckpt", TinyModule(), loader(make_dataset(N), BATCH), seed=0)
    report = load_report(ckpt)
    assert report["seeded"] is True
    assert "True (WARNING: a test seed (seed=) fixed the noise" in format_report(report)


# ---------------------------------------------------------------- the ledger against the checkpoint


def _tampered(ckpt: str, path: Path, history: list[list[float]]) -> str:
    """``ckpt`` with another ledger history and the ε it implies stored (so that ε alone still matches)."""
    checkpoint = torch.load(ckpt, weights_only=False)
    state = checkpoint[CHECKPOINT_KEY]
    state["ledger"]["history"] = history
    state["epsilon"] = compute_epsilon(history, state["delta"], state["ledger"]["accountant"])
    torch.save(checkpoint, path)
    return str(path)


@pytest.mark.parametrize(
    "history, complaint",
    [
        ([[1.3, BATCH / N, 1]], "the ledger charges 1 steps but the checkpoint's global_step is 3"),
        ([[2.6, BATCH / N, STEPS]], "the record's σ = 1.3 is not the ledger's latest σ = 2.6"),
        ([[1.3, BATCH / N / 2, STEPS]], "the record's q = 0.25 is not the ledger's latest q = 0.125"),
    ],
)
def test_a_ledger_that_contradicts_the_checkpoint_is_refused(
    ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], history: list[list[float]], complaint: str
) -> None:
    tampered = _tampered(ckpt, tmp_path / "tampered.ckpt", history)
    code, text = _run_report(tampered, capsys)
    assert code == 3 and complaint in text and "contradicts" in text
    with pytest.raises(InconsistentLedger, match=complaint):  # export refuses it too
        privacy_of(torch.load(tampered, weights_only=False))


def test_a_ledger_with_more_steps_than_global_step_is_accepted(ckpt: str, tmp_path: Path, capsys) -> None:
    # A privacy journal charges the steps a killed attempt released after its last checkpoint.
    code, text = _run_report(_tampered(ckpt, tmp_path / "journaled.ckpt", [[1.3, BATCH / N, STEPS + 2]]), capsys)
    assert code == 0 and "5 (global_step 3)" in text
