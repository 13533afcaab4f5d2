"""The check that every gradient contribution went through the per-example hooks (``verify_gradients``).

A part of :class:`~dplightning.strategies.private_step.PrivateStep`: on the steps it checks,
autograd's own weight gradient is kept, and the sum of the per-example gradients must equal
it. A contribution that bypassed the hooks (a weight used outside its module's forward, a
penalty on a weight in ``training_step``) could not have been clipped per example, so the
run is refused before anything is released.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from dplightning.privacy.grad_sample import PerExampleGrad, SlotTransform
from dplightning.privacy.mechanism import verify_per_example_sum
from dplightning.privacy.release import decision

VERIFIED_STEPS = 2
"""Steps with a non-empty batch that ``verify_gradients="first_steps"`` checks after each (re)planning."""


class GradientVerification:
    """Which steps are checked against autograd, and the check itself.

    ``"first_steps"`` checks the first :data:`VERIFIED_STEPS` steps whose batches had rows,
    counted again from each :meth:`restart` (a new plan of the hooks); ``"always"`` every
    step; ``"never"`` none.

    Args:
        mode: ``verify_gradients``: ``"first_steps"``, ``"always"`` or ``"never"``.
    """

    def __init__(self, mode: str, compute_dtype: torch.dtype | None = None) -> None:
        self.mode = mode
        self.compute_dtype = compute_dtype
        """The precision the backward passes run in (bf16 under ``bf16-mixed``): it sets the tolerance."""
        self._left = 0  # checked steps still to come under "first_steps"
        self._saw_rows = False  # whether the current step checked a batch with rows
        self.restart()

    def restart(self) -> None:
        """Count the checked steps from zero again (the hooks were planned anew)."""
        self._left = VERIFIED_STEPS if self.mode == "first_steps" else 0

    @property
    def active(self) -> bool:
        """Whether the current step's backward passes are checked."""
        return self.mode == "always" or self._left > 0

    def check(
        self,
        module: nn.Module,
        params: Sequence[nn.Parameter],
        grads: Mapping[nn.Parameter, PerExampleGrad],
        transforms: Mapping[nn.Parameter, SlotTransform],
        units: int | None,
    ) -> None:
        """Compare autograd's ``p.grad`` with the sum of the per-example gradients of one backward pass.

        Args:
            module: The module (for the parameters' names in the error).
            params: The privatized parameters.
            grads: Their captured per-example gradients, of the loss as backpropagated (like ``p.grad``).
            transforms: The optimizer plan's transforms of the parameters' slots.
            units: The batch's privacy units; a step counts as checked once a batch with rows was.

        Raises:
            RuntimeError: If a parameter's gradient differs from the sum of its per-example gradients.
        """
        mismatched = verify_per_example_sum(params, grads, 1.0, transforms, self.compute_dtype)
        if units:
            self._saw_rows = True
        with decision("gradient_verification"):
            self._refuse(module, mismatched)

    def _refuse(self, module: nn.Module, mismatched: list[tuple[nn.Parameter, float]]) -> None:
        if mismatched:
            names = {p: n for n, p in module.named_parameters()}
            listed = ", ".join(f"{names.get(p, '?')} (relative error {err:.2g})" for p, err in mismatched[:8])
            raise RuntimeError(
                f"Autograd's gradient differs from the sum of the per-example gradients for: {listed}. Part of these "
                "parameters' gradient bypasses the per-example hooks, so it could not be clipped per example: a "
                "weight used outside its own module's forward (F.linear(h, emb.weight), a penalty on a weight in "
                "training_step), or a custom autograd path. Use the weight through its module (tie it to an "
                "nn.Linear), move weight penalties into the optimizer (weight_decay), or freeze it. "
                "(verify_gradients='never' turns this check off.)"
            )

    def step_done(self, agree: Callable[[bool], bool] = lambda flag: flag) -> None:
        """End the step at its release: a step that checked a batch with rows counts as one checked step.

        Args:
            agree: Whether a flag holds on every rank (one collective): the ranks count the same
                steps, so that they check, and agree on a check's decision, on the same steps.
        """
        if self._left and agree(self._saw_rows):
            self._left -= 1
        self._saw_rows = False
