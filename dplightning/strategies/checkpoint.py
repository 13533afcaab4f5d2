"""The DP strategies' checkpoint I/O: the privacy record in every checkpoint, local files written atomically.

:class:`DPCheckpointIO` is the Lightning ``CheckpointIO`` plugin the DP strategies hold
(``strategy.checkpoint_io``), around Lightning's default :class:`TorchCheckpointIO` or the
plugin the user gave. Before each write it stores the run's privacy record
(:class:`~dplightning.privacy.record.PrivacyRecord`) in the checkpoint.

Atomic writes: Lightning writes a local checkpoint through fsspec, which stages it in the
system temp folder and moves it into place: across filesystems (``/tmp`` on tmpfs,
checkpoints on a disk) that move is a copy, so a kill during it leaves a truncated file
under the final name, and nothing is fsynced. A truncated ``last.ckpt`` cannot be resumed
from, and one that loads but is stale is worse. :func:`atomic_save` writes next to the
target and renames, which POSIX makes atomic within one filesystem; the plugin uses it for
local paths when it wraps Lightning's own ``TorchCheckpointIO`` (any other plugin, remote
paths and ``storage_options`` are left to the wrapped plugin).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from dplightning.privacy.record import PrivacyRecord


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


class DPCheckpointIO(CheckpointIO):
    """Writes the privacy record into every checkpoint, and local files atomically.

    Args:
        record: Returns the run's privacy record at the time of a write.
        checkpoint_io: The plugin that writes, reads and removes files (default: Lightning's
            ``TorchCheckpointIO``, whose local writes are replaced by :func:`atomic_save`).
    """

    def __init__(self, record: Callable[[], PrivacyRecord], checkpoint_io: CheckpointIO | None = None) -> None:
        self.record = record
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()

    def writes_atomically(self, path: _PATH, storage_options: Any | None = None) -> bool:
        """Whether a write to ``path`` goes through :func:`atomic_save` (else through the wrapped plugin)."""
        # Exactly Lightning's plugin: a subclass or another plugin may write in its own way.
        plain = type(self.checkpoint_io) is TorchCheckpointIO
        return plain and storage_options is None and is_local_path(path)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        self.record().store_in(checkpoint)
        if self.writes_atomically(path, storage_options):
            atomic_save(checkpoint, path)
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        given = {} if map_location is None else {"map_location": map_location}  # else the wrapped plugin's default
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only, **given)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        self.checkpoint_io.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.checkpoint_io.teardown()
