"""DP math without a Trainer: accounting, clipping, noise and the gradient mechanism."""

from dplightning.privacy.accounting import (
    PrivacyLedger,
    available_accountants,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from dplightning.privacy.clipping import ClipGroup, clip_factors, joint_sensitivity, make_clip_groups, register_clipping
from dplightning.privacy.mechanism import GradientPrivatizer, MicroBatchStats
from dplightning.privacy.noise import GaussianNoise

__all__ = [
    "ClipGroup",
    "GaussianNoise",
    "GradientPrivatizer",
    "MicroBatchStats",
    "PrivacyLedger",
    "available_accountants",
    "calibrate_noise_multiplier",
    "clip_factors",
    "compute_epsilon",
    "joint_sensitivity",
    "make_clip_groups",
    "register_clipping",
]
