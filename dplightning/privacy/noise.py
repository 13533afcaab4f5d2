"""Gaussian noise for the mechanism, from generators that are never shared or saved.

``seed_everything`` gives every process the same global stream, so the mechanism never
draws from the global RNG. By default each process seeds its own generator from OS
entropy once; explicit seeds exist for tests only and are expanded per
(seed, rank, step), so a resumed run never replays the noise of an earlier step.
Generator states are never checkpointed: whoever holds them can subtract the noise.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets

import numpy as np
import torch
from torch import Tensor


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (e.g. seed, purpose, rank, step), stable across runs."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def csprng_uniform(count: int) -> np.ndarray:
    """``count`` float64 uniforms in (0, 1] from the OS CSPRNG (53 random bits each)."""
    raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return ((raw >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


def _csprng_normal(numel: int) -> Tensor:
    """Standard normals from the OS CSPRNG (Box–Muller in float64)."""
    u1, u2 = csprng_uniform(2 * numel).reshape(2, numel)
    return torch.from_numpy(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2))


class GaussianNoise:
    """Source of the mechanism's noise for one process.

    Args:
        seed: Test-only seed; ``None`` (the default) seeds from OS entropy.
        rank: This process' global rank, mixed into explicit seeds.
        secure_mode: Draw uniforms from the OS CSPRNG (``os.urandom``) instead of a
            PyTorch generator, and sum four Gaussians as Opacus' ``secure_mode`` does to
            resist floating-point attacks (Holohan et al., arXiv 2107.10138). Slow: the
            noise is made on the CPU and copied to the device.
    """

    def __init__(self, seed: int | None = None, rank: int = 0, secure_mode: bool = False) -> None:
        self.seed = seed
        self.rank = rank
        self.secure_mode = secure_mode
        self._generators: dict[torch.device, torch.Generator] = {}
        self._step: int | None = None

    def start_step(self, step: int) -> None:
        """Begin drawing the noise of optimizer step ``step`` (re-seeds explicit seeds)."""
        self._step = step
        if self.seed is not None:
            self._generators.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            seed = secrets.randbits(63) if self.seed is None else derive_seed(self.seed, "noise", self.rank, self._step)
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def sample(self, like: Tensor, std: float) -> Tensor:
        """N(0, std²) noise shaped, placed and typed like ``like``."""
        if std == 0.0:
            return torch.zeros_like(like)
        if self.secure_mode:
            draws = _csprng_normal(4 * like.numel()).view(4, *like.shape).sum(0) / 2.0
            return (draws * std).to(device=like.device, dtype=like.dtype)
        return torch.normal(
            0.0, std, like.shape, generator=self._generator(like.device), device=like.device, dtype=like.dtype
        )
