"""Prediction writers: where ``predict`` writes by default, and one line per generated text."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dplightning.data import LabelsDataModule, SyntheticDataWriter, TextPredictionWriter


class _Texts(pl.LightningModule):
    """Returns a text per row, some with line breaks, as ``DPCausalLM.predict_step`` returns strings."""

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> list[str]:
        return [f"text {int(i)}\nsecond line" for i in batch[0]]

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(7)), batch_size=3)


def _trainer(root: Path, writer: pl.Callback, logger: bool | pl.loggers.Logger = False) -> pl.Trainer:
    return pl.Trainer(default_root_dir=str(root), logger=logger, callbacks=[writer], enable_progress_bar=False)


def test_text_writer_writes_one_line_per_text_under_the_log_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    writer = TextPredictionWriter()
    _trainer(tmp_path / "run", writer).predict(_Texts(), return_predictions=False)
    assert writer.path == tmp_path / "run" / "predictions.txt"
    lines = writer.path.read_text(encoding="utf-8").splitlines()
    assert lines == [f"text {i} second line" for i in range(7)]
    _trainer(tmp_path / "run", writer).predict(_Texts(), return_predictions=False)  # a second run replaces the file
    assert writer.path.read_text(encoding="utf-8").splitlines() == lines


def test_text_writer_follows_the_loggers_version_folder_and_an_explicit_path(tmp_path: Path) -> None:
    logger = pl.loggers.CSVLogger(str(tmp_path), name="gen")
    writer = TextPredictionWriter()
    _trainer(tmp_path, writer, logger).predict(_Texts(), return_predictions=False)
    assert writer.path == Path(logger.log_dir) / "predictions.txt"
    explicit = TextPredictionWriter(str(tmp_path / "out" / "e2e.txt"))
    _trainer(tmp_path, explicit).predict(_Texts(), return_predictions=False)
    assert len((tmp_path / "out" / "e2e.txt").read_text(encoding="utf-8").splitlines()) == 7


def test_text_writer_refuses_token_ids(tmp_path: Path) -> None:
    class _Ids(_Texts):
        def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return batch[0]

    with pytest.raises(TypeError, match="list of strings"):
        _trainer(tmp_path, TextPredictionWriter()).predict(_Ids(), return_predictions=False)


def test_synthetic_writer_defaults_to_the_log_folder_not_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    class _Images(pl.LightningModule):
        def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
            (labels,) = batch
            return {"images": torch.rand(len(labels), 1, 8, 8), "labels": labels}

    monkeypatch.chdir(tmp_path)
    _trainer(tmp_path / "run", SyntheticDataWriter()).predict(
        _Images(), LabelsDataModule(num_samples=20, batch_size=10), return_predictions=False
    )
    assert (tmp_path / "run" / "synthetic" / "synthetic.pt").is_file()
    assert not (tmp_path / "synthetic").exists()
