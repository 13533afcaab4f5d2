"""A durable journal of released steps, so that a crash cannot hide a release from the ledger.

Without it, the ledger a run resumes from is the one in its last checkpoint: it covers every
update whose weights a checkpoint holds. A run that also releases something computed from
the weights between two checkpoints (validation metrics sent to a logger, an exported
model) and is then killed would resume with a ledger that misses the steps behind that
release. With ``privacy_journal=FOLDER`` the strategy appends one fsynced line per noisy
step to ``FOLDER/<run id>.jsonl`` at the release, before the update is applied; on resume,
the steps the journal holds beyond the checkpoint's ledger were released by the killed
attempt and are charged too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class PrivacyJournal:
    """Append-only record of (step, σ, q) of one run, one JSON line per noisy step.

    Args:
        folder: Folder of the journal files.
        run_id: Identifier of the run (kept in its checkpoints).
    """

    def __init__(self, folder: str | os.PathLike[str], run_id: str) -> None:
        self.path = Path(folder) / f"{run_id}.jsonl"

    def append(self, step: int, noise_multiplier: float, sample_rate: float) -> None:
        """Record noisy step ``step`` (1-based) durably: written, flushed and fsynced before returning."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": step, "sigma": noise_multiplier, "q": sample_rate})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def released_after(self, steps: int) -> list[tuple[float, float]]:
        """(σ, q) of the recorded steps numbered above ``steps``, in order (a torn last line is skipped).

        A line cut short by a kill belongs to a step whose update was never applied: the kill
        came before the fsync returned, so nothing computed from that update existed yet.
        """
        if not self.path.exists():
            return []
        released: dict[int, tuple[float, float]] = {}
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry["step"] > steps:
                released[int(entry["step"])] = (float(entry["sigma"]), float(entry["q"]))
        return [released[s] for s in sorted(released)]
