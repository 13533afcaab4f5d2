"""The correlated noise z_t = (C⁻¹ w)_t of a matrix-factorization strategy, streamed one step at a time.

The noise of step t is added to the clipped gradient sum of step t exactly where DP-SGD adds its
independent noise; with the identity strategy it *is* DP-SGD's noise. The state that carries
the correlation across steps is as secret as the noise seed: whoever holds either can subtract
the noise. Its size is ``strategy.buffers`` tensors of the noised tensor's size (b - 1 for a
b-banded strategy, one per buffer for BLT).
"""

from __future__ import annotations

import hashlib
from typing import cast

import numpy as np
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
        buffers = [t.clone() for t in cast("list[Tensor]", state["state"])]  # as state_dict wrote it
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


def marginal_std_factors(strategy: Strategy) -> np.ndarray:
    """Std of z_t per unit std of w, for every step t: the row norms of C⁻¹ = diag(s) T⁻¹.

    z_t is N(0, (std · factor_t)²) per coordinate (correlated across steps): what an optimizer
    that debiases its second moments by the noise variance needs to know of step t.
    """
    r = strategy.inverse_coefs()
    return strategy.noise_scale() * np.sqrt(np.cumsum(r * r))


class CorrelatedBucketNoise:
    """The correlated noise of every bucket of a release: one :class:`CorrelatedNoise` stream per bucket.

    A drop-in for :class:`~dplightning.privacy.noise.GaussianNoise` in
    :meth:`~dplightning.privacy.mechanism.GradientPrivatizer.release`: :meth:`start_step` once per
    optimizer step, then :meth:`sample` once per bucket, in bucket order. Bucket ``i`` has stream
    ``i`` (its white noise is seeded per (seed, "correlated", i), then per (rank, step)), so no two
    buckets share noise. The streams start at step 0 and must advance in lock-step with the
    release steps: a skipped or repeated step raises instead of releasing misaligned noise.

    The buffers (:attr:`state`) are secret; they are never part of a checkpoint.

    Args:
        seed: Test-only seed; ``None`` seeds every stream from OS entropy.
        rank: This process' rank (mixed into the seeds).
        secure_mode: Draw the white noise from the OS CSPRNG.
    """

    def __init__(self, seed: int | None = None, rank: int = 0, secure_mode: bool = False) -> None:
        self.seed = seed
        self.rank = rank
        self.secure_mode = secure_mode
        self.strategy: Strategy | None = None
        self.streams: list[CorrelatedNoise] = []
        self._step: int | None = None
        self._next = 0

    def bind(self, strategy: Strategy) -> None:
        """Use ``strategy`` for every stream; a different one once noise was drawn raises."""
        if self.strategy is not None and self.streams and strategy != self.strategy:
            raise RuntimeError("The strategy matrix changed after correlated noise was drawn with another one.")
        self.strategy = strategy

    def start_step(self, step: int) -> None:
        """Begin the noise of optimizer step ``step`` (every stream must be at that step)."""
        if self._next not in (0, len(self.streams)):
            raise RuntimeError(
                f"The previous release drew correlated noise for {self._next} of {len(self.streams)} buckets."
            )
        behind = [s.step_index for s in self.streams if s.step_index != step]
        if behind:
            raise RuntimeError(
                f"The correlated noise streams are at step {behind[0]} but the release is step {step}: the noise "
                "would be out of step with the strategy matrix and the ledger. Nothing was released."
            )
        self._step, self._next = step, 0

    def sample(self, like: Tensor, std: float) -> Tensor:
        """The correlated noise of the next bucket of this step, shaped and typed like ``like``."""
        if self.strategy is None or self._step is None:
            raise RuntimeError("Correlated noise needs its strategy matrix and start_step() before sampling.")
        if self._next == len(self.streams):
            if self._step != 0:
                raise RuntimeError(
                    f"A new correlated noise stream was asked for at step {self._step}; streams start at step 0 "
                    "(did the buckets change during training?)."
                )
            self.streams.append(
                CorrelatedNoise(
                    self.strategy, std, seed=self.seed, rank=self.rank, stream=self._next, secure_mode=self.secure_mode
                )
            )
        stream = self.streams[self._next]
        if stream.std != float(std):
            raise RuntimeError(f"The noise std changed from {stream.std} to {std} during a correlated-noise run.")
        self._next += 1
        return stream.step(like)

    @property
    def state(self) -> list[Tensor]:
        """Every stream's secret buffers (for tests and memory reports; never save them)."""
        return [t for s in self.streams for t in s.state]

    def state_bytes(self) -> int:
        """Bytes held by the secret buffers."""
        return sum(t.numel() * t.element_size() for t in self.state)
