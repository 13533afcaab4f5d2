"""Poisson sampling: rate, lock-step lengths, disjoint shards, empty batches, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from dplightning.data.poisson import (
    EmptySafeCollate,
    PoissonBatchSampler,
    PoissonDataLoader,
    batch_rows,
    check_poisson_compatible,
    steps_per_epoch,
)


def test_inclusion_frequency_matches_q() -> None:
    n, q = 500, 0.03
    sampler = PoissonBatchSampler(n, q, seed=0)
    counts = torch.zeros(n)
    epochs = 40
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in sampler:
            counts[batch] += 1
    draws = epochs * len(sampler)
    # Binomial test on the total: mean n*draws*q, std sqrt(n*draws*q*(1-q)); 5 standard deviations.
    total = counts.sum().item()
    assert abs(total - n * draws * q) < 5 * math.sqrt(n * draws * q * (1 - q))
    # No example is favoured: each one's count is Binomial(draws, q).
    assert counts.max().item() < draws * q + 6 * math.sqrt(draws * q * (1 - q))


@pytest.mark.parametrize("secure_mode", [False, True])
def test_batch_sizes_have_binomial_mean_and_variance(secure_mode: bool) -> None:
    n, q = 1000, 0.05
    sampler = PoissonBatchSampler(n, q, seed=2, secure_mode=secure_mode)
    sizes = torch.tensor([float(len(b)) for _ in range(100) for b in sampler])  # 100 epochs of 20 steps
    m = len(sizes)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean().item() - mean) < 5 * math.sqrt(var / m)
    assert abs(sizes.var().item() / var - 1) < 5 * math.sqrt(2 / (m - 1))
    assert all(len(set(b)) == len(b) for b in sampler)  # no example twice in a batch


def test_shards_are_disjoint_and_their_union_is_the_whole_set() -> None:
    shards = [PoissonBatchSampler(103, 0.5, rank=r, world_size=4, seed=0).shard for r in range(4)]
    union = torch.cat(shards)
    assert len(union) == 103 and len(union.unique()) == 103


def test_realised_global_rate_over_ranks_matches_q() -> None:
    n, q, world = 300, 0.05, 3
    samplers = [PoissonBatchSampler(n, q, rank=r, world_size=world) for r in range(world)]
    epochs = 30
    total = sum(len(batch) for s in samplers for _ in range(epochs) for batch in s)
    draws = epochs * steps_per_epoch(q)
    assert abs(total - n * draws * q) < 5 * math.sqrt(n * draws * q * (1 - q))


def test_ranks_draw_independent_streams_from_one_seed() -> None:
    a = list(PoissonBatchSampler(200, 0.5, rank=0, world_size=2, seed=1))
    b = list(PoissonBatchSampler(200, 0.5, rank=1, world_size=2, seed=1))
    shifted = [[i + 1 for i in batch] for batch in a]
    assert shifted != b


@pytest.mark.parametrize("k", [1, 3])
def test_every_rank_yields_steps_times_k_batches_even_when_empty(k: int) -> None:
    q = 0.004
    for rank in range(2):
        sampler = PoissonBatchSampler(100, q, micro_batches=k, rank=rank, world_size=2, seed=0)
        batches = list(sampler)
        assert len(batches) == len(sampler) == steps_per_epoch(q) * k
        assert sum(len(b) == 0 for b in batches) > len(batches) // 2


def test_micro_batches_partition_one_poisson_batch() -> None:
    one = list(PoissonBatchSampler(300, 0.2, micro_batches=1, seed=5))
    three = list(PoissonBatchSampler(300, 0.2, micro_batches=3, seed=5))
    merged = [sum(three[i : i + 3], []) for i in range(0, len(three), 3)]
    assert merged == one


def test_unseeded_epochs_differ() -> None:
    sampler = PoissonBatchSampler(1000, 0.1)
    assert list(sampler) != list(sampler)


def test_empty_batches_keep_structure_and_dtype() -> None:
    ds = TensorDataset(torch.randn(10, 3, 4), torch.arange(10))
    loader = PoissonDataLoader.from_dataloader(DataLoader(ds, batch_size=2), sample_rate=1e-9, seed=0)
    x, y = next(iter(loader))
    assert x.shape == (0, 3, 4) and y.shape == (0,) and y.dtype == torch.long
    assert batch_rows((x, y)) == 0


def test_collate_passes_non_empty_batches_through() -> None:
    ds = TensorDataset(torch.arange(6.0))
    collate = EmptySafeCollate(lambda items: torch.stack([i[0] for i in items]), ds)
    torch.testing.assert_close(collate([ds[1], ds[2]]), torch.tensor([1.0, 2.0]))


def test_custom_samplers_and_iterable_datasets_are_refused() -> None:
    ds = TensorDataset(torch.randn(10, 2))
    weighted = DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler(torch.ones(10), 10))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        check_poisson_compatible(weighted)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="map-style"):
        check_poisson_compatible(DataLoader(Stream(), batch_size=2))
    for ok in (DataLoader(ds, batch_size=2, shuffle=True), DataLoader(ds, batch_size=2)):
        check_poisson_compatible(ok)


def test_batch_rows_finds_the_first_tensor() -> None:
    assert batch_rows({"ids": torch.zeros(4, 7), "n": 3}) == 4
    assert batch_rows(["text", (torch.zeros(2),)]) == 2
    assert batch_rows("nothing") is None
