"""The ``dplightning`` command: LightningCLI with the DP strategies registered.

dplightning fit --config configs/quickstart.yaml
dplightning fit --config configs/quickstart.yaml --trainer.strategy.init_args.target_epsilon 1
dplightning fit --trainer.strategy.help dplightning.DPStrategy    # the DP arguments
dplightning export --ckpt run.ckpt --out exported/                 # Hugging Face folders with (ε, δ)
dplightning memory-plan --config configs/finetune/opt-6.7b_lora.yaml --gpu-memory 80GB
dplightning privacy-report run.ckpt [--json]                       # the checkpoint's privacy claim, recomputed
dplightning audit --help                                           # empirical ε lower bound from canaries
"""

from __future__ import annotations

import math
import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import dplightning  # noqa: F401  (registers the strategy names before parsing)
from dplightning.protocols import AccountingSource


class DPLightningCLI(LightningCLI):
    """LightningCLI that can test after fit and reports the final (ε, δ)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=False, help="Run the test loop with the fitted weights after fit."
        )

    def after_fit(self) -> None:
        if self.config.get(self.subcommand, {}).get("test_after_fit"):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=True)
        strategy = self.trainer.strategy
        if isinstance(strategy, AccountingSource) and strategy.steps:
            eps = strategy.get_epsilon()
            shown = "inf (no Poisson sampling)" if math.isinf(eps) else f"{eps:.4g}"
            rank_zero_info(
                f"Final privacy guarantee: (ε = {shown}, δ = {strategy.delta:.3g}) after {strategy.steps} steps."
            )


def build_cli(args: list[str] | None = None, run: bool = True) -> DPLightningCLI:
    """Parse ``args`` (default: ``sys.argv``) and run the subcommand; return the CLI object.

    With ``run=False`` the args have no subcommand: the model, data and trainer are only built
    (for scripts that drive the loop themselves), and no config file is saved.
    """
    saving: dict[str, Any] = {"save_config_kwargs": {"overwrite": True}} if run else {"save_config_callback": None}
    return DPLightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        **saving,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``dplightning`` console script (and ``python -m dplightning.cli``).

    ``export``, ``memory-plan``, ``privacy-report`` and ``audit`` are commands of their own; everything
    else is LightningCLI's.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "export":
        from dplightning.export import main as export_main

        sys.exit(export_main(argv[1:]))
    if argv and argv[0] == "memory-plan":
        from dplightning.planning.memory import main as plan_main

        sys.exit(plan_main(argv[1:]))
    if argv and argv[0] == "privacy-report":
        from dplightning.report import main as report_main

        sys.exit(report_main(argv[1:]))
    if argv and argv[0] == "audit":
        from dplightning.audit import main as audit_main

        sys.exit(audit_main(argv[1:]))
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "dplightning also has: export --ckpt CKPT --out DIR (Hugging Face folders with the run's (ε, δ)) and "
            "memory-plan --config CONFIG [--gpu-memory 80GB] (per-GPU memory of a DP step), privacy-report CKPT "
            "[--json] (the checkpoint's privacy claim, ε recomputed) and audit (an empirical lower bound on ε).\n"
        )
    build_cli(args)


if __name__ == "__main__":
    main()
