"""Refuse writes to the saved state around a training step: a statistic of the batch would be released unprotected.

Every tensor of ``state_dict`` that the mechanism does not privatize (buffers, and frozen or
non-optimized parameters) is saved beside the (ε, δ) claim and never noised. A module that
writes into one while it sees the private batch (a running mean, a count, an EMA of its
inputs, a frozen ``nn.Parameter`` used as a running mean) would publish a raw statistic of the
training data; BatchNorm is only the best-known case. The watch sees

* an in-place write by the tensor's version counter, an assignment (``self.stat = x.mean(0)``)
  by its identity, at no cost;
* a write through ``.data`` (which bypasses the version counter) by a digest of the values:
  always for buffers (small), and for frozen parameters on the verified first steps (a digest
  reads every weight once);
* a write between two steps (e.g. in ``on_train_batch_end``, from the batch just seen), when
  the next step starts.

A tensor the model declares data-independent or public may be written: ``dp_public_buffers``
on the LightningModule, or on any submodule for its own tensors (names relative to it), e.g.
an EMA of the released weights, which is post-processing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import Tensor, nn

from dplightning.privacy.release import decision

_Fingerprint = tuple[int, int, float | None]


def _fingerprint(t: Tensor, digest: float | None) -> _Fingerprint:
    # An inference tensor has no version counter, but it cannot be written in place outside
    # inference mode either: only a reassignment, which its identity shows, can change it.
    return id(t), -1 if t.is_inference() else t._version, digest


def _digests(tensors: list[Tensor]) -> list[float]:
    """One number per tensor that a write of its values changes (NaN reads as a fixed value): one device sync."""
    if not tensors:
        return []
    values = []
    for t in tensors:
        flat = t.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(7.0).add_(1.0)
        values.append(torch.nan_to_num(flat, nan=0.5, posinf=1e300, neginf=-1e300).mul(weights).sum())
    return torch.stack(values).tolist()


class BufferWatch:
    """Snapshots a module's unprivatized state before a training step and refuses any write since.

    Args:
        module: The LightningModule.
        public: Names (as in ``module.state_dict()``) of tensors declared data-independent or
            public, which may be written: :func:`public_buffers`.
        privatized: The parameters the mechanism privatizes now (changed only by the optimizer
            step, between the steps, from the noisy gradient).

    Raises:
        ValueError: If a name in ``public`` is not a buffer or parameter of ``module``.
    """

    def __init__(
        self,
        module: nn.Module,
        public: Collection[str] = (),
        privatized: Callable[[], Collection[Tensor]] = lambda: (),
    ) -> None:
        self.module = module
        names = {name for name, _ in module.named_buffers()} | {name for name, _ in module.named_parameters()}
        unknown = sorted(set(public) - names)
        if unknown:
            raise ValueError(
                f"dp_public_buffers names {unknown}, which are not buffers of {type(module).__name__} "
                f"(its buffers: {sorted(n for n, _ in module.named_buffers())[:10]})."
            )
        self.public = frozenset(public)
        self.privatized = privatized
        self.deep = True
        """Whether frozen parameters' values are digested too (the strategy sets it on its verified steps)."""
        self._before: dict[str, _Fingerprint] = {}
        self._after: dict[str, _Fingerprint] | None = None

    def _state(self) -> dict[str, _Fingerprint]:
        skip = {id(p) for p in self.privatized()}
        buffers = [(n, t) for n, t in self.module.named_buffers() if n not in self.public]
        frozen = [(n, p) for n, p in self.module.named_parameters() if id(p) not in skip and n not in self.public]
        digested = buffers + (frozen if self.deep else [])
        digests = dict(zip((n for n, _ in digested), _digests([t for _, t in digested])))
        return {n: _fingerprint(t, digests.get(n)) for n, t in buffers + frozen}

    def snapshot(self) -> None:
        """Remember the watched state (call before the step sees its batch).

        Raises:
            RuntimeError: If a watched tensor was written since the end of the previous step.
        """
        now = self._state()
        if self._after is not None:
            shared = self._after.keys() & now.keys()  # re-planning may move a parameter in or out of the watch
            self._refuse(
                [n for n in shared if not _same(self._after[n], now[n])],
                "the time between two training steps (e.g. in on_train_batch_end, from the batch just seen)",
            )
        self._before = now

    def check(self, when: str) -> None:
        """Raise if a watched tensor was written, added or removed since :meth:`snapshot`.

        Args:
            when: Where the step is, for the message (``"training_step"``, ``"the backward pass"``).

        Raises:
            RuntimeError: Naming the module, its type and the tensor.
        """
        after, before = self._state(), self._before
        missing = (None, None, None)
        self._refuse(
            [n for n in after.keys() | before.keys() if not _same(after.get(n, missing), before.get(n, missing))],
            when,
        )
        self._after = after

    def _refuse(self, written: list[str], when: str) -> None:
        with decision("state_watch"):
            self._raise_if_written(written, when)

    def _raise_if_written(self, written: list[str], when: str) -> None:
        if not written:
            return
        written = sorted(written)
        listed = ", ".join(_describe(self.module, name) for name in written[:5])
        raise RuntimeError(
            f"A module wrote its saved state during {when}: {listed}. A buffer or frozen parameter written from "
            "the private batch (a running mean, a count, an EMA of inputs) holds a raw statistic of the training "
            "data; it is saved in state_dict next to the (ε, δ) claim without noise. Compute such statistics "
            "outside training from public data, or, if the tensor is data-independent or public (a step counter, "
            "a cache of positions, an EMA of the released weights), declare it public on the LightningModule: "
            "dp_public_buffers = {" + ", ".join(repr(n) for n in written[:5]) + "}."
        )


def _same(a: _Fingerprint | tuple[None, None, None], b: _Fingerprint | tuple[None, None, None]) -> bool:
    """Equal identity and version, and equal digests where both were taken."""
    return a[:2] == b[:2] and (a[2] is None or b[2] is None or a[2] == b[2])


def _describe(module: nn.Module, name: str) -> str:
    owner, _, tensor = name.rpartition(".")
    layer = module.get_submodule(owner) if owner else module
    kind = "buffer" if tensor in dict(layer.named_buffers(recurse=False)) else "parameter"
    return f"'{owner or '<root>'}' ({type(layer).__name__}) {kind} '{tensor}'"


def public_buffers(module: nn.Module) -> Collection[str]:
    """The names the module and its submodules declare data-independent or public (``dp_public_buffers``).

    A submodule's names are relative to it (an EMA module declares its own shadow buffers).
    """
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        public = getattr(sub, "dp_public_buffers", ())
        if isinstance(public, str) or not all(isinstance(n, str) for n in public):
            raise ValueError(f"dp_public_buffers must be a collection of buffer names, got {public!r}.")
        names.update(f"{prefix}.{n}" if prefix else n for n in public)
    return names
