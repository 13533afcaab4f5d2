"""Imports of dependencies that change process-wide state, with that state given back.

Opacus calls ``logging.basicConfig`` when :mod:`opacus.utils.module_utils` is imported, which
gives the root logger a handler and a ``MM/DD/YYYY HH:MM:SS:LEVEL:`` format: every log line of
the user's own program would change because they imported dplightning.
"""

from __future__ import annotations

import logging
import sys


def opacus_without_root_logging() -> None:
    """Import Opacus once, then restore the root logger's handlers and level as they were before."""
    if "opacus.utils.module_utils" in sys.modules:
        return  # imported before us: whatever it did is the user's setup now
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import opacus.utils.module_utils  # noqa: F401  (configures the root logger at import)

    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
