"""``dplightning privacy-report``: the privacy claim of a checkpoint, recomputed from its ledger.

dplightning privacy-report lightning_logs/version_0/checkpoints/last.ckpt
dplightning privacy-report run.ckpt --json

prints (ε, δ), σ, q, the steps, the accountant, the clipping mode and the engine of every
layer, the data-set size, the privacy unit, what the data computed outside the DP steps,
whether a test seed was used and the library versions the checkpoint was written with. The
ledger is first checked against the checkpoint (at least ``global_step`` steps; its latest
segment at the recorded σ and q); ε is then recomputed from its (σ, q, steps) history with
the installed Opacus accountant and compared with the ε stored when the checkpoint was
written. The exit status is 0 if they match, 1 if they do not, 2 if the file has no privacy
ledger, 3 if the ledger contradicts the checkpoint or the record lacks a field it needs, 4 if
loading the file would run code from it (it is loaded with ``weights_only=True``:
:func:`dplightning.commands.export.load_checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dplightning.commands.export import TRUST_HELP, exit_status, load_checkpoint, privacy_of
from dplightning.privacy.record import PrivacyRecord
from dplightning.strategies.accounting import SEEDED_RISK, library_versions
from dplightning.strategies.correlated import NoiseMechanism

DP_SGD = NoiseMechanism().describe()
"""The mechanism of every run without ``noise_mechanism`` (its report shows no row for it)."""

MATCH_RTOL = 1e-6
"""Relative tolerance between the stored and the recomputed ε (the same accountant gives the same float)."""


def privacy_report(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The privacy claim of a loaded checkpoint, with ε recomputed and checked against the stored one.

    Raises:
        NoPrivacyRecord: If the checkpoint has no privacy ledger.
        IncompletePrivacyRecord: If its privacy record lacks a field the guarantee depends on.
        InconsistentLedger: If the ledger contradicts the checkpoint's σ, q or global_step.
    """
    claim = privacy_of(checkpoint)  # recomputes ε from the ledger, after reading and checking the record
    record = PrivacyRecord.from_checkpoint(checkpoint)
    stored = record.epsilon
    recomputed = claim["epsilon"]
    if stored is None:
        match: bool | None = None  # written before ε was stored: nothing to compare
    elif math.isinf(stored) or math.isinf(recomputed):
        match = stored == recomputed
    else:
        match = math.isclose(stored, recomputed, rel_tol=MATCH_RTOL, abs_tol=1e-12)
    recorded = dict(record.versions)
    now = library_versions()
    return {
        **claim,
        "epsilon_stored": stored,
        "epsilon_matches": match,
        "history": [list(segment) for segment in record.history],
        "target_epsilon": record.target_epsilon,
        "step_releases": dict(record.step_releases),
        "clipping_engine": record.clipping_engine,
        "layer_engines": dict(record.layer_engines),
        "world_size": record.world_size,
        "global_step": checkpoint.get("global_step"),
        "versions": recorded,
        "versions_now": {k: v for k, v in now.items() if recorded.get(k) != v} if recorded else now,
    }


def load_report(path: str | Path, trust: bool = False) -> dict[str, Any]:
    """Load ``path`` on the CPU without running code from it and return its :func:`privacy_report`.

    ``trust``: load with a full unpickle instead (:func:`dplightning.commands.export.load_checkpoint`).
    """
    return privacy_report(load_checkpoint(path, trust))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "∞" if math.isinf(value) else f"{value:.6g}"
    return "-" if value is None else str(value)


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned text lines."""
    seeded = f" (WARNING: {SEEDED_RISK})" if report["seeded"] else ""
    match = {True: "matches", False: "MISMATCH", None: "no stored ε to compare"}[report["epsilon_matches"]]
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items()) or "not recorded"
    changed = ", ".join(f"{k} {v}" for k, v in report["versions_now"].items())
    engines = "; ".join(f"{layer}: {engine}" for layer, engine in report["layer_engines"].items()) or "not recorded"
    rows = [
        ("guarantee", f"(ε = {_fmt(report['epsilon'])}, δ = {report['delta']:.3g})"),
        ("stored ε", f"{_fmt(report['epsilon_stored'])} ({match})"),
        ("target ε", _fmt(report["target_epsilon"])),
        ("accountant", report["accountant"]),
        *([("noise mechanism", report["noise_mechanism"])] if report["noise_mechanism"] != DP_SGD else []),
        ("steps", f"{report['steps']} (global_step {_fmt(report['global_step'])})"),
        ("history (σ, q, steps)", _fmt(report["history"])),
        ("noise multiplier σ", _fmt(report["noise_multiplier"])),
        ("step releases", _fmt(report["step_releases"] or "none")),
        ("sample rate q", _fmt(report["sample_rate"])),
        ("Poisson sampling", _fmt(report["poisson_sampling"])),
        ("data-set size N", _fmt(report["num_samples"])),
        ("privacy unit", report["privacy_unit"]),
        ("not covered", "; ".join(f"{k}: {v}" for k, v in report["not_covered"].items()) or "nothing declared"),
        ("clipping", f"{report['clipping']}, C = {_fmt(report['max_grad_norm'])}"),
        ("clipping engine", f"{_fmt(report['clipping_engine'])} ({engines})"),
        ("world size", _fmt(report["world_size"])),
        ("secure mode / test seed", f"{_fmt(report['secure_mode'])} / {_fmt(report['seeded'])}{seeded}"),
        ("recorded versions", versions),
        ("installed now", changed or "the same"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplightning privacy-report``."""
    parser = argparse.ArgumentParser(prog="dplightning privacy-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="A checkpoint written by a dplightning DP strategy.")
    parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        print(f"dplightning privacy-report: error: no checkpoint file {args.checkpoint!r}", file=sys.stderr)
        return 2
    try:
        report = load_report(args.checkpoint, trust=args.trust_checkpoint)
    except ValueError as err:  # unsafe to load, no ledger, or a ledger that contradicts the checkpoint
        print(f"{args.checkpoint}: {err}")
        return exit_status(err)
    if args.json:
        print(json.dumps(report, indent=2, default=str, allow_nan=True))
    else:
        print(format_report(report))
    return 0 if report["epsilon_matches"] is not False else 1
