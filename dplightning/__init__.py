"""dplightning: differentially private training for any LightningModule.

Importing the package registers the strategy names ``"dp"``, ``"dp_ddp"`` and
``"dp_ddp_spawn"`` with Lightning, so ``Trainer(strategy="dp")`` and ``LightningCLI``
configs can refer to them. A ``pytorch_lightning`` Trainer (the old package name) is given
the same names as clear refusals (:mod:`dplightning._pytorch_lightning`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from dplightning._quiet_imports import opacus_without_root_logging

opacus_without_root_logging()  # before anything below imports Opacus

from dplightning._pytorch_lightning import register_refusals  # noqa: E402
from dplightning.strategies import DPDDPStrategy, DPStrategy  # noqa: E402

__version__ = "0.1.0"

for _strategy in (DPStrategy, DPDDPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        _strategy.register_strategies(StrategyRegistry)
register_refusals(
    [name for name, entry in StrategyRegistry.items() if entry["strategy"] in (DPStrategy, DPDDPStrategy)],
    (DPStrategy, DPDDPStrategy),
)

__all__ = ["DPDDPStrategy", "DPStrategy", "__version__"]
