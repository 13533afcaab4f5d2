"""The layers the per-example hooks attach to, classified by the engines' own rule (``engines.classify``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layer:
    """One layer the per-example hooks attach to, for one call on ``[B, T, in]`` input.

    Attributes:
        name: Module path.
        kind: ``linear``, ``embedding``, ``norm`` or ``other``.
        in_width: Input features per token (0 for index inputs).
        out_width: Output features per token.
        weight: Elements of the trainable weight (0 if none).
        other: Elements of the other trainable parameters (biases, norm affines).
        factorable: Whether book-keeping can keep this weight factored.
        calls: Layers sharing the weight (a tied embedding and head: 2).
        fp32_input: Under mixed precision, whether its input arrives in fp32 (a norm's output).
    """

    name: str
    kind: str
    in_width: int
    out_width: int
    weight: int
    other: int
    factorable: bool
    calls: int = 1
    fp32_input: bool = False

    def factored(self, engine: str, tokens: int) -> bool:
        """Whether the engine keeps A and Δ for this call instead of forming g_i (``Engine.keeps_factors``)."""
        from dplightning.privacy.grad_sample.engines import keeps_factors

        return self.factorable and self.weight > 0 and keeps_factors(engine, tokens, self.weight)


_FP32_INPUT = re.compile(r"(q_proj|k_proj|v_proj|c_attn|query|key|value|fc1|c_fc|gate_proj|up_proj|lm_head|score)$")


_PLANNED_KINDS = ("linear", "embedding", "norm")
"""The kinds whose widths the plan uses: it models transformers, where a conv's positions are not the T it plans."""


def _widths(module: Any) -> tuple[str, int, int]:
    """The layer's kind and widths per token, from the engines' classification (``engines.classify``)."""
    from dplightning.privacy.grad_sample.engines import classify

    found = classify(module)
    if found.kind not in _PLANNED_KINDS:
        return "other", 0, 0
    return found.kind, found.in_width, found.out_width


def hooked_layers(model: Any) -> list[Layer]:
    """Every module owning trainable parameters (what :class:`PerExampleHooks` hooks)."""
    from dplightning.privacy.grad_sample.engines import factorisation_of

    users: dict[int, int] = {}
    found = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        weight = getattr(module, "weight", None)
        trainable_weight = weight is not None and getattr(weight, "requires_grad", False)
        if trainable_weight:
            users[id(weight)] = users.get(id(weight), 0) + 1
        found.append((name, module, own, weight if trainable_weight else None))
    layers = []
    for name, module, own, weight in found:
        kind, a, b = _widths(module)
        clean = re.sub(r"\.(base_layer|lora_[AB]\.\w+|modules_to_save\.\w+)$", "", name)
        layers.append(
            Layer(
                name=name,
                kind=kind,
                in_width=a,
                out_width=b,
                weight=0 if weight is None else weight.numel(),
                other=sum(p.numel() for p in own if p is not weight),
                factorable=factorisation_of(module) is not None,
                calls=1 if weight is None else users[id(weight)],
                fp32_input=bool(_FP32_INPUT.search(clean)) and not name.endswith(("lora_B.default", "lora_B")),
            )
        )
    return layers
