"""Moved to :mod:`dplightning.evaluation.synthetic` (issue 26); this path stays importable and runnable.

``python -m dplightning.metrics.synthetic ...`` still runs the evaluation.
"""

from dplightning.evaluation.synthetic import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EVALUATIONS,
    DEFAULT_HOLDOUT,
    DEFAULT_LR,
    DEFAULT_STEPS,
    FID_INCEPTION,
    FID_LOCAL,
    LEGACY_LR,
    FitResult,
    LocalFeatures,
    Protocol,
    accuracy,
    balanced_draw,
    downstream_accuracy,
    evaluate,
    fit_classifier,
    fits_in,
    frechet_distance,
    inception_features,
    load_real,
    main,
    mnist_cnn,
    real_data_ceiling,
    stratified_holdout,
    train_classifier,
)

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_EVALUATIONS",
    "DEFAULT_HOLDOUT",
    "DEFAULT_LR",
    "DEFAULT_STEPS",
    "FID_INCEPTION",
    "FID_LOCAL",
    "LEGACY_LR",
    "FitResult",
    "LocalFeatures",
    "Protocol",
    "accuracy",
    "balanced_draw",
    "downstream_accuracy",
    "evaluate",
    "fit_classifier",
    "fits_in",
    "frechet_distance",
    "inception_features",
    "load_real",
    "main",
    "mnist_cnn",
    "real_data_ceiling",
    "stratified_holdout",
    "train_classifier",
]

if __name__ == "__main__":
    main()
