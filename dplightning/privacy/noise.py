"""Gaussian noise for the mechanism, from generators that are never shared or saved.

``seed_everything`` gives every process the same global stream, so the mechanism never
draws from the global RNG. By default each process seeds its own generator from OS
entropy once; explicit seeds exist for tests only and are expanded per
(seed, rank, step), so a resumed run never replays the noise of an earlier step.
Generator states are never checkpointed: whoever holds them can subtract the noise.

On the CPU, torch's Gaussian generator runs on one core, and on small models it is the largest
part of a DP step's overhead. A large CPU tensor is therefore filled in *lanes*: contiguous
slices with independently seeded generators, filled by a thread pool. The lanes are fixed by
the tensor's size alone, never by the core count, so a seeded stream draws the same noise on
any machine.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

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


SPLIT_ELEMENTS = 1 << 18
"""CPU tensors from this size on are drawn in lanes; below it, waking a thread costs about what it saves."""
LANES = 16
"""Lanes of a split tensor; a constant, so that a seed's draws never depend on the core count."""


def lanes(numel: int) -> int:
    """How many independently seeded slices a CPU tensor of ``numel`` entries is drawn in."""
    return LANES if numel >= SPLIT_ELEMENTS else 1


_pool: tuple[int, int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _workers(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` workers for this process (a forked child gets its own, its parent's threads are gone)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[:2] != (os.getpid(), threads):
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="dp-noise"))
        return _pool[2]


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
        self._generators: dict[tuple[torch.device, int], torch.Generator] = {}
        self._step: int | None = None

    def start_step(self, step: int) -> None:
        """Begin drawing the noise of optimizer step ``step`` (re-seeds explicit seeds)."""
        self._step = step
        if self.seed is not None:
            self._generators.clear()

    def _generator(self, device: torch.device, lane: int = 0) -> torch.Generator:
        key = (device, lane)
        if key not in self._generators:
            if self.seed is None:
                seed = secrets.randbits(63)
            else:  # lane 0 keeps the single-stream seed, so small tensors draw what they always drew
                parts = (self.seed, "noise", self.rank, self._step) + ((lane,) if lane else ())
                seed = derive_seed(*parts)
            self._generators[key] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[key]

    def sample(self, like: Tensor, std: float) -> Tensor:
        """N(0, std²) noise shaped, placed and typed like ``like``."""
        if std == 0.0:
            return torch.zeros_like(like)
        if self.secure_mode:
            draws = _csprng_normal(4 * like.numel()).view(4, *like.shape).sum(0) / 2.0
            return (draws * std).to(device=like.device, dtype=like.dtype)
        out = torch.empty(like.shape, device=like.device, dtype=like.dtype)
        count = lanes(out.numel()) if out.device.type == "cpu" else 1
        if count == 1:
            return out.normal_(0.0, std, generator=self._generator(out.device))
        pieces = out.view(-1).tensor_split(count)
        generators = [self._generator(out.device, k) for k in range(count)]  # made here, not raced for in the workers
        threads = min(torch.get_num_threads(), count)

        def fill(first: int) -> None:  # one task per thread: dispatching a task per lane costs more
            for k in range(first, count, threads):
                pieces[k].normal_(0.0, std, generator=generators[k])

        helpers = [_workers(threads - 1).submit(fill, w) for w in range(1, threads)] if threads > 1 else []
        fill(0)
        for helper in helpers:
            helper.result()
        return out
