"""Per-example gradient backends, chosen by name with ``grad_sample_mode=``.

A backend attaches to the user's own modules in place (no wrapper, so ``state_dict``
keys stay unchanged) and hands the strategy the per-example gradients of each
backward pass. Ghost-norm and book-keeping backends register here later.
"""

from dplightning.privacy.grad_sample import hooks as _hooks  # noqa: F401  (registers "hooks", "functorch")
from dplightning.privacy.grad_sample.backend import (
    GradSampleBackend,
    available_grad_sample_modes,
    make_grad_sample_backend,
    register_grad_sample_backend,
)

__all__ = [
    "GradSampleBackend",
    "available_grad_sample_modes",
    "make_grad_sample_backend",
    "register_grad_sample_backend",
]
