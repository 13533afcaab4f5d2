"""The AdamW direction shared by the DP-plan optimizers (on released slots, not on ``p.grad``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def adam_direction(state: dict[str, Any], grad: Tensor, betas: tuple[float, float], eps: float) -> Tensor:
    """Update the fp32 moments in ``state`` with ``grad`` and return ``torch.optim.AdamW``'s m̂ / (√v̂ + ε).

    Written out because the optimizers apply it to a release in slot coordinates (DP-GRAPE lifts
    it back with P) or to part of their parameters (DP-Muon), which a second ``torch.optim.AdamW``
    with its own state layout cannot do; the tests check it against torch's AdamW.
    """
    if "exp_avg" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(grad, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(grad, dtype=torch.float32)
    state["step"] += 1
    (beta1, beta2), t, grad = betas, state["step"], grad.float()
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)  # as torch.optim.AdamW
    return m.div(denom).div_(1 - beta1**t)
