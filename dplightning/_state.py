"""Explicit checks of internal state on the privacy path (``assert`` statements vanish under ``python -O``)."""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T")


class StateError(RuntimeError):
    """A DP object was used before the state it needs was set up (a bug, or a hook called out of order)."""


def known(value: _T | None, what: str) -> _T:
    """``value``, or a :class:`StateError` naming ``what`` is missing.

    Args:
        value: The value that must be set by now.
        what: What it is, for the message (e.g. ``"the LightningModule"``).
    """
    if value is None:
        raise StateError(
            f"{what} is not set at this point of DP training; nothing was released. This is a bug or a hook "
            "called out of Lightning's order: please report it with the traceback."
        )
    return value
