"""The correlated noise z_t = (C⁻¹ w)_t of a matrix-factorization strategy, streamed one step at a time.

The noise of step t is added to the clipped gradient sum of step t exactly where DP-SGD adds its
independent noise; with the identity strategy it *is* DP-SGD's noise. The state that carries
the correlation across steps is as secret as the noise seed: whoever holds either can subtract
the noise. Its size is ``strategy.buffers`` tensors of the noised tensor's size (b - 1 for a
b-banded strategy, one per buffer for BLT).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from dplightning.privacy.matrix_mechanism import Strategy
from dplightning.privacy.noise import GaussianNoise, derive_seed


class CorrelatedNoise:
    """Streams the correlated noise z_t = (C⁻¹ w)_t, one tensor per optimizer step.

    w_t ~ N(0, std²) iid per coordinate and step; ``std`` is σ · sensitivity · clip norm for the
    participation pattern the accounting uses. The state (:attr:`state`, a list of
    ``strategy.buffers`` tensors shaped like the noise, fp32 or wider) is **secret**: whoever
    holds it, or the seed, can subtract the noise. It lives where the first :meth:`step`'s
    tensor lives; move its tensors to keep it elsewhere. Never write :meth:`state_dict` into a
    released checkpoint.

    Regeneration: with an explicit ``seed`` the white noise of step t is a function of (seed,
    stream, rank, t) on a given device type, so :meth:`regenerate` rebuilds the state after t
    steps by replaying them (O(t · numel · buffers) work). Unseeded (OS entropy) or
    ``secure_mode`` noise cannot be regenerated; keep the state itself.

    Args:
        strategy: The strategy C (its ``n`` bounds the number of steps).
        std: Standard deviation of w.
        seed: Secret seed (tests, or regeneration); ``None`` seeds from OS entropy.
        rank: Process rank mixed into the seed.
        stream: Distinguishes independent noise streams of one process (e.g. buckets): two
            streams with one (seed, stream, rank) would carry the same noise, and the
            difference of what they noise would be released without any.
        secure_mode: Passed to :class:`~dplightning.privacy.noise.GaussianNoise`.
        source: Replaces the white-noise source (tests); needs ``start_step`` and ``sample``.
    """

    def __init__(
        self,
        strategy: Strategy,
        std: float,
        *,
        seed: int | None = None,
        rank: int = 0,
        stream: int = 0,
        secure_mode: bool = False,
        source: GaussianNoise | None = None,
    ) -> None:
        if not std >= 0.0:
            raise ValueError(f"std must be >= 0, got {std}.")
        self.strategy = strategy
        self.std = float(std)
        self.seed = seed
        white_seed = None if seed is None else derive_seed(seed, "correlated", stream)
        self._source = source or GaussianNoise(seed=white_seed, rank=rank, secure_mode=secure_mode)
        self.state: list[Tensor] = []
        self.step_index = 0
        self._shape: torch.Size | None = None

    def _digest(self) -> str:
        return hashlib.blake2b(repr((self.strategy, self.std)).encode(), digest_size=8).hexdigest()

    def step(self, like: Tensor) -> Tensor:
        """The noise of the next step, shaped, placed and typed like ``like``."""
        if self.step_index >= self.strategy.n:
            raise RuntimeError(f"The strategy was built for {self.strategy.n} steps; step {self.step_index} asked.")
        dtype = torch.promote_types(like.dtype, torch.float32)
        if self._shape is None:
            self._shape = like.shape
            self.state = [
                torch.zeros(like.shape, dtype=dtype, device=like.device) for _ in range(self.strategy.buffers)
            ]
        elif like.shape != self._shape:
            raise ValueError(f"Noise shape changed from {tuple(self._shape)} to {tuple(like.shape)}.")
        self._source.start_step(self.step_index)
        white = self._source.sample(torch.empty(like.shape, dtype=dtype, device=like.device), self.std)
        noise = self.strategy.advance(self.state, white, self.step_index)
        self.step_index += 1
        return noise.to(like.dtype)

    def state_dict(self) -> dict[str, object]:
        """Step index and buffers (secret; keep out of released checkpoints)."""
        return {"step": self.step_index, "state": [t.detach().clone() for t in self.state], "digest": self._digest()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` of a stream with the same strategy and std."""
        if state["digest"] != self._digest():
            raise ValueError("This state belongs to another strategy or noise std.")
        buffers = [t.clone() for t in state["state"]]  # type: ignore[union-attr]
        if len(buffers) != self.strategy.buffers:
            raise ValueError(f"Expected {self.strategy.buffers} buffers, got {len(buffers)}.")
        self.step_index = int(state["step"])  # type: ignore[call-overload]
        self.state = buffers
        self._shape = buffers[0].shape if buffers else None

    def regenerate(self, step: int, like: Tensor) -> None:
        """Rebuild the state after ``step`` steps from the seed by replaying their white noise."""
        if self.seed is None or getattr(self._source, "secure_mode", False):
            raise RuntimeError("Only seeded, non-secure-mode noise can be regenerated; keep its state instead.")
        self.state, self.step_index, self._shape = [], 0, None
        for _ in range(step):
            self.step(like)
