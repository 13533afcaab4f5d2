"""``dplightning privacy-report``: ε recomputed from the ledger with Opacus, provenance recorded at save."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch
from opacus.accountants import RDPAccountant

from dplightning.cli import main as cli_main
from dplightning.report import load_report
from dplightning.strategies._dp import CHECKPOINT_KEY
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

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
    assert report["privacy_unit"].startswith("one training example") and report["seeded"] is False
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
