"""Poisson sampling: rate, lock-step lengths, disjoint shards, empty batches, refusals."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler
from transformers import BatchEncoding

from dplightning.privacy.poisson import (
    EmptySafeCollate,
    PoissonBatchSampler,
    PoissonDataLoader,
    batch_rows,
    check_poisson_compatible,
    empty_like_batch,
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


class _Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Batch:
    ids: torch.Tensor
    meta: dict
    note: str = "kept"
    seen: int = dataclasses.field(default=0, init=False)


def _templates() -> list[object]:
    t = torch.arange(12.0).reshape(3, 4)
    return [
        t,
        {"a": t, "b": [t, (t, "s")], "n": 3},
        collections.OrderedDict(x=t),
        collections.defaultdict(list, {"x": t}),
        _Pair(t, t[:, 0]),
        [t, None, "text"],
        (t, 1.5),
        _Batch(t, {"m": t}),
        BatchEncoding({"input_ids": t.long(), "attention_mask": t.bool()}),
        "plain",
    ]


@pytest.mark.parametrize("template", _templates(), ids=lambda t: type(t).__name__)
def test_empty_like_batch_walks_a_batch_as_lightning_did(template: object) -> None:
    """The sampler moved under privacy/ without Lightning: its empty batch equals Lightning's apply_to_collection."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    ours = empty_like_batch(template)
    theirs = apply_to_collection(template, torch.Tensor, lambda t: t[:0])
    assert type(ours) is type(theirs)
    assert repr(ours) == repr(theirs)
    if isinstance(theirs, collections.defaultdict):
        assert ours.default_factory is theirs.default_factory


def test_empty_like_batch_refuses_a_frozen_dataclass() -> None:
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor

    with pytest.raises(ValueError, match="frozen"):
        empty_like_batch(Frozen(torch.zeros(2)))
