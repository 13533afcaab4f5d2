"""Pytest configuration shared by all tests.

Markers (registered in pyproject.toml): ``multiprocess``, ``crash``, ``e2e`` and ``slow`` mark the
tests that ``make test-fast`` leaves out; each is put on its tests explicitly, none by a rule here.
"""

import os
import warnings

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two xdist workers on two cores: one thread each, and in the processes they start
    # (spawned ranks, CLI runs), instead of two threads per worker fighting over the same two cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
