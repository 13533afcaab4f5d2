"""Typed access to Trainer attributes that Lightning sets at run time and its class does not declare."""

from __future__ import annotations

import lightning.pytorch as pl


def trainer_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """``trainer.callbacks``, the list itself (appending to it adds a callback).

    Lightning's callback connector sets the attribute in ``Trainer.__init__``; the class does not
    declare it, so a type checker does not see it.
    """
    return trainer.callbacks  # type: ignore[attr-defined]
