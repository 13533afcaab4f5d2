"""DP-GRAPE's projections: the weights a ``DPGrape`` optimizer projects, selected by the optimizer itself."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dplightning.planning.memory.settings import (
    Settings,
)


@dataclass(frozen=True)
class Projected:
    """A weight that a DP-GRAPE plan projects: its side, its rank and its slot's elements."""

    side: str
    rank: int
    slot: int


def grape_projections(model: Any, s: Settings) -> dict[str, Any]:
    """``{projected: {layer name: Projected}, slots: slot elements}`` for a ``DPGrape`` optimizer, else ``{}``.

    The selection is :class:`~dplightning.optim.DPGrape`'s own, run on the meta model.
    """
    if s.optimizer.rsplit(".", 1)[-1] != "DPGrape":
        return {}
    from dplightning.optim.grape import DPGrape, projection_side

    keys = ("rank", "refresh_every", "seed", "include", "exclude")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = DPGrape([p for _, p in trainable], **{k: v for k, v in s.optimizer_args.items() if k in keys})
    opt.dp_bind_module(model)
    owner = {p: n for n, m in model.named_modules() for p in m.parameters(recurse=False)}
    projected: dict[str, Projected] = {}
    slots = 0
    for name, p in trainable:
        if opt.selected(name, p):
            side = projection_side(p.shape)
            slot = opt.rank * (p.shape[0] if side == "right" else math.prod(p.shape[1:]))
            projected[owner[p]] = Projected(side, opt.rank, slot)
            slots += slot
        else:
            slots += p.numel()
    return {"projected": projected, "slots": slots}
