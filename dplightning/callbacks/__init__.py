"""Callbacks that plug into any Lightning project (installed as ``dplightning.callbacks``).

Each callback states whether what it logs is **private** (derived only from public
accounting values or released with its own accounted noise) or **nonprivate** (computed
from raw per-example norms of the training data: logged under ``nonprivate/``, never to be
released with the model). They read the strategy's DP state (``strategy.dp_state``, see
:mod:`dplightning.strategies.state`) through the small interfaces of :mod:`dplightning.protocols`,
never through concrete strategy classes.

Importing this package imports ``dplightning``, which registers ``strategy="dp"``.
"""

from dplightning.callbacks.adaln_bind import AdaLNBindFractions
from dplightning.callbacks.clipping_histogram import ClippingHistogram
from dplightning.callbacks.privacy_budget import PrivacyBudget
from dplightning.callbacks.private_clip_fraction import PrivateClipFraction
from dplightning.callbacks.tail_stats import GradientTailStats
from dplightning.protocols import AccountingSource, NormSource, RegistersStepReleases, StepReleaseSource

__all__ = [
    "AccountingSource",
    "AdaLNBindFractions",
    "ClippingHistogram",
    "GradientTailStats",
    "NormSource",
    "PrivacyBudget",
    "PrivateClipFraction",
    "RegistersStepReleases",
    "StepReleaseSource",
]
