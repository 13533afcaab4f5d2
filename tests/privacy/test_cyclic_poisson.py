"""Cyclic Poisson sampling: fixed secret partitions, one per step in turn, Poisson within it."""

from __future__ import annotations

import math

import pytest
import torch

from dplightning.privacy.poisson import CyclicPoissonBatchSampler, cyclic_partitions


def test_partitions_split_the_data_into_fixed_parts() -> None:
    parts = cyclic_partitions(103, 4, seed=7)
    joined = torch.cat(parts)
    assert sorted(joined.tolist()) == list(range(103))  # disjoint and covering
    assert all(torch.equal(a, b) for a, b in zip(parts, cyclic_partitions(103, 4, seed=7)))  # one split per seed
    assert not torch.equal(parts[0], cyclic_partitions(103, 4, seed=8)[0])
    with pytest.raises(ValueError, match="partitions <= N"):
        cyclic_partitions(3, 4, seed=0)


def _owners(num_samples: int, partitions: int, seed: int) -> list[int]:
    owner = [-1] * num_samples
    for p, part in enumerate(cyclic_partitions(num_samples, partitions, seed)):
        for i in part.tolist():
            owner[i] = p
    return owner


def test_removing_an_example_leaves_the_others_parts_distributed_as_before() -> None:
    """Add-or-remove adjacency: the other examples' parts must not depend on whether one more example exists.

    An equal split fails this: two examples in two parts never share one, while the parts of
    N examples drawn alone would; and alone, one example always took part 0.
    """
    partitions, seeds = 2, 4000
    together = sum(len(set(_owners(2, partitions, s))) == 1 for s in range(seeds)) / seeds
    assert abs(together - 1 / partitions) < 5 * math.sqrt(0.25 / seeds)  # independent, uniform parts
    first = sum(_owners(2, partitions, s)[0] for s in range(seeds)) / seeds  # example 0's part, uniform
    assert abs(first - 0.5) < 5 * math.sqrt(0.25 / seeds)
    # With the same secret seed the coupling is exact: the remaining examples keep their parts.
    for seed in range(20):
        assert _owners(50, 4, seed)[:49] == _owners(49, 4, seed)


def _steps(sampler: CyclicPoissonBatchSampler, epochs: int) -> list[list[int]]:
    """The index lists of every logical step over ``epochs`` epochs (micro-batches joined)."""
    out: list[list[int]] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        k = sampler.micro_batches
        out += [sum(batches[i : i + k], []) for i in range(0, len(batches), k)]
    return out


def test_every_example_waits_at_least_the_number_of_partitions_and_joins_at_rate_q() -> None:
    n, partitions, q, epochs = 200, 5, 0.3, 40
    sampler = CyclicPoissonBatchSampler(n, q, partitions, partition_seed=3, micro_batches=2, seed=1)
    assert sampler.steps_per_epoch == partitions * math.ceil(1 / q) and len(sampler) == 2 * sampler.steps_per_epoch
    steps = _steps(sampler, epochs)
    parts = cyclic_partitions(n, partitions, seed=3)
    owner = {i: p for p, part in enumerate(parts) for i in part.tolist()}
    last: dict[int, int] = {}
    for t, chosen in enumerate(steps):  # global step t: the run crosses epoch boundaries
        assert len(chosen) == len(set(chosen))
        for i in chosen:
            assert owner[i] == t % partitions, (i, t)
            assert t - last.get(i, -partitions) >= partitions
            last[i] = t
    # Rate: each example joins each of its partition's turns with probability q (binomial, 5 standard errors).
    turns = sum(len(parts[t % partitions]) for t in range(len(steps)))
    joined = sum(len(c) for c in steps)
    assert abs(joined / turns - q) < 5 * math.sqrt(q * (1 - q) / turns)
    counts = torch.bincount(torch.tensor([i for c in steps for i in c]), minlength=n).double()
    chances = len(steps) / partitions
    assert counts.min() > 0 and abs(counts.mean() / chances - q) < 0.02


def test_ranks_share_each_partition_disjointly() -> None:
    n, partitions, q = 90, 3, 0.5
    ranks = [CyclicPoissonBatchSampler(n, q, partitions, 11, rank=r, world_size=2, seed=4) for r in range(2)]
    parts = cyclic_partitions(n, partitions, seed=11)
    for p in range(partitions):
        shares = [set(s.parts[p].tolist()) for s in ranks]
        assert not shares[0] & shares[1] and shares[0] | shares[1] == set(parts[p].tolist())
    steps = [_steps(s, 2) for s in ranks]
    assert len(steps[0]) == len(steps[1])  # lock-step
    for t, (a, b) in enumerate(zip(*steps)):
        assert not set(a) & set(b)
        assert set(a) | set(b) <= set(parts[t % partitions].tolist())
