"""The neighbouring-data sensitivity harness over the feature matrix (``tests/sensitivity.py``).

A pairwise cover of the matrix runs in ``make test`` (its two-process cells are marked
``multiprocess``); seeded random draws over the one-process part of the matrix are marked
slow. Each cell either is refused before its first release on both D and
D′, or releases within what the ledger charges, with the same decisions on both.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest

from tests.sensitivity import FACTORS, cells, measure, pairwise_cover, random_cells

COVER = pairwise_cover(FACTORS)


def test_the_cover_holds_every_pair_of_levels() -> None:
    for a, b in combinations(FACTORS, 2):
        seen = {(row[a], row[b]) for row in COVER}
        assert seen == {(va, vb) for va in FACTORS[a] for vb in FACTORS[b]}, (a, b)


def _check(cell: dict[str, Any]) -> None:
    measured = measure(cell)
    assert measured.within, measured
    if measured.refusal is None:
        assert measured.releases > 0 and measured.touched > 0, f"the canary never took part: {measured}"


@pytest.mark.parametrize("cell", list(cells(COVER)))
def test_pairwise_cover(cell: dict[str, Any]) -> None:
    _check(cell)


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(cells(random_cells({**FACTORS, "processes": [1]}, 60, seed=2026))))
def test_random_draws(cell: dict[str, Any]) -> None:
    _check(cell)
