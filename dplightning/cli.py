"""The ``dplightning`` command: LightningCLI with the DP strategies registered.

dplightning fit --config configs/quickstart.yaml
dplightning fit --config configs/quickstart.yaml --trainer.strategy.init_args.target_epsilon 1
dplightning fit --trainer.strategy.help dplightning.DPStrategy    # the DP arguments
dplightning export --ckpt run.ckpt --out exported/                 # Hugging Face folders with (ε, δ)
dplightning memory-plan --config configs/finetune/opt-6.7b_lora.yaml --gpu-memory 80GB
dplightning privacy-report run.ckpt [--json]                       # the checkpoint's privacy claim, recomputed
dplightning audit --help                                           # empirical ε lower bound from canaries
dplightning calibrate --target-epsilon 3 --sample-rate 0.2 --steps 200 --delta 1e-5   # σ without training

A configuration error raised by dplightning's own checks (a ValueError or TypeError raised in
dplightning's code) is printed as one line and the command exits with status 2; ``--traceback``
anywhere on the command line, or ``DPLIGHTNING_TRACEBACK=1``, shows the full traceback instead.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import dplightning  # noqa: F401  (registers the strategy names before parsing)
from dplightning import configs
from dplightning.protocols import AccountingSource, dp_state_of


class DPLightningCLI(LightningCLI):
    """LightningCLI that can test after fit and reports the final (ε, δ)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=False, help="Run the test loop with the fitted weights after fit."
        )

    def after_fit(self) -> None:
        if self.config.get(self.subcommand, {}).get("test_after_fit"):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=True)
        state = dp_state_of(self.trainer.strategy)
        if isinstance(state, AccountingSource) and state.steps:
            eps = state.get_epsilon()
            shown = "inf (no Poisson sampling)" if math.isinf(eps) else f"{eps:.4g}"
            rank_zero_info(f"Final privacy guarantee: (ε = {shown}, δ = {state.delta:.3g}) after {state.steps} steps.")


def build_cli(args: list[str] | None = None, run: bool = True) -> DPLightningCLI:
    """Parse ``args`` (default: ``sys.argv``) and run the subcommand; return the CLI object.

    With ``run=False`` the args have no subcommand: the model, data and trainer are only built
    (for scripts that drive the loop themselves), and no config file is saved.
    """
    _quiet_lightning_pytree()
    saving: dict[str, Any] = {"save_config_kwargs": {"overwrite": True}} if run else {"save_config_callback": None}
    return DPLightningCLI(
        LightningModule,
        None,  # --data is optional (any LightningDataModule): a module may bring its own dataloaders
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        **saving,
    )


def _quiet_lightning_pytree() -> None:
    """Silence one known deprecation warning, only where it arises.

    Lightning 2.6's ``utilities/_pytree.py`` builds torch's ``LeafSpec``, which torch ≥ 2.10
    deprecates with a FutureWarning printed on every fit. It says nothing about the user's code
    and has no fix on this side, so it is filtered by its message and its issuing module only.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


COMMANDS: dict[str, str] = {
    "export": "dplightning.commands.export",
    "memory-plan": "dplightning.commands.memory_plan",
    "privacy-report": "dplightning.commands.report",
    "audit": "dplightning.commands.audit",
    "calibrate": "dplightning.commands.calibrate",
    "configs": "dplightning.commands.configs",
}
"""Commands of their own (module with a ``main(argv) -> int``); everything else is LightningCLI's."""

TRACEBACK_FLAG, TRACEBACK_ENV = "--traceback", "DPLIGHTNING_TRACEBACK"
EXTRAS = {"transformers": "hf", "peft": "hf", "tokenizers": "hf", "huggingface_hub": "hf", "matplotlib": "plots"}
"""Packages of the optional extras (pyproject.toml) -> the extra that installs them."""
_PACKAGE_DIR = Path(__file__).resolve().parent


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``dplightning`` console script (and ``python -m dplightning.cli``).

    ``export``, ``memory-plan``, ``privacy-report``, ``audit`` and ``calibrate`` are commands of
    their own; everything else is LightningCLI's. A dplightning configuration error ends the
    command with one line on stderr and exit status 2 (see the module docstring).
    """
    argv = sys.argv[1:] if args is None else list(args)
    _quiet_adverts()
    full_traceback = TRACEBACK_FLAG in argv or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
    argv = _shipped_configs([arg for arg in argv if arg != TRACEBACK_FLAG])
    if args is None:
        sys.argv[1:] = argv  # LightningCLI reads sys.argv itself (and warns if given both)
    try:
        _dispatch(argv, None if args is None else argv)
    except (ValueError, TypeError, ModuleNotFoundError) as err:
        if full_traceback:
            raise
        if missing := _missing_extra(err):
            _exit_with_one_line(missing)
        if isinstance(err, ModuleNotFoundError) or not raised_by_dplightning(err):
            raise
        _exit_with_one_line(err)


class _NoAdverts(logging.Filter):
    """Drops Lightning's advertisement lines (a "💡 Tip:" for a cloud product) from the command's output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def _quiet_adverts() -> None:
    """The command, not the library: importing dplightning leaves the user's logging as it was."""
    for name in ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoAdverts) for f in logger.filters):
            logger.addFilter(_NoAdverts())


def _shipped_configs(argv: list[str]) -> list[str]:
    """``--config NAME`` of a shipped config (``dplightning configs``) -> its path, where no such file exists here."""
    out = list(argv)
    if out and out[0] in COMMANDS and out[0] != "memory-plan":
        return out
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag in ("--config", "-c") and eq:
            out[i] = f"{flag}={_config_path(value)}"
        elif arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _config_path(out[i + 1])
    return out


def _config_path(value: str) -> str:
    if Path(value).exists() or any(c in value for c in "{}:\n"):  # a file here, or YAML given inline
        return value
    shipped = configs.find(value)
    if shipped is None:
        _exit_with_one_line(
            f"no config file {value!r} here, and no shipped config of that name (`dplightning configs`)"
        )
    return str(shipped)


def _missing_extra(err: BaseException) -> str | None:
    """The one-line advice for a package of an optional extra missing anywhere in ``err``'s chain.

    jsonargparse reports a class that failed to build as a ValueError, with the ImportError as
    its cause, so the whole chain is searched.
    """
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ModuleNotFoundError) and (extra := EXTRAS.get((cause.name or "").split(".")[0])):
            return f"{cause.name} is not installed; this needs the {extra} extra: pip install 'dplightning[{extra}]'"
        cause = cause.__cause__ or cause.__context__
    return None


def _dispatch(argv: list[str], cli_args: list[str] | None) -> None:
    if argv and argv[0] in COMMANDS:
        command: Callable[[list[str]], int] = importlib.import_module(COMMANDS[argv[0]]).main
        sys.exit(command(argv[1:]))
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "dplightning also has: export --ckpt CKPT --out DIR (Hugging Face folders with the run's (ε, δ)), "
            "memory-plan --config CONFIG [--gpu-memory 80GB] (per-GPU memory of a DP step), privacy-report CKPT "
            "[--json] (the checkpoint's privacy claim, ε recomputed), audit (an empirical lower bound on ε) and "
            "calibrate --target-epsilon E --sample-rate q --steps T (σ for a target ε, without training) and configs "
            "(the shipped configs: --config NAME reads one from any folder, e.g. --config quickstart). "
            f"{TRACEBACK_FLAG} (or {TRACEBACK_ENV}=1) shows the full traceback of a configuration error.\n"
        )
    build_cli(cli_args)


def raised_by_dplightning(err: BaseException) -> bool:
    """Whether ``err`` was raised in dplightning's own code (a check of ours, not a failure inside a library)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


def _exit_with_one_line(err: BaseException | str) -> NoReturn:
    print(f"dplightning: error: {err} ({TRACEBACK_FLAG} for the full traceback)", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
