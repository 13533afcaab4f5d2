"""Manual optimization's accumulation: the backward passes of one batch, summed until the release.

A part of :class:`~dplightning.strategies.private_step.PrivateStep`. Under automatic
optimization each backward pass covers a whole micro-batch and is clipped at once. Under
manual optimization a ``training_step`` may call ``manual_backward`` several times on the
same examples (e.g. one loss per head), so each example's gradient is the sum of its
contributions from every pass: the per-example parts are kept, per parameter, until the
batch's single ``opt.step()`` releases them, and only that sum is clipped.
"""

from __future__ import annotations

from torch import nn

from dplightning.privacy.grad_sample import PerExampleGrad
from dplightning.privacy.grad_sample.grads import add


class ManualAccumulation:
    """The per-example gradients of one manual-optimization batch's backward passes, awaiting their release."""

    def __init__(self) -> None:
        self._parts: dict[nn.Parameter, list[PerExampleGrad]] = {}
        self._scale = 1.0

    @property
    def pending(self) -> bool:
        """Whether backward passes of the current batch await their release."""
        return bool(self._parts)

    def add(self, grads: dict[nn.Parameter, PerExampleGrad], scale: float) -> None:
        """Keep one backward pass's per-example gradients.

        Args:
            grads: The pass's per-example gradient of each parameter it reached.
            scale: From the captured gradients to each unit's own gradient (the same for every
                pass of one batch; the last pass's is the one used).
        """
        self._scale = scale
        for p, g in grads.items():
            self._parts.setdefault(p, []).append(g)

    def take(self) -> tuple[dict[nn.Parameter, PerExampleGrad], float] | None:
        """The summed per-example gradient of every parameter and their scale, or ``None`` if nothing is pending.

        Empties the accumulation.
        """
        if not self._parts:
            return None
        parts, self._parts = self._parts, {}
        return {p: add(contributions) for p, contributions in parts.items()}, self._scale

    def clear(self) -> None:
        """Drop what is pending (the step is closed)."""
        self._parts = {}
