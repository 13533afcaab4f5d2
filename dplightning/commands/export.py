"""``dplightning export``: a trained checkpoint as Hugging Face folders carrying the run's (ε, δ).

dplightning export --ckpt lightning_logs/version_0/checkpoints/last.ckpt --out exported/

writes, for a LoRA run, ``adapter/`` (a peft adapter folder) and ``merged/`` (the base
model with the adapters merged in), and for full fine-tuning ``model/``; each folder has
the tokenizer, ``privacy.json`` and a model card (``README.md``) stating the guarantee.
The guarantee is recomputed from the checkpoint's privacy ledger, never copied from logs,
after checking the ledger against the checkpoint's σ, q and global_step; ``privacy.json``
and the card also state the privacy unit, what the data computed from the private training
split outside the DP steps (``not_covered``: e.g. a tokenizer fitted on it) and whether a
test seed was used. The checkpoint is loaded with ``torch.load(weights_only=True)``, which
never runs code from the file: one that pickles other objects than tensors, plain containers
and the few dplightning records of :data:`SAFE_GLOBALS` is refused (``--trust-checkpoint``
loads your own such files). The module class and a config's ``class_path`` are data too: only
dplightning's task classes and ``transformers`` config classes are built. Exit status: 0, 2 without a
privacy ledger or not a task checkpoint, 3 if the ledger
contradicts the checkpoint or the record lacks a field it needs, 4 if the file would run code
when loaded.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import torch

from dplightning.models.hf import LoraSettings
from dplightning.privacy.accounting import compute_epsilon
from dplightning.privacy.provenance import describe_privacy_unit
from dplightning.privacy.record import IncompletePrivacyRecord, NoPrivacyRecord, PrivacyRecord
from dplightning.strategies.accounting import SEEDED_RISK, InconsistentLedger, check_ledger, mechanism_of
from dplightning.strategies.correlated import NoiseMechanism
from dplightning.tasks import CLASS_KEY, CONFIG_KEY, HFModule

SAFE_GLOBALS: list[type] = [LoraSettings]
"""Classes a dplightning checkpoint may pickle besides tensors and plain containers (the LoRA settings
among a module's hyperparameters); the privacy record itself holds plain values only."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint that pickles objects whose loading could run code from the file."""


def load_checkpoint(path: str | Path, trust: bool = False) -> dict[str, Any]:
    """Load a checkpoint on the CPU without running code from it, unless ``trust``.

    ``torch.load(weights_only=True)`` rebuilds tensors, plain containers and :data:`SAFE_GLOBALS`
    only; a full unpickle (``weights_only=False``) would execute whatever the file's pickle calls.

    Raises:
        UnsafeCheckpoint: If the file pickles other objects and ``trust`` is False.
    """
    if trust:
        return torch.load(str(path), map_location="cpu", weights_only=False)  # the caller vouches for the file
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpoint(
            "refused to load the checkpoint: it pickles objects other than tensors and plain containers "
            f"({_unsafe_globals(path, err)}), and loading them would run code from the file. Open only a checkpoint "
            "you wrote yourself with --trust-checkpoint (a dplightning privacy record needs only plain values)."
        ) from err


def _unsafe_globals(path: str | Path, err: Exception) -> str:
    """The names of what the file pickles beyond :data:`SAFE_GLOBALS` (read without unpickling)."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS}
    try:
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) if n not in allowed]
    except Exception:  # not a zip checkpoint: fall back to the name torch's error gives
        names = re.findall(r"GLOBAL ([\w.]+)", str(err))[:1]
    return ", ".join(names) or "an unsupported pickle opcode"


def privacy_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The (ε, δ) guarantee, mechanism and provenance of a checkpoint, from its privacy ledger.

    Raises:
        NoPrivacyRecord: If the checkpoint has no privacy ledger (it was not trained with DP).
        IncompletePrivacyRecord: If its privacy record lacks a field the guarantee depends on.
        InconsistentLedger: If the ledger contradicts the checkpoint's record (its σ, q or
            global_step): ε computed from it would not describe the run.
    """
    record = _record_of(checkpoint)
    check_ledger(record, checkpoint.get("global_step"))
    if record.delta is None:
        raise IncompletePrivacyRecord("The checkpoint's privacy record has no δ (written before N was known).")
    delta, steps = float(record.delta), record.steps
    poisson = record.poisson_sampling
    accountant = record.ledger_accountant
    epsilon = compute_epsilon(record.history, delta, accountant) if poisson and steps else math.inf
    unit = record.unit
    return {
        "epsilon": epsilon,
        "noise_mechanism": mechanism_of(record).describe(),
        "delta": delta,
        "accountant": accountant,
        "steps": steps,
        "noise_multiplier": record.noise_multiplier,
        "sample_rate": record.sample_rate,
        "num_samples": record.num_samples,
        "max_grad_norm": record.max_grad_norm,
        "clipping": record.clipping,
        "poisson_sampling": poisson,
        "privacy_unit": describe_privacy_unit(unit),
        "privacy_unit_record": unit,
        "not_covered": dict(record.not_covered),
        "seeded": record.seeded,
        "secure_mode": record.secure_mode,
    }


def _record_of(checkpoint: dict[str, Any]) -> PrivacyRecord:
    try:
        return PrivacyRecord.from_checkpoint(checkpoint)
    except NoPrivacyRecord as err:
        raise NoPrivacyRecord(
            "The checkpoint has no privacy ledger: it was not trained by a dplightning DP strategy, so there is no "
            "guarantee to export. Train with strategy dp / dp_ddp."
        ) from err


def unit_record(state: dict[str, Any]) -> dict[str, Any]:
    """The privacy-unit record of a checkpoint's stored privacy record (see :attr:`PrivacyRecord.unit`)."""
    return PrivacyRecord.from_dict(state).unit


def task_class(name: object) -> type[HFModule]:
    """The dplightning task class a checkpoint names, from the shipped ones only (nothing is imported by name).

    The name is data from the checkpoint: importing a module it names could run code (an
    import has side effects), so it is matched against the task classes that
    :mod:`dplightning.tasks` defines, under their current and their pre-``tasks/`` paths.

    Raises:
        ValueError: If ``name`` is not one of them.
    """
    shipped: dict[str, type[HFModule]] = {}
    stack = list(HFModule.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("dplightning.tasks."):
            path = f"{cls.__module__}.{cls.__qualname__}"
            shipped[path] = shipped[path.replace("dplightning.tasks.", "dplightning.modules.", 1)] = cls
    if not isinstance(name, str) or name not in shipped:
        raise ValueError(
            f"The checkpoint names the module class {name!r}, which is not a dplightning task class "
            f"({', '.join(sorted(p for p in shipped if p.startswith('dplightning.tasks.')))}): export rebuilds only "
            "those, and never imports a class a checkpoint names."
        )
    return shipped[name]


def load_module(checkpoint: dict[str, Any]) -> HFModule:
    """Rebuild the Hugging Face module of ``checkpoint`` from its saved config (no hub, no base download)."""
    if CLASS_KEY not in checkpoint or CONFIG_KEY not in checkpoint:
        raise ValueError("Not a checkpoint of a dplightning Hugging Face module (DPCausalLM, DPSequenceClassifier).")
    cls = task_class(checkpoint[CLASS_KEY])
    accepted = inspect.signature(cls.__init__).parameters
    # Lightning saves the arguments of every __init__ in the class chain; keep those the class takes.
    hparams = {k: v for k, v in checkpoint.get("hyper_parameters", {}).items() if k in accepted}
    hparams.update(pretrained=None, config=checkpoint[CONFIG_KEY], model_kwargs=None)
    module = cls(**hparams)
    module.load_state_dict(checkpoint["state_dict"])
    module.on_load_checkpoint(checkpoint)
    return module


def _card(privacy: dict[str, Any], kind: str, base: str | None, pooling: str | None = None) -> str:
    eps = (
        "∞ (no Poisson sampling: no amplification, no finite guarantee)"
        if math.isinf(privacy["epsilon"])
        else (f"{privacy['epsilon']:.4g}")
    )
    return "\n".join(
        [
            "---",
            "tags: [differential-privacy, dplightning]",
            "---",
            f"# {kind} trained with differential privacy (dplightning)",
            "",
            *([f"**WARNING: {SEEDED_RISK}. Do not release this model as private.**", ""] if privacy["seeded"] else []),
            f"- Guarantee: (ε = {eps}, δ = {privacy['delta']:.3g}), {privacy['accountant']} accountant, "
            f"{_mechanism_text(privacy)} at q = {privacy['sample_rate']}, "
            f"noise multiplier σ = {privacy['noise_multiplier']}, clipping bound C = {privacy['max_grad_norm']} "
            f"({privacy['clipping']} clipping), over N = {privacy['num_samples']} examples.",
            f"- Privacy unit: {privacy['privacy_unit']}.",
            *[
                f"- Not covered, computed from the private training data outside the DP steps: {name}, {text}."
                for name, text in privacy["not_covered"].items()
            ],
            "- Not covered: the pretrained base weights and anything trained or chosen on the private data outside "
            "the DP steps (a tokenizer fit to the private training split, hyperparameter search, metrics logged "
            "under `nonprivate/`).",
            *([f"- Base model: {base}"] if base else []),
            *(
                [
                    f"- Pooling: {pooling} over each example's tokens. `AutoModelForSequenceClassification` applies "
                    "the architecture's own head instead: load with `dplightning.tasks.DPSequenceClassifier("
                    f"pretrained=<this folder>, pooling={pooling!r})`."
                ]
                if pooling
                else []
            ),
            "",
        ]
    )


def _mechanism_text(privacy: dict[str, Any]) -> str:
    """What the ledger's steps are: DP-SGD steps, or a correlated mechanism's compositions."""
    mechanism = privacy.get("noise_mechanism") or NoiseMechanism().describe()
    if mechanism == NoiseMechanism().describe():
        return f"{privacy['steps']} steps of DP-SGD with Poisson sampling"
    return f"{privacy['steps']} accounted composition(s) of {mechanism}"


def _write(model: Any, tokenizer: Any, folder: Path, privacy: dict[str, Any], kind: str, base: str | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    (folder / "privacy.json").write_text(json.dumps(privacy, indent=2, default=str) + "\n", encoding="utf-8")
    pooling = getattr(model.config, "dplightning_pooling", None)
    (folder / "README.md").write_text(_card(privacy, kind, base, pooling), encoding="utf-8")


def export(ckpt: str | Path, out: str | Path, merged: bool = True, trust: bool = False) -> list[Path]:
    """Export ``ckpt`` to Hugging Face folders under ``out``; returns the folders written.

    ``trust``: load the checkpoint with a full unpickle (see :func:`load_checkpoint`).
    """
    checkpoint = load_checkpoint(ckpt, trust)
    privacy = privacy_of(checkpoint)
    module = load_module(checkpoint)
    base = checkpoint.get("hyper_parameters", {}).get("pretrained")
    out = Path(out)
    written: list[Path] = []
    if module.lora is not None:
        _write(module.model, module.tokenizer, out / "adapter", privacy, "LoRA adapter", base)
        written.append(out / "adapter")
        if merged:
            _write(module.model.merge_and_unload(), module.tokenizer, out / "merged", privacy, "Model", base)
            written.append(out / "merged")
    else:
        _write(module.model, module.tokenizer, out / "model", privacy, "Model", base)
        written.append(out / "model")
    return written


TRUST_HELP = (
    "Load the checkpoint with a full unpickle (torch.load weights_only=False), which runs any code the file carries: "
    "only for a checkpoint you wrote yourself that pickles objects beyond tensors and plain containers."
)


def exit_status(err: ValueError) -> int:
    """Exit status of a refused checkpoint: 4 unsafe to load, 3 a contradicting or incomplete record, 2 no ledger."""
    if isinstance(err, UnsafeCheckpoint):
        return 4
    return 3 if isinstance(err, (InconsistentLedger, IncompletePrivacyRecord)) else 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplightning export``."""
    parser = argparse.ArgumentParser(prog="dplightning export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="Checkpoint of a DPCausalLM or DPSequenceClassifier run.")
    parser.add_argument("--out", required=True, help="Folder to write the Hugging Face folders into.")
    parser.add_argument("--no-merged", action="store_true", help="With LoRA, write only the adapter folder.")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    args = parser.parse_args(argv)
    try:
        folders = export(args.ckpt, args.out, merged=not args.no_merged, trust=args.trust_checkpoint)
    except ValueError as err:  # unsafe to load, no ledger, a ledger that contradicts its record, not an HF module
        print(f"{args.ckpt}: {err}", file=sys.stderr)
        return exit_status(err)
    for folder in folders:
        privacy = json.loads((folder / "privacy.json").read_text(encoding="utf-8"))
        print(f"{folder}: ε = {privacy['epsilon']:.4g}, δ = {privacy['delta']:.3g}")
        if privacy["seeded"]:
            print(f"{folder}: WARNING: {SEEDED_RISK}.", file=sys.stderr)
    return 0
