"""A clear refusal when a ``pytorch_lightning`` Trainer is given a dplightning strategy.

``lightning`` 2.x installs two copies of the trainer: ``lightning.pytorch`` and the legacy
package ``pytorch_lightning``. Their classes are separate, so a strategy built on
``lightning.pytorch.strategies.Strategy`` (every dplightning strategy) cannot run in a
``pytorch_lightning.Trainer``, whose only answer would be a generic "invalid strategy name".
Importing dplightning therefore also registers its strategy names in ``pytorch_lightning``'s
registry, as entries that raise :func:`old_package_message` (for ``strategy="dp"``) and that
recognise a strategy instance in the Trainer's name check (for ``strategy=DPStrategy(...)``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, NoReturn


def old_package_message(given: str) -> str:
    """Why ``given`` (e.g. ``strategy='dp'``) fails in a ``pytorch_lightning`` Trainer, and the switch that fixes it."""
    return (
        f"{given} is a dplightning strategy, and dplightning works with the unified `lightning` package only: this "
        "Trainer comes from `pytorch_lightning` (the old package name), a separate copy of Lightning whose Trainer "
        "cannot run a `lightning.pytorch` strategy, nor train a `pytorch_lightning.LightningModule` with one. Switch "
        "the project's imports, e.g. `import lightning.pytorch as pl` for `import pytorch_lightning as pl` and "
        "`from lightning.pytorch.callbacks import ...` for `from pytorch_lightning.callbacks import ...` (same API; "
        "`lightning` is installed with dplightning)."
    )


class _RefusingName(str):
    """A registry name whose equality test refuses a dplightning strategy instance.

    ``pytorch_lightning``'s Trainer checks ``strategy in StrategyRegistry.available_strategies()``
    before it rejects an instance of a foreign Strategy class; that membership test compares every
    registered name with the instance, so this name sees the instance and can say what is wrong.
    """

    refused: tuple[type, ...] = ()

    __hash__ = str.__hash__  # a registry key like the plain name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, self.refused):
            raise TypeError(old_package_message(f"strategy={type(other).__name__}(...)"))
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


def _refusal(name: str) -> Any:
    def refuse(**_: Any) -> NoReturn:
        raise TypeError(old_package_message(f"strategy={name!r}"))

    return refuse


def register_refusals(names: list[str], strategies: tuple[type, ...]) -> bool:
    """Register ``names`` in ``pytorch_lightning``'s strategy registry as refusals of ``strategies``.

    Returns:
        False if ``pytorch_lightning`` is not installed (nothing to register).
    """
    if importlib.util.find_spec("pytorch_lightning") is None:
        return False
    # Imported by name: an optional integration (lightning 2.6 installs it), not a dependency of dplightning.
    registry = importlib.import_module("pytorch_lightning.strategies").StrategyRegistry
    for name in names:
        if name not in registry:
            key = _RefusingName(name)
            key.refused = strategies
            registry.register(key, _refusal(name), description="dplightning: see the error")
    return True
