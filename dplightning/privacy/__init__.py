"""DP math without a Trainer: accounting, clipping, noise and the gradient mechanism."""

from dplightning.privacy.accounting import (
    PrivacyLedger,
    available_accountants,
    calibrate_noise_multiplier,
    combined_noise_multiplier,
    compute_epsilon,
    split_noise_multiplier,
    steps_within_budget,
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
    "combined_noise_multiplier",
    "compute_epsilon",
    "joint_sensitivity",
    "make_clip_groups",
    "register_clipping",
    "split_noise_multiplier",
    "steps_within_budget",
]
