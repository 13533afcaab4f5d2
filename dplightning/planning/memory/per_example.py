"""The engines' per-example state: factors kept by book-keeping, formed gradients, and the clipping transients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from dplightning.planning.memory.grape import Projected
from dplightning.planning.memory.layers import Layer
from dplightning.planning.memory.settings import (
    Precision,
)


def forms_slot(layer: Layer, proj: Projected | None, engine: str, tokens: int, grad_bytes: int) -> bool:
    """Whether ``auto`` holds this projected layer's slot formed (fp32) instead of its factors (``Auto.settle``)."""
    if proj is None or engine != "auto" or not layer.factored(engine, tokens):
        return False
    widths = (layer.out_width + proj.rank) if proj.side == "right" else (proj.rank + layer.in_width)
    return proj.slot * 4 < tokens * widths * grad_bytes


def engine_store(
    layers: Sequence[Layer],
    prec: Precision,
    engine: str,
    rows: int,
    tokens: int,
    projected: Mapping[str, Projected] | None = None,
) -> tuple[int, int]:
    """``(Δ and factor copies kept by book-keeping, formed per-example gradients)`` in bytes.

    A weight a DP-GRAPE plan projects keeps Δ Pᵀ (r wide) instead of Δ when projected on the
    left (A stays, counted with the held inputs), and forms only its projected slot; under
    ``auto`` it holds the formed fp32 slot instead when that is smaller (:func:`forms_slot`).
    """
    kept = formed = 0
    projected = projected or {}
    for layer in layers:
        grad_bytes = prec.compute if layer.kind == "linear" else prec.param
        formed += rows * layer.other * grad_bytes
        proj = projected.get(layer.name)
        if forms_slot(layer, proj, engine, tokens, grad_bytes):
            formed += rows * proj.slot * 4
        elif layer.factored(engine, tokens):
            copy = layer.in_width * prec.compute if prec.mixed and layer.fp32_input else 0
            width = proj.rank if proj is not None and proj.side == "left" else layer.out_width
            kept += rows * tokens * (width * grad_bytes + copy)
        elif layer.weight:
            formed += rows * (proj.slot if proj is not None else layer.weight) * grad_bytes
        if layer.name.endswith(("lora_B.default", "lora_B")):
            kept += rows * tokens * layer.in_width * prec.compute  # the adapter's rank-r input, held by its hook
    return kept, formed


def clipping_transient(
    layers: Sequence[Layer],
    prec: Precision,
    engine: str,
    rows: int,
    tokens: int,
    projected: Mapping[str, Projected] | None = None,
) -> int:
    """The largest fp32 temporaries of one slot's norm and clipped sum (``grads.py``), in bytes."""
    from dplightning.privacy.grad_sample.engines import ghost_norm_pays

    worst = 0
    projected = projected or {}
    for layer in layers:
        if not layer.weight:
            continue
        if layer.name in projected:  # the slot is r x max(m, n); its ghost norm and sum are smaller still
            layer = replace(layer, weight=projected[layer.name].slot)
        lowp = prec.compute != 4 if layer.kind == "linear" else prec.param != 4
        out_sum = 4 * layer.weight * (5 if layer.calls > 1 else 1)  # a tied slot stacks its parts' sums
        if layer.factored(engine, tokens):
            a, b = max(layer.in_width, 1), layer.out_width
            copies = 4 * rows * tokens * (a + 2 * b) if lowp else 0
            ghost = copies + 3 * 4 * rows * tokens**2 * layer.calls**2
            if not ghost_norm_pays(tokens, layer.weight):  # the norm is taken on the formed g_i (``grads.py``)
                ghost = 4 * rows * layer.weight + copies
            weighted = 4 * rows * tokens * (min(a, b) + (max(a, b) if lowp else 0)) + out_sum
            worst = max(worst, ghost, weighted)
        else:
            worst = max(worst, (4 * rows * layer.weight if lowp else 0) + out_sum)
    return worst
