"""The start of every DP-plan optimizer's ``step``: run the closure, take the release it produced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dplightning.protocols import DPRelease


class _Receives(Protocol):
    _release: DPRelease | None


def closure_and_release(optimizer: _Receives, closure: Callable[[], Any] | None) -> tuple[Any, DPRelease | None]:
    """Run ``closure`` with grad enabled and take the release ``dp_release`` left (``None`` if none came).

    Under the DP strategy the release arrives inside the closure (it runs the backward pass and
    the noisy release), so it is read only after the closure; taking it clears it, so a release
    is never applied twice.
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    release, optimizer._release = optimizer._release, None
    return loss, release
