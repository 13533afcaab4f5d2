"""Optimizer state: what the configured optimizer keeps between steps, asked of it or found by stepping it on meta.

No table of optimizer names. The optimizer is built on the meta model's trainable parameters in the weights' storage
dtype (its arguments typed as the fit types them, bound to the model as the DP strategy binds it) and then

* if it states its own size (:class:`~dplightning.protocols.DeclaresStateSize`: DP-GRAPE, DP-Muon, whose steps draw
  random numbers or read norms and so cannot run on meta tensors), it is asked, after its DP plan if it has one;
* otherwise it is given meta gradients and stepped once, and the state tensors the step made are counted. For torch's
  optimizers this gives what the former class-name table gave (Adam/AdamW 2 or 3 with ``amsgrad``, SGD 0 or 1,
  RMSprop 1 to 3, Adagrad 1, Adadelta 2, NAdam, RAdam, Adamax 2, in the weights' dtype);
* an optimizer that cannot be imported or stepped on meta tensors (torch's ASGD, Adafactor and LBFGS call
  ``.item()``, SparseAdam takes sparse gradients only) is planned as Adam's two states in the weights' dtype, as the
  table planned any name it did not know, and the plan says so in its notes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dplightning.planning.memory.grape import bound_optimizer, optimizer_class
from dplightning.protocols import DeclaresStateSize

ASSUMED_STATES = 2
"""State tensors per trainable parameter assumed for an optimizer whose state cannot be found (Adam's)."""

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(frozen=True)
class OptimizerState:
    """The elements of an optimizer's state by dtype, and why they were assumed if they were not found.

    Attributes:
        elements: Elements of the state tensors, by dtype (dtypes without any left out).
        assumed: Why the state was planned as Adam's instead (``None`` when it was found).
    """

    elements: dict[torch.dtype, int] = field(default_factory=dict)
    assumed: str | None = None

    @property
    def total(self) -> int:
        """Elements of every dtype."""
        return sum(self.elements.values())

    @property
    def bytes(self) -> int:
        """Bytes of the state tensors."""
        return sum(n * dtype.itemsize for dtype, n in self.elements.items())

    def dtype_names(self) -> str:
        """The state's dtypes as short names (``"fp32"``, ``"bf16+fp32"``)."""
        return "+".join(sorted(DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in self.elements))


def optimizer_state(model: nn.Module, optimizer: str, args: Mapping[str, Any], max_grad_norm: float) -> OptimizerState:
    """The state that optimizer ``optimizer`` (a class path) keeps for ``model``'s trainable parameters.

    ``model`` is a meta model with its parameters in their storage dtype; its parameters' gradients are left unset.

    Raises:
        ValueError: If ``args`` do not fit the optimizer's constructor (the fit refuses them too).
    """
    cls = optimizer_class(optimizer)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cls is None:
        return _assumed(trainable, f"{optimizer} could not be imported")
    try:
        built = bound_optimizer(model, cls, args)
    except ValueError:  # arguments the constructor refuses: the fit would refuse them too
        raise
    except Exception as error:  # e.g. torch's fused=True, which no optimizer takes on meta tensors
        return _assumed(trainable, f"{cls.__name__} cannot be built on meta tensors ({type(error).__name__}: {error})")
    if isinstance(built, DeclaresStateSize):
        dp_plan = getattr(built, "dp_plan", None)
        if callable(dp_plan):
            dp_plan(trainable, max_grad_norm)  # the plan may change the state (DP-GRAPE's slots)
        return OptimizerState({d: n for d, n in built.state_elements().items() if n})
    try:
        return OptimizerState(_stepped_on_meta(built, [p for _, p in trainable]))
    except Exception as error:  # whatever the step raises on meta tensors, the plan goes on with Adam's states
        return _assumed(trainable, f"{cls.__name__} cannot step on meta tensors ({type(error).__name__}: {error})")


def _stepped_on_meta(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict[torch.dtype, int]:
    """Step ``optimizer`` once with meta gradients and count the elements of the state tensors on the meta device.

    The step counters torch keeps as 0-d CPU tensors (unless ``capturable``) are not device memory and are left out.
    """
    for p in params:
        p.grad = torch.empty_like(p)
    try:
        optimizer.step()
    finally:
        for p in params:
            p.grad = None
    elements: Counter[torch.dtype] = Counter()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_meta and value.numel():
                elements[value.dtype] += value.numel()
    return dict(elements)


def _assumed(trainable: list[tuple[str, nn.Parameter]], why: str) -> OptimizerState:
    elements: Counter[torch.dtype] = Counter()
    for _, p in trainable:
        elements[p.dtype] += ASSUMED_STATES * p.numel()
    return OptimizerState(dict(elements), f"{why}; its state is planned as Adam's, {ASSUMED_STATES} per parameter")


def optimizer_states(name: str, args: Mapping[str, Any]) -> int | float:
    """State elements per element of one fp32 weight matrix that optimizer ``name`` keeps, found as the plan finds them.

    Kept for callers of the former class-name table (2 for Adam, 1 for SGD with momentum, 0 without); the plan
    itself counts the whole model (:func:`optimizer_state`), whose parameters may differ (DP-Muon keeps 1 per element
    of a hidden matrix and 2 per element of the rest).
    """
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8, bias=False))
    return per_element(optimizer_state(model, name, args, 1.0).total, 64)


def per_element(elements: int, units: int) -> int | float:
    """``elements / units``: an int when it divides, else rounded to 3 decimals (0 for no units)."""
    if units == 0:
        return 0
    whole, rest = divmod(elements, units)
    return whole if rest == 0 else round(elements / units, 3)
