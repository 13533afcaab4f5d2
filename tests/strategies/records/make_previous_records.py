"""Writes ``previous_records.json``: privacy records as dplightning wrote them before issue 26 item 2.

Run once, at commit 73404e7 (before ``PrivacyRecord`` existed), as
``python -m tests.strategies.records.make_previous_records``. It trains three tiny runs with
the writer of that time (``_DPHooks.save_checkpoint``), and keeps for each the checkpoint's
record and ``global_step`` with what ``privacy_of`` and ``privacy_report`` of that time made of
them, so that ``tests/strategies/test_privacy_record.py`` can check that today's reader
reads the same. Running it later writes the current layout instead (not a fixture).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from dplightning.commands.export import privacy_of
from dplightning.commands.report import privacy_report
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

OUT = Path(__file__).with_name("previous_records.json")
N, BATCH = 64, 16


class _Declared(TensorDataset):
    """A dataset that declares its privacy unit and what it computed outside the DP steps."""

    dp_privacy_unit = "one patient's record"
    dp_not_covered = {"scaler": "feature means of the training split"}


def _case(name: str, steps: int, dataset: TensorDataset, **strategy: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(dp(**strategy), max_steps=steps, limit_val_batches=0)
        trainer.fit(TinyModule(), loader(dataset, BATCH))
        trainer.save_checkpoint(Path(folder) / "run.ckpt")
        saved = torch.load(Path(folder) / "run.ckpt", weights_only=False)
    checkpoint = {"global_step": saved["global_step"], "dplightning": saved["dplightning"]}
    report = privacy_report(checkpoint)
    report.pop("versions_now")  # depends on what is installed when the test runs
    return {"name": name, "checkpoint": checkpoint, "privacy_of": privacy_of(checkpoint), "report": report}


def main() -> None:
    data = make_dataset(N)
    cases = [
        _case("dp_sgd_rdp", 3, data, noise_multiplier=1.3, accountant="rdp", max_grad_norm=0.7),
        _case("band_mf", 5, data, noise_mechanism="band_mf", bands=2, noise_multiplier=1.0),
        _case("declared_unit_no_poisson", 2, _Declared(*data.tensors), noise_multiplier=1.0, poisson_sampling=False),
    ]
    OUT.write_text(json.dumps({"written_at_commit": "73404e7", "cases": cases}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
