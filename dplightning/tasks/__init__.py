"""LightningModules shipped with dplightning (they contain no DP code themselves).

:class:`HFModule` (the base of the Hugging Face task modules) and the checkpoint keys it writes are public here, for
``dplightning export``, which rebuilds a module from them.
"""

from dplightning.tasks._hf_module import CLASS_KEY, CONFIG_KEY, TOKENIZER_KEY, HFModule
from dplightning.tasks.causal_lm import DPCausalLM
from dplightning.tasks.classifier import ImageClassifier
from dplightning.tasks.diffusion import DPDiffusion
from dplightning.tasks.sequence_classifier import DPSequenceClassifier
from dplightning.tasks.timeseries_diffusion import DPTimeSeriesDiffusion

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
