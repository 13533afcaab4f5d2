"""Moved to :mod:`dplightning.tasks._hf_module` (issue 26: LightningModules are in tasks/); still importable.

The names come from :mod:`dplightning.tasks`, which makes them public, so that this old path imports no private
module of another package.
"""

from dplightning.tasks import CLASS_KEY, CONFIG_KEY, TOKENIZER_KEY, HFModule

__all__ = ["CLASS_KEY", "CONFIG_KEY", "TOKENIZER_KEY", "HFModule"]
