"""Importing dplightning leaves the user's logging as it was (Opacus configures the root logger at import)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_importing_dplightning_does_not_configure_the_root_logger() -> None:
    code = (
        "import logging, dplightning; root = logging.getLogger(); "
        "print(len(root.handlers), root.level); logging.getLogger('user').warning('plain')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["0", str(30)]  # no handler, WARNING: Python's defaults
    assert done.stderr.strip().endswith("plain") and ":WARNING:" not in done.stderr  # no Opacus format
