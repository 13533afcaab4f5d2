"""Moved to :mod:`dplightning.privacy.poisson` (issue 26); this name stays importable for existing code."""

from dplightning.privacy.poisson import (
    CyclicPoissonBatchSampler,
    EmptySafeCollate,
    PoissonBatchSampler,
    PoissonDataLoader,
    batch_rows,
    check_poisson_compatible,
    cyclic_partitions,
    empty_like_batch,
    loader_batch_size,
    steps_per_epoch,
)

__all__ = [
    "CyclicPoissonBatchSampler",
    "EmptySafeCollate",
    "PoissonBatchSampler",
    "PoissonDataLoader",
    "batch_rows",
    "check_poisson_compatible",
    "cyclic_partitions",
    "empty_like_batch",
    "loader_batch_size",
    "steps_per_epoch",
]
