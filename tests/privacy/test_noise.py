"""Noise sources: seeded streams are reproducible per (seed, rank, step); others are not."""

from __future__ import annotations

import math

import torch

from dplightning.privacy.noise import GaussianNoise


def _draw(noise: GaussianNoise, step: int, n: int = 1000) -> torch.Tensor:
    noise.start_step(step)
    return noise.sample(torch.zeros(n), 1.0)


def test_seeded_streams_depend_on_seed_rank_and_step() -> None:
    a = _draw(GaussianNoise(seed=3, rank=0), 5)
    torch.testing.assert_close(a, _draw(GaussianNoise(seed=3, rank=0), 5))
    assert not torch.equal(a, _draw(GaussianNoise(seed=3, rank=1), 5))
    assert not torch.equal(a, _draw(GaussianNoise(seed=3, rank=0), 6))


def test_unseeded_processes_do_not_share_a_stream() -> None:
    torch.manual_seed(0)
    a = _draw(GaussianNoise(), 0)
    torch.manual_seed(0)  # the global seed must not matter
    assert not torch.equal(a, _draw(GaussianNoise(), 0))


def test_secure_mode_has_the_requested_std() -> None:
    n = 200_000
    x = GaussianNoise(secure_mode=True).sample(torch.zeros(n), 2.0)
    bound = 5 / math.sqrt(2 * n)  # 5 standard errors of a sample std
    assert abs(x.std().item() / 2.0 - 1) < bound
    assert abs(x.mean().item()) < 5 * 2.0 / math.sqrt(n)


def test_zero_std_is_exactly_zero() -> None:
    assert torch.count_nonzero(GaussianNoise(seed=0).sample(torch.ones(10), 0.0)) == 0
