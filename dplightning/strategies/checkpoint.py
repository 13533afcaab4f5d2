"""Atomic checkpoint files: a kill at any point leaves either the old file or the new one, whole.

Lightning writes a local checkpoint through fsspec, which stages it in the system temp
folder and moves it into place: across filesystems (``/tmp`` on tmpfs, checkpoints on a
disk) that move is a copy, so a kill during it leaves a truncated file under the final
name, and nothing is fsynced. A truncated ``last.ckpt`` cannot be resumed from, and one
that loads but is stale is worse. :func:`atomic_save` writes next to the target and
renames, which POSIX makes atomic within one filesystem.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def is_local_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a local file path (no ``scheme://`` prefix)."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` via a temporary file in ``path``'s folder, fsync and ``os.replace``."""
    target = Path(os.fspath(path).removeprefix("file://"))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; keep the permissions a plain open() would give
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not possible on every platform)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
