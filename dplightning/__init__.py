"""dplightning: differentially private training for any LightningModule.

Importing the package registers the strategy names ``"dp"``, ``"dp_ddp"`` and
``"dp_ddp_spawn"`` with Lightning, so ``Trainer(strategy="dp")`` and ``LightningCLI``
configs can refer to them.
"""

from lightning.pytorch.strategies import StrategyRegistry

from dplightning.strategies import DPDDPStrategy, DPStrategy

__version__ = "0.1.0"

for _strategy in (DPStrategy, DPDDPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        _strategy.register_strategies(StrategyRegistry)

__all__ = ["DPDDPStrategy", "DPStrategy", "__version__"]
