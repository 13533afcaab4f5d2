"""Streamed correlated noise: exactly C⁻¹ w, the C⁻¹C⁻ᵀ covariance, and a secret state that round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from dplightning.privacy.blt import BLTStrategy
from dplightning.privacy.correlated_noise import CorrelatedNoise
from dplightning.privacy.matrix_mechanism import BandedStrategy, identity_strategy
from dplightning.privacy.noise import GaussianNoise


class _Recorder:
    """A white-noise source that keeps what it drew."""

    def __init__(self, seed: int) -> None:
        self.inner = GaussianNoise(seed=seed)
        self.draws: list[torch.Tensor] = []

    def start_step(self, step: int) -> None:
        self.inner.start_step(step)

    def sample(self, like: torch.Tensor, std: float) -> torch.Tensor:
        self.draws.append(self.inner.sample(like, std).clone())
        return self.draws[-1].clone()


def _strategies(n: int) -> list:
    """DP-SGD, signed banded (normalised and not) and a BLT strategy."""
    return [
        identity_strategy(n),
        BandedStrategy((0.8, -0.5, 0.3, 0.1), n),
        BandedStrategy((0.9, 0.4, -0.2), n, column_normalize=False),
        BLTStrategy((0.9, 0.3), (0.4, 0.25), n),
    ]


def _stream(strategy, std: float, shape: tuple[int, ...], dtype=torch.float64, seed: int = 0):
    source = _Recorder(seed)
    noise = CorrelatedNoise(strategy, std, source=source)
    like = torch.zeros(shape, dtype=dtype)
    z = torch.stack([noise.step(like) for _ in range(strategy.n)])
    return noise, torch.stack(source.draws), z


def test_zero_std_gives_zero_noise() -> None:
    for strategy in _strategies(8):
        noise = CorrelatedNoise(strategy, 0.0, seed=1)
        assert all(torch.count_nonzero(noise.step(torch.ones(5))) == 0 for _ in range(8))


def test_identity_strategy_releases_the_white_noise() -> None:
    _, white, z = _stream(identity_strategy(6), 2.0, (100,))
    assert torch.equal(z, white)


def test_streaming_equals_dense_solve() -> None:
    n = 12
    for strategy in _strategies(n):
        _, white, z = _stream(strategy, 1.3, (3, 5))
        c = strategy.matrix()
        expected = scipy.linalg.solve_triangular(c, white.reshape(n, -1).numpy(), lower=True)
        np.testing.assert_allclose(z.reshape(n, -1).numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_streamed_noise_has_the_c_inverse_covariance(index: int) -> None:
    """Each coordinate is an independent draw of the n-step noise vector: Cov = std² C⁻¹ C⁻ᵀ."""
    n, d, std = 6, 200_000, 1.5
    strategy = _strategies(n)[index]
    _, _, z = _stream(strategy, std, (d,), dtype=torch.float32)
    z = z.double().numpy()
    empirical = z @ z.T / d
    c_inv = np.linalg.inv(strategy.matrix())
    cov = std**2 * c_inv @ c_inv.T
    se = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / d)
    assert np.all(np.abs(empirical - cov) < 6 * se)
    off = ~np.eye(n, dtype=bool)
    if index:  # correlated strategies: a model of independent steps must be rejected
        assert np.any(np.abs(empirical[off]) > 6 * se[off])


def test_noise_has_the_gradient_dtype_and_state_is_fp32() -> None:
    noise = CorrelatedNoise(_strategies(8)[1], 1.0, seed=0)
    out = noise.step(torch.zeros(4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in noise.state)


def test_state_is_one_tensor_per_buffer() -> None:
    for strategy, buffers in [(identity_strategy(8), 0), (_strategies(8)[1], 3), (BLTStrategy((0.9,), (0.5,), 8), 1)]:
        noise = CorrelatedNoise(strategy, 1.0, seed=0)
        noise.step(torch.zeros(2, 3))
        assert strategy.buffers == buffers and len(noise.state) == buffers
        assert all(t.shape == (2, 3) for t in noise.state)
    blt = BLTStrategy((0.99, 0.9, 0.5, 0.1), (0.2, 0.2, 0.2, 0.2), 10_000)
    noise = CorrelatedNoise(blt, 1.0, seed=0)
    for _ in range(50):
        noise.step(torch.zeros(10))
    assert len(noise.state) == 4  # independent of the number of steps taken


def test_state_dict_round_trip() -> None:
    for strategy in _strategies(12):
        like = torch.zeros(7)
        a = CorrelatedNoise(strategy, 1.0, seed=5)
        for _ in range(5):
            a.step(like)
        saved = a.state_dict()
        rest = [a.step(like) for _ in range(4)]
        b = CorrelatedNoise(strategy, 1.0, seed=5)
        b.load_state_dict(saved)
        assert all(torch.equal(x, b.step(like)) for x in rest)
    with pytest.raises(ValueError, match="another strategy"):
        CorrelatedNoise(identity_strategy(12), 2.0, seed=5).load_state_dict(saved)


def test_regenerate_from_seed_and_step() -> None:
    strategy = _strategies(12)[3]
    like = torch.zeros(6)
    a = CorrelatedNoise(strategy, 1.0, seed=9, rank=1, stream=2)
    for _ in range(7):
        a.step(like)
    b = CorrelatedNoise(strategy, 1.0, seed=9, rank=1, stream=2)
    b.regenerate(7, like)
    assert all(torch.equal(x, y) for x, y in zip(a.state, b.state))
    assert torch.equal(a.step(like), b.step(like))
    with pytest.raises(RuntimeError, match="regenerated"):
        CorrelatedNoise(strategy, 1.0).regenerate(3, like)


def test_streams_ranks_and_seeds_differ() -> None:
    strategy = _strategies(4)[1]
    like = torch.zeros(50)

    def first(**kwargs) -> torch.Tensor:
        return CorrelatedNoise(strategy, 1.0, **kwargs).step(like)

    base = first(seed=1)
    assert torch.equal(base, first(seed=1))
    for other in (first(seed=1, stream=1), first(seed=1, rank=1), first(seed=2), first()):
        assert not torch.equal(base, other)


def test_steps_beyond_the_plan_and_shape_changes_are_refused() -> None:
    noise = CorrelatedNoise(_strategies(2)[1], 1.0, seed=0)
    noise.step(torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        noise.step(torch.zeros(4))
    noise.step(torch.zeros(3))
    with pytest.raises(RuntimeError, match="2 steps"):
        noise.step(torch.zeros(3))
