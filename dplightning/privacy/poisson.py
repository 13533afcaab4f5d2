"""Poisson sampling for train loaders: a batch sampler and an empty-safe collate (no Lightning import).

Each process owns the disjoint shard ``arange(N)[rank::W]`` and includes each of its
examples independently with probability q, so the union over ranks is one Poisson(q)
sample of the whole set. An epoch is ⌈1/q⌉ logical steps, each split into exactly
``micro_batches`` (Lightning's ``accumulate_grad_batches``) physical batches, empty ones
included: every rank yields the same number of batches, so no rank waits for another.
:class:`CyclicPoissonBatchSampler` samples one of several fixed partitions per step
(correlated-noise mechanisms, ``dplightning/strategies/correlated.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import secrets
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from dplightning.privacy.noise import csprng_uniform, derive_seed

_ACCEPTED_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps per epoch, ⌈1/q⌉ (the expected number of batches covering N)."""
    return math.ceil(1.0 / sample_rate - 1e-9)


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields Poisson-sampled index lists, ``micro_batches`` per logical step.

    Args:
        num_samples: Size N of the whole training set.
        sample_rate: Inclusion probability q of every example.
        micro_batches: Physical batches per logical step (a split of one Poisson batch).
        rank: This process' rank; it samples the shard ``arange(N)[rank::world_size]``.
        world_size: Number of processes.
        seed: FOR TESTS ONLY; ``None`` seeds each epoch from OS entropy.
        secure_mode: Draw inclusion decisions from the OS CSPRNG.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        micro_batches: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int | None = None,
        secure_mode: bool = False,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("Poisson sampling needs a non-empty dataset.")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}.")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}.")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.micro_batches = micro_batches
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.secure_mode = secure_mode
        self.steps_per_epoch = steps_per_epoch(sample_rate)
        self.shard = torch.arange(rank, num_samples, world_size)
        self.epoch = 0
        self._iterations = 0
        self.scheduled: deque[tuple[int | None, list[int]]] = deque()
        """Each yielded batch not yet taken, oldest first, as (its release index under cyclic sampling, else
        ``None``; its data set indices); cleared when an iteration begins."""

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of each epoch."""
        self.epoch = epoch

    def _uniforms(self, count: int, generator: torch.Generator) -> Tensor:
        """``count`` uniforms in (0, 1], float64, from the generator or the OS CSPRNG."""
        if self.secure_mode:
            return torch.from_numpy(csprng_uniform(count))
        return 1.0 - torch.rand(count, generator=generator, dtype=torch.float64)

    def _sample(self, generator: torch.Generator, size: int | None = None) -> Tensor:
        """Positions of one Poisson(q) sample of ``size`` items (default: the shard), in O(qN) work instead of O(N).

        The gaps between consecutive included positions of a Bernoulli(q) sequence are
        independent Geometric(q) variables, drawn by inversion: ceil(ln U / ln(1 - q)).
        """
        size, q = len(self.shard) if size is None else size, self.sample_rate
        if q >= 1.0:
            return torch.arange(size)
        expected = size * q
        chunk = int(expected + 6 * math.sqrt(expected) + 16)
        log_keep = math.log1p(-q)
        positions: list[Tensor] = []
        last = -1
        while last < size:
            gaps = torch.ceil(torch.log(self._uniforms(chunk, generator)) / log_keep).clamp_(min=1).long()
            drawn = last + torch.cumsum(gaps, 0)
            positions.append(drawn)
            last = int(drawn[-1])
        chosen = torch.cat(positions)
        return chosen[chosen < size]

    def __iter__(self) -> Iterator[list[int]]:
        self._iterations += 1
        seed = (
            secrets.randbits(63)
            if self.seed is None
            else derive_seed(self.seed, "sample", self.rank, self.epoch, self._iterations)
        )
        generator = torch.Generator().manual_seed(seed)
        self.scheduled.clear()  # what the previous iteration yielded ahead was never trained on
        for _ in range(self.steps_per_epoch):
            chosen = self.shard[self._sample(generator)]
            for part in torch.tensor_split(chosen, self.micro_batches):
                indices = part.tolist()
                self.scheduled.append((None, indices))
                yield indices

    def take(self) -> tuple[int | None, list[int]]:
        """The oldest yielded batch not yet taken: (its release index, or ``None``; its data set indices).

        Call once per training batch: the strategy learns which examples a batch holds (the
        coupling probe re-collates one alone) and, under cyclic sampling, which release it was drawn for.

        Raises:
            RuntimeError: If no yielded batch is waiting (a batch that did not come from this sampler).
        """
        if not self.scheduled:
            raise RuntimeError("A training batch arrived that the Poisson sampler did not yield.")
        return self.scheduled.popleft()


def cyclic_partitions(num_samples: int, partitions: int, seed: int) -> list[Tensor]:
    """The data split into ``partitions`` fixed parts: each example's part drawn independently and uniformly.

    Independent draws, not an equal split, keep the privacy unit add-or-remove one example:
    removing an example leaves the others' parts i.i.d. uniform as before, whereas an equal
    split of N - 1 examples is distributed differently from the other N - 1 examples' parts
    in an equal split of N (with N = 2 and two parts, two examples never share a part; alone,
    the remaining one always takes part 0). ``seed`` must stay secret for the same reason: a
    known split keyed by position moves every later example's part when one is removed. The
    split does not depend on the data; part sizes are Binomial(N, 1/partitions), as in
    JAX-Privacy's independent partitions.
    """
    if not 1 <= partitions <= num_samples:
        raise ValueError(f"Need 1 <= partitions <= N, got {partitions} partitions of {num_samples} examples.")
    owner = torch.randint(partitions, (num_samples,), generator=torch.Generator().manual_seed(seed))
    return [torch.nonzero(owner == p).flatten() for p in range(partitions)]


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """Cyclic Poisson sampling: release t Poisson-samples partition t mod ``partitions`` at rate q.

    The data are split into ``partitions`` fixed parts (:func:`cyclic_partitions`); at release
    t of the run every example of part t mod ``partitions`` joins independently with
    probability q (``sample_rate``, the rate *within* a part), the others do not. The position
    in the cycle is global: each iteration (epoch) starts at the run's next release index, read
    from ``position`` when the iteration begins, so an epoch that Lightning ends early (or a
    step that was dropped) does not restart the cycle, and an example participates at most
    once every ``partitions`` releases. Each yielded batch's release index is queued in
    :attr:`scheduled` for the strategy to check against the release it joins. An epoch is
    ``partitions`` x ⌈1/q⌉ steps. Each rank samples its share ``part[rank::world_size]`` of the
    part, so the union over ranks is one Poisson(q) sample of the part.

    Args:
        num_samples: Size N of the whole training set.
        sample_rate: Inclusion probability q within the sampled part.
        partitions: Number of parts (the minimum separation of one example's participations).
        partition_seed: Secret seed of the split; identical on every rank.
        micro_batches: Physical batches per logical step.
        rank: This process' rank.
        world_size: Number of processes.
        seed: FOR TESTS ONLY; ``None`` seeds each epoch from OS entropy.
        secure_mode: Draw inclusion decisions from the OS CSPRNG.
        position: The run's next release index, read when an iteration begins (default: the
            sampler counts the logical steps it yielded, right only if every one is released).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        partitions: int,
        partition_seed: int,
        micro_batches: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int | None = None,
        secure_mode: bool = False,
        position: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(num_samples, sample_rate, micro_batches, rank, world_size, seed, secure_mode)
        self.partitions = partitions
        self.partition_seed = partition_seed
        self.parts = [part[rank::world_size] for part in cyclic_partitions(num_samples, partitions, partition_seed)]
        self.steps_per_epoch = partitions * steps_per_epoch(sample_rate)
        self.position = position
        self._yielded_steps = 0

    def __iter__(self) -> Iterator[list[int]]:
        self._iterations += 1
        seed = (
            secrets.randbits(63)
            if self.seed is None
            else derive_seed(self.seed, "cyclic", self.rank, self.epoch, self._iterations)
        )
        generator = torch.Generator().manual_seed(seed)
        start = self.position() if self.position is not None else self._yielded_steps
        self.scheduled.clear()  # what the previous iteration yielded ahead was never trained on
        for step in range(start, start + self.steps_per_epoch):
            part = self.parts[step % self.partitions]
            chosen = part[self._sample(generator, len(part))]
            self._yielded_steps = step + 1
            for piece in torch.tensor_split(chosen, self.micro_batches):
                indices = piece.tolist()
                self.scheduled.append((step, indices))
                yield indices


class EmptySafeCollate:
    """Wraps a collate function so that an empty index list yields zero-length tensors.

    The empty batch has the structure, dtypes and trailing shapes of ``dataset[0]``
    collated alone (only shapes are used, no values), so models run unchanged.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], dataset: Dataset) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, examples: list[Any]) -> Any:
        if examples:
            return self.collate_fn(examples)
        template = self.collate_fn([self.dataset[0]])
        return empty_like_batch(template)


def empty_like_batch(batch: Any) -> Any:
    """``batch`` with every tensor cut to zero rows, its containers rebuilt as they are.

    The same walk as Lightning's ``apply_to_collection`` (which this module used before it
    moved under :mod:`dplightning.privacy`, where nothing imports Lightning): dataclass
    instances (a copy with each ``init`` field replaced), mappings (a ``defaultdict`` keeps
    its factory), named tuples and other sequences but ``str``; anything else is kept.
    """
    if isinstance(batch, Tensor):
        return batch[:0]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return _empty_like_dataclass(batch)
    if isinstance(batch, Mapping):
        items = OrderedDict((key, empty_like_batch(value)) for key, value in batch.items())
        if isinstance(batch, defaultdict):
            return type(batch)(batch.default_factory, items)
        return type(batch)(items)  # type: ignore[call-arg]  # a Mapping subclass built from its items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(empty_like_batch(value) for value in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)([empty_like_batch(value) for value in batch])  # type: ignore[call-arg]
    return batch


def _empty_like_dataclass(batch: Any) -> Any:
    fields = {field.name: (getattr(batch, field.name), field.init) for field in dataclasses.fields(batch)}
    # The fields' values are not copied: the emptied ones replace them.
    result = copy.deepcopy(batch, memo={id(value): value for value, _ in fields.values()})
    for name, (value, init) in fields.items():
        try:
            setattr(result, name, empty_like_batch(value) if init else value)
        except dataclasses.FrozenInstanceError as error:
            raise ValueError("A frozen dataclass batch cannot be emptied: its fields cannot be set.") from error
    for name, attribute in vars(type(batch)).items():  # a cached property must be computed again
        if isinstance(attribute, functools.cached_property):
            vars(result).pop(name, None)
    return result


class PoissonDataLoader(DataLoader):
    """A ``DataLoader`` with :class:`PoissonBatchSampler` (or, given ``partitions=``,
    :class:`CyclicPoissonBatchSampler`) and :class:`EmptySafeCollate`."""

    batch_sampler: PoissonBatchSampler

    @classmethod
    def from_dataloader(cls, dataloader: DataLoader, sample_rate: float, **sampler_kwargs: Any) -> PoissonDataLoader:
        """Rebuild ``dataloader`` with Poisson sampling, keeping dataset, collate and workers."""
        dataset = dataloader.dataset
        cls_ = CyclicPoissonBatchSampler if "partitions" in sampler_kwargs else PoissonBatchSampler
        sampler = cls_(len(dataset), sample_rate, **sampler_kwargs)  # type: ignore[arg-type]
        return cls(
            dataset,
            batch_sampler=sampler,
            collate_fn=EmptySafeCollate(dataloader.collate_fn, dataset),
            num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory,
            timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn,
            multiprocessing_context=dataloader.multiprocessing_context,
            prefetch_factor=dataloader.prefetch_factor,
            persistent_workers=dataloader.persistent_workers,
        )


def check_poisson_compatible(dataloader: DataLoader) -> None:
    """Raise if replacing the loader's sampler would silently change what the user asked for."""
    if isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(
            "Poisson sampling needs a map-style dataset (with __len__ and __getitem__), not an IterableDataset."
        )
    if dataloader.batch_size is None or type(dataloader.batch_sampler) is not BatchSampler:
        raise ValueError(
            f"The train loader uses a custom batch_sampler ({type(dataloader.batch_sampler).__name__}); DP training "
            "replaces it by Poisson sampling with q = batch_size / N. Pass batch_size= instead, or set "
            "poisson_sampling=False (no ε is then reported)."
        )
    sampler = dataloader.sampler
    if type(sampler) not in _ACCEPTED_SAMPLERS:
        raise ValueError(
            f"The train loader uses a custom sampler ({type(sampler).__name__}), which would break the Poisson "
            "sampling the accountant assumes. Remove it (shuffle=True or False are fine: both are replaced), or "
            "set poisson_sampling=False (no ε is then reported)."
        )


def batch_rows(batch: Any) -> int | None:
    """Leading dimension of the first tensor in ``batch`` (the number of examples); ``None`` if there is none.

    Looks into tensors, mappings, lists, tuples (named ones too) and dataclasses, in order.
    """
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        items: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        return None
    for item in items:
        rows = batch_rows(item)
        if rows is not None:
            return rows
    return None


def loader_batch_size(dataloader: DataLoader) -> int:
    """The train loader's batch size: ``batch_size``, else its batch sampler's ``batch_size``.

    A loader built with ``batch_sampler=`` has ``batch_size=None``; the batch size that sets
    q = batch_size / N (recorded in the ledger even when ε is infinite) and the expected batch
    q·N that the noisy sum is divided by is then the batch sampler's.

    Raises:
        ValueError: If neither gives a positive int: q would be guessed.
    """
    if dataloader.batch_size is not None:
        return dataloader.batch_size
    sampler = dataloader.batch_sampler
    size = getattr(sampler, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"Cannot tell the train loader's batch size: batch_size is None and its batch_sampler "
            f"({type(sampler).__name__}) has no int batch_size attribute (got {size!r}). DP training divides the "
            "noisy gradient sum by the expected batch size and records q = batch_size / N, so it needs one. Give "
            "the batch sampler a `batch_size` attribute (its expected batch size), or pass batch_size= to the "
            "DataLoader instead of batch_sampler=."
        )
    return size
