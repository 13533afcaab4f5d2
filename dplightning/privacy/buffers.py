"""Refuse buffer writes during a training step: a statistic of the batch in a buffer is released unprotected.

A buffer is saved in ``state_dict`` beside the (ε, δ) claim and never noised. A module that
writes into one while it sees the private batch (a running mean, a count, an EMA of its
inputs) would publish a raw statistic of the training data; BatchNorm is only the best-known
case. Writes are seen without copying anything: an in-place write bumps the tensor's
version counter, and an assignment (``self.stat = x.mean(0)``) replaces the tensor.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import Tensor, nn


def _fingerprint(t: Tensor) -> tuple[int, int]:
    # An inference tensor has no version counter, but it cannot be written in place outside
    # inference mode either: only a reassignment, which its identity shows, can change it.
    return id(t), -1 if t.is_inference() else t._version


class BufferWatch:
    """Snapshots a module's buffers before a training step and refuses any write after it.

    Args:
        module: The LightningModule.
        public: Names (as in ``module.named_buffers()``) of buffers declared data-independent
            or public, which may be written: the module's ``dp_public_buffers``.

    Raises:
        ValueError: If a name in ``public`` is not a buffer of ``module``.
    """

    def __init__(self, module: nn.Module, public: Collection[str] = ()) -> None:
        self.module = module
        names = {name for name, _ in module.named_buffers()}
        unknown = sorted(set(public) - names)
        if unknown:
            raise ValueError(
                f"dp_public_buffers names {unknown}, which are not buffers of {type(module).__name__} "
                f"(its buffers: {sorted(names)[:10]})."
            )
        self.public = frozenset(public)
        self._before: dict[str, tuple[int, int]] = {}

    def _state(self) -> dict[str, tuple[int, int]]:
        return {name: _fingerprint(t) for name, t in self.module.named_buffers() if name not in self.public}

    def snapshot(self) -> None:
        """Remember every watched buffer (call before the step sees its batch)."""
        self._before = self._state()

    def check(self, when: str) -> None:
        """Raise if a watched buffer was written, added or removed since :meth:`snapshot`.

        Args:
            when: Where the step is, for the message (``"training_step"``, ``"the backward pass"``).

        Raises:
            RuntimeError: Naming the module, its type and the buffer.
        """
        after, before = self._state(), self._before
        written = sorted(name for name in after.keys() | before.keys() if after.get(name) != before.get(name))
        if not written:
            return
        listed = ", ".join(_describe(self.module, name) for name in written[:5])
        raise RuntimeError(
            f"A module wrote a buffer during {when}: {listed}. A buffer written while the module sees the private "
            "batch (a running mean, a count, an EMA of inputs) holds a raw statistic of the training data; it is "
            "saved in state_dict next to the (ε, δ) claim without noise. Compute such statistics outside "
            "training_step from public data, or, if the buffer is data-independent (a step counter, a cache "
            "of positions), declare it public on the LightningModule: dp_public_buffers = {"
            + ", ".join(repr(n) for n in written[:5])
            + "}."
        )


def _describe(module: nn.Module, name: str) -> str:
    owner, _, buffer = name.rpartition(".")
    layer = module.get_submodule(owner) if owner else module
    return f"'{owner or '<root>'}' ({type(layer).__name__}) buffer '{buffer}'"


def public_buffers(module: nn.Module) -> Collection[str]:
    """The module's ``dp_public_buffers`` (buffer names it declares data-independent), default none."""
    public = getattr(module, "dp_public_buffers", ())
    if isinstance(public, str) or not all(isinstance(n, str) for n in public):
        raise ValueError(f"dp_public_buffers must be a collection of buffer names, got {public!r}.")
    return public
