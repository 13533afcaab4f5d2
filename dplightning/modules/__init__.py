"""Renamed :mod:`dplightning.tasks` (issue 26: ``tasks/`` holds the LightningModules, ``models/`` the nn.Modules).

Every old path still imports and gives the same objects: ``dplightning.modules.ImageClassifier``,
``dplightning.modules.classifier.ImageClassifier``, a config's ``class_path`` and a checkpoint's stored class path
(``dplightning export`` imports it by name). Like the other moved paths of issue 26, they do not warn.
"""

from dplightning.tasks import (
    CLASS_KEY,
    CONFIG_KEY,
    TOKENIZER_KEY,
    DPCausalLM,
    DPDiffusion,
    DPSequenceClassifier,
    DPTimeSeriesDiffusion,
    HFModule,
    ImageClassifier,
)

__all__ = [
    "CLASS_KEY",
    "CONFIG_KEY",
    "TOKENIZER_KEY",
    "DPCausalLM",
    "DPDiffusion",
    "DPSequenceClassifier",
    "DPTimeSeriesDiffusion",
    "HFModule",
    "ImageClassifier",
]
