"""Where ``predict`` writes its outputs, and a writer for generated text.

Prediction writers default to the run's log folder (``trainer.log_dir``: the logger's version
folder, or ``trainer.default_root_dir`` without a logger), never the working directory, so that
``dplightning predict`` run from a clone does not write into the repository.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter


def run_folder(trainer: pl.Trainer) -> Path:
    """The folder a run's outputs belong in: ``trainer.log_dir``, else ``trainer.default_root_dir``."""
    return Path(trainer.log_dir or trainer.default_root_dir)


class TextPredictionWriter(BasePredictionWriter):
    """Writes the texts ``predict_step`` returns, one line per text, in the predict loader's order.

    For :class:`~dplightning.tasks.DPCausalLM` that is one generated text per distinct test prompt.
    Line breaks inside a text are written as spaces, so line i is the i-th text. With several
    processes, rank r writes ``<stem>.rank<r><suffix>``: each holds that rank's share of the prompts.

    Args:
        output_path: The file to write; default ``<trainer.log_dir>/predictions.txt``. Overwritten by
            each ``predict`` run.
    """

    def __init__(self, output_path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self.path: Path | None = None
        """The file the last ``predict`` run wrote."""

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(self.output_path) if self.output_path else run_folder(trainer) / "predictions.txt"
        if trainer.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("", encoding="utf-8")
        self.path = path

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not isinstance(prediction, (list, tuple)) or not all(isinstance(t, str) for t in prediction):
            raise TypeError(
                "TextPredictionWriter writes the list of strings predict_step returns; got "
                f"{type(prediction).__name__}. A module without a tokenizer returns token ids: give it one."
            )
        if self.path is None:
            raise RuntimeError("TextPredictionWriter.on_predict_start did not run before the first batch.")
        with self.path.open("a", encoding="utf-8") as out:
            out.writelines(" ".join(text.splitlines()) + "\n" for text in prediction)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"Wrote the generated texts to {self.path}")
