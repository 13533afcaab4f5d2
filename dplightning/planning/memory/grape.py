"""Projected slots: what the configured optimizer's own DP plan projects (DP-GRAPE), asked on the meta model.

The planner does not know optimizers by name here. It builds the configured optimizer class on the meta model's
trainable parameters (its arguments typed by their annotations, as the fit's config parser types them), binds it to
the model and asks its :meth:`~dplightning.protocols.DPPlanned.dp_plan`: each slot transform there gives the slot
that is clipped, noised and released for its weight, and the optimizer's state lives in those slots.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from dplightning.planning.memory.settings import (
    Settings,
)


@dataclass(frozen=True)
class Projected:
    """A weight that a DP plan projects: its side, its rank and its slot's elements."""

    side: str
    rank: int
    slot: int


def optimizer_class(path: str) -> type | None:
    """The class a config's ``class_path`` names (a bare name is looked up in ``torch.optim``); ``None`` if unknown."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name or "torch.optim"), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def dp_planned_optimizer(model: nn.Module, s: Settings) -> Any | None:
    """The configured optimizer on ``model``'s trainable parameters, bound to ``model``, if it declares a DP plan.

    Raises:
        ValueError: If the optimizer's ``init_args`` do not fit its constructor.
    """
    cls = optimizer_class(s.optimizer)
    if cls is None or not callable(getattr(cls, "dp_plan", None)):
        return None
    return bound_optimizer(model, cls, s.optimizer_args)


def bound_optimizer(model: nn.Module, cls: type, args: Mapping[str, Any]) -> Any:
    """``cls`` on ``model``'s trainable parameters with ``args`` typed as the fit types them, bound to ``model``.

    Bound: given the model through ``dp_bind_module`` if the optimizer has one, as the DP strategy does before
    asking its plan.

    Raises:
        ValueError: If ``args`` do not fit the constructor.
    """
    optimizer = cls([p for p in model.parameters() if p.requires_grad], **typed_arguments(cls, args))
    bind = getattr(optimizer, "dp_bind_module", None)
    if callable(bind):
        bind(model)
    return optimizer


def typed_arguments(cls: type, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` converted to the types of ``cls``'s constructor (YAML reads ``2e-4`` as a string), as the fit does.

    Raises:
        ValueError: If an argument is unknown to the constructor or does not fit its type.
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, skip={"params"})
    try:
        parsed = parser.parse_object(dict(args))
    except Exception as error:  # jsonargparse's ArgumentError; its message names the argument
        raise ValueError(f"The optimizer's init_args do not fit {cls.__name__}: {error}") from error
    return {k: v for k, v in parsed.as_dict().items() if k in args}


def grape_projections(model: nn.Module, s: Settings) -> dict[str, Any]:
    """``{projected: {layer name: Projected}, slots: slot elements}`` when the DP plan projects weights, else ``{}``.

    Read from the optimizer's own DP plan on the meta model (:func:`dp_planned_optimizer`): an optimizer without
    one, or whose plan transforms no slot (DP-Muon's), is planned on the parameters themselves.

    Raises:
        ValueError: If a slot transform is not a projection of one side of its weight (the memory model of the
            factors kept for a projected weight is DP-GRAPE's).
    """
    optimizer = dp_planned_optimizer(model, s)
    if optimizer is None:
        return {}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    transforms = optimizer.dp_plan(trainable, s.max_grad_norm).transforms
    if not transforms:
        return {}
    owner = {p: n for n, m in model.named_modules() for p in m.parameters(recurse=False)}
    projected: dict[str, Projected] = {}
    slots = 0
    for name, p in trainable:
        if p not in transforms:
            slots += p.numel()
            continue
        transform = transforms[p]
        side = getattr(transform, "side", None)
        if side not in ("left", "right"):
            raise ValueError(
                f"memory-plan models slot transforms that project one side of a weight (DP-GRAPE's); the DP plan "
                f"transforms {name} with a {type(transform).__name__}."
            )
        shape = transform.slot_shape(p.shape)
        projected[owner[p]] = Projected(side, shape[1] if side == "right" else shape[0], shape.numel())
        slots += shape.numel()
    return {"projected": projected, "slots": slots}
