"""σ for a target ε without training (``dplightning calibrate``), and what an unreachable target is told."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from dplightning.cli import main as cli_main
from dplightning.privacy.accounting import SIGMA_CAP, calibrate_noise_multiplier, compute_epsilon
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

N, BATCH, EPOCHS, TARGET = 64, 16, 2, 2.0


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.e2e
def test_calibrate_gives_the_sigma_the_strategy_calibrates_for_the_same_run(capsys: pytest.CaptureFixture) -> None:
    trainer = make_trainer(dp(noise_multiplier=None, target_epsilon=TARGET), max_epochs=EPOCHS, max_steps=-1)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    strategy = trainer.strategy
    argv = ["calibrate", "--target-epsilon", str(TARGET), "--batch-size", str(BATCH), "--dataset-size", str(N),
            "--epochs", str(EPOCHS), "--json"]  # fmt: skip
    code, out, _ = _run(argv, capsys)
    result = json.loads(out)
    assert code == 0 and result["steps"] == strategy.steps  # epochs of ⌈1/q⌉ Poisson steps, as the run took
    assert result["noise_multiplier"] == pytest.approx(strategy.noise_multiplier, rel=1e-12)
    assert result["epsilon"] == pytest.approx(strategy.get_epsilon(), rel=1e-9) and result["epsilon"] <= TARGET
    assert result["delta"] == pytest.approx(strategy.delta) and result["sample_rate"] == BATCH / N


def test_calibrate_with_q_steps_and_delta_prints_sigma_and_the_resulting_epsilon(capsys) -> None:
    code, out, _ = _run(["calibrate", "--target-epsilon", "3", "--sample-rate", "0.05", "--steps", "300",
                         "--delta", "1e-5", "--accountant", "rdp"], capsys)  # fmt: skip
    sigma = float(re.search(r"σ = (\S+) gives", out).group(1))
    reference = RDPAccountant()  # Opacus, built independently
    reference.history = [(sigma, 0.05, 300)]
    assert code == 0 and f"(ε = {reference.get_epsilon(delta=1e-5):.4g}, δ = 1e-05)" in out
    assert reference.get_epsilon(delta=1e-5) <= 3.0


def test_calibrate_refuses_an_incomplete_setting(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["calibrate", "--target-epsilon", "3", "--sample-rate", "0.05", "--steps", "300"], capsys)
    assert code == 2 and "give --delta, or --dataset-size" in err


def _floor(accountant: str, q: float, steps: int, delta: float) -> float:
    reference = {"rdp": RDPAccountant, "prv": PRVAccountant}[accountant]()
    reference.history = [(SIGMA_CAP, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reference.get_epsilon(delta=delta)


@pytest.mark.parametrize("accountant, target", [("rdp", 0.05), ("prv", 0.005)])
def test_an_unreachable_target_says_the_smallest_epsilon_the_accountant_reaches(accountant: str, target: float) -> None:
    q, steps, delta = 0.2, 200, 1e-5
    with pytest.raises(ValueError, match="out of reach") as refusal:
        calibrate_noise_multiplier(target, delta, q, steps, accountant)
    text = str(refusal.value)
    assert f"'{accountant}' accountant at q = 0.2, 200 steps and δ = 1e-05" in text
    assert f"gives ε = {_floor(accountant, q, steps, delta):.4g}" in text
    suggested = float(re.search(r"target_epsilon ≥ (\S+)\.", text).group(1))
    sigma = calibrate_noise_multiplier(suggested, delta, q, steps, accountant)  # the advice is reachable
    assert compute_epsilon([(sigma, q, steps)], delta, accountant) <= suggested
    if accountant == "rdp":  # PRV reaches lower here, and the message says so
        assert f"accountant='prv' certifies ε down to {_floor('prv', q, steps, delta):.3g}" in text
