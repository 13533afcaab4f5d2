"""Per-example gradients: hooks on the model's own layers and a clipping engine per layer.

:class:`PerExampleHooks` attaches to the user's own modules in place (no wrapper, so
``state_dict`` keys stay unchanged) and hands over, per batch, each privatized
parameter's per-example gradients as a :class:`PerExampleGrad`: formed (``Dense``) or
factored (``Factored``, book-keeping), either way giving norms and weighted sums.
"""

from dplightning.privacy.grad_sample.broadcast import register_broadcast_embedding
from dplightning.privacy.grad_sample.engines import Engine, available_engines, make_engine, register_engine
from dplightning.privacy.grad_sample.grads import Dense, Factored, PerExampleGrad, Summed
from dplightning.privacy.grad_sample.hooks import PerExampleHooks
from dplightning.privacy.grad_sample.samplers import register_batch_major_container
from dplightning.privacy.grad_sample.transforms import Projection, SlotTransform

GRAD_SAMPLE_MODES = {
    "hooks": "registered per-layer samplers and engines only; any other trainable layer is an error",
    "functorch": "torch.func for layers no sampler or engine handles",
}

__all__ = [
    "GRAD_SAMPLE_MODES",
    "Dense",
    "Engine",
    "Factored",
    "PerExampleGrad",
    "PerExampleHooks",
    "Projection",
    "SlotTransform",
    "Summed",
    "available_engines",
    "make_engine",
    "register_batch_major_container",
    "register_broadcast_embedding",
    "register_engine",
]
