"""Noise sources: seeded streams are reproducible per (seed, rank, step); others are not."""

from __future__ import annotations

import math

import pytest
import torch

from dplightning.privacy.noise import SPLIT_ELEMENTS, GaussianNoise, derive_seed, lanes


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


def _lane_draw(seed: int | None, threads: int, numel: int = SPLIT_ELEMENTS + 5) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        noise = GaussianNoise(seed=seed)
        noise.start_step(3)
        return noise.sample(torch.zeros(numel), 1.0)
    finally:
        torch.set_num_threads(before)


def test_a_seeded_stream_does_not_depend_on_the_core_count() -> None:
    one, two, four = (_lane_draw(5, threads) for threads in (1, 2, 4))
    assert torch.equal(one, two) and torch.equal(one, four)


@pytest.mark.parametrize("seed", [5, None])
def test_lanes_draw_independent_noise(seed: int | None) -> None:
    # A lane seeded like another would repeat its noise: the sum over examples would then carry correlated
    # noise of the wrong variance, so the lanes' draws must be uncorrelated and each a standard normal.
    x = _lane_draw(seed, threads=2)
    pieces = x.tensor_split(lanes(x.numel()))
    assert len(pieces) > 1
    m = min(p.numel() for p in pieces)
    stacked = torch.stack([p[:m] for p in pieces])
    corr = torch.corrcoef(stacked.double())
    off_diagonal = corr[~torch.eye(len(pieces), dtype=torch.bool)]
    assert off_diagonal.abs().max() < 6 / math.sqrt(m)
    bound = 6 / math.sqrt(2 * m)
    for p in pieces:
        assert abs(p.std().item() - 1) < bound and abs(p.mean().item()) < 6 / math.sqrt(m)


def test_small_tensors_keep_the_single_stream() -> None:
    # Lane 0 is the single stream's generator: a tensor below the split size draws what a plain generator does.
    noise = GaussianNoise(seed=3)
    noise.start_step(1)
    expected = torch.normal(0.0, 2.0, (1000,), generator=torch.Generator().manual_seed(derive_seed(3, "noise", 0, 1)))
    torch.testing.assert_close(noise.sample(torch.zeros(1000), 2.0), expected, rtol=0, atol=0)
