"""GradientPrivatizer: clipped sums, noise once, division by the expected batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dplightning.privacy.clipping import make_clip_groups
from dplightning.privacy.mechanism import GradientPrivatizer, common_rows
from dplightning.privacy.noise import GaussianNoise
from tests.reference import clipped_sum, per_example_grads


def _setup(policy: str = "flat", max_norm: float = 0.5, bucket_cap_mb: float = 25.0):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    groups = make_clip_groups(policy, list(net.named_parameters()), max_norm)
    return net, GradientPrivatizer(groups, bucket_cap_mb=bucket_cap_mb)


def _samples(net: nn.Module, x: torch.Tensor, y: torch.Tensor):
    grads = per_example_grads(net, F.cross_entropy, x, y)
    return {p: grads[n] for n, p in net.named_parameters()}, grads


@pytest.mark.parametrize("policy", ["flat", "per_layer"])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-4])
def test_zero_noise_release_is_the_clipped_mean_over_the_expected_batch(policy: str, bucket_cap_mb: float) -> None:
    net, priv = _setup(policy, bucket_cap_mb=bucket_cap_mb)
    x, y = torch.randn(10, 4) * 5, torch.arange(10) % 3
    samples, grads = _samples(net, x, y)
    priv.accumulate({p: g[:6] for p, g in samples.items()})
    priv.accumulate({p: g[6:] for p, g in samples.items()})
    priv.release(GaussianNoise(seed=0), noise_std=0.0, expected_batch_size=12.5)
    groups = [["0.weight", "0.bias"], ["2.weight", "2.bias"]] if policy == "per_layer" else None
    expected = clipped_sum(grads, 0.5, groups)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[n] / 12.5, rtol=1e-5, atol=1e-7)


def test_one_example_moves_the_sum_by_at_most_c() -> None:
    net, priv = _setup(max_norm=0.5)
    samples, _ = _samples(net, torch.randn(1, 4) * 1e3, torch.tensor([1]))
    priv.accumulate(samples)
    priv.release(None, 0.0, expected_batch_size=1.0)
    total = math.sqrt(sum(p.grad.pow(2).sum().item() for p in net.parameters()))
    assert total <= 0.5 + 1e-6


def test_noise_is_added_once_with_std_sigma_c_over_b() -> None:
    torch.manual_seed(0)
    net = nn.Linear(300, 300)
    priv = GradientPrivatizer(make_clip_groups("flat", list(net.named_parameters()), 2.0))
    noise = GaussianNoise(seed=1)
    noise.start_step(0)
    priv.release(noise, noise_std=1.5 * priv.sensitivity, expected_batch_size=10.0)
    released = torch.cat([p.grad.flatten() for p in net.parameters()])
    n = released.numel()
    assert abs(released.std().item() / (1.5 * 2.0 / 10.0) - 1) < 5 / math.sqrt(2 * n)
    noise = GaussianNoise(seed=1)
    noise.start_step(0)  # regenerate the stream the privatizer drew from: (seed, rank 0, step 0)
    expected = noise.sample(torch.zeros(n), 1.5 * 2.0) / 10.0
    torch.testing.assert_close(released, expected)


def test_non_finite_examples_add_zero_and_are_counted() -> None:
    net, priv = _setup()
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    samples, grads = _samples(net, x, y)
    for g in samples.values():
        g[1] = float("nan")
    stats = priv.accumulate(samples)
    priv.release(None, 0.0, expected_batch_size=1.0)
    keep = {n: g[[0, 2]] for n, g in grads.items()}
    expected = clipped_sum(keep, 0.5)
    assert stats.nonfinite == 1
    for n, p in net.named_parameters():
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7)


def test_buckets_restart_after_a_release_and_empty_steps_release_pure_noise() -> None:
    net, priv = _setup()
    samples, _ = _samples(net, torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    priv.accumulate(samples)
    priv.release(None, 0.0, 4.0)
    priv.release(None, 0.0, 4.0)  # a step in which no example was sampled
    assert all(torch.count_nonzero(p.grad) == 0 for p in net.parameters())


def test_mismatched_row_counts_are_an_error() -> None:
    net, priv = _setup()
    params = list(net.parameters())
    with pytest.raises(RuntimeError, match="disagree"):
        priv.accumulate({params[0]: torch.zeros(2, 8, 4), params[1]: torch.zeros(3, 8)})
    # The one rule, which the clip replay (norms from its first pass, factors held) applies too.
    assert (common_rows([3, 3]), common_rows([])) == (3, 0)
    with pytest.raises(RuntimeError, match=r"disagree on the number of examples: \[2, 3\]"):
        common_rows(iter([3, 2, 3]))


def test_published_norms_are_the_per_example_norms() -> None:
    net, priv = _setup("per_layer")
    samples, grads = _samples(net, torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    stats = priv.accumulate(samples, scale=2.0)
    names = [n for n, _ in net.named_parameters()]
    expected_sq = torch.stack([(2.0 * grads[n]).flatten(1).pow(2).sum(1) for n in names], dim=1)
    torch.testing.assert_close(stats.param_sq_norms, expected_sq)
    torch.testing.assert_close(
        stats.norms, torch.stack([expected_sq[:, :2].sum(1), expected_sq[:, 2:].sum(1)], 1).sqrt()
    )
