"""The planner of ``dplightning memory-plan``: the per-GPU memory of one DP training step, from the fit config.

    dplightning memory-plan --config configs/e2e/opt-6.7b_dpadam.yaml --gpu-memory 80GB
    python -m dplightning.planning.memory --config task.yaml --config configs/cluster/dp_ddp_2x8gpu.yaml --json

The model is built on the ``meta`` device (no weights, no memory) from the model's
``config`` mapping, a local ``pretrained`` folder's ``config.json``, the Hugging Face cache,
or, for hub names that are none of these, the published configs in
:mod:`dplightning.planning.published`; LoRA is applied to it as the module would. Parameter
counts, trainable counts and every hooked layer's shapes are therefore exact. What the
step keeps is modelled from the code of the DP strategy (``docs/memory_plan.md``):

* **static**: weights in their storage dtype, optimizer states, the fp32 buckets of the
  clipped sum;
* **end of forward** (the start of backward): activations saved by autograd or held by the
  per-example hooks (a per-layer count in the manner of Korthikanti et al. 2022, Table 2,
  adapted to the architecture, precision, attention kernel and to what DP keeps), the
  autocast weight copies, the fp32 log-softmax and loss gradients;
* **end of backward** (clipping, flat groups): each hooked layer's input A (held by its
  hook), the output gradients Δ that book-keeping keeps, per-example gradients that are
  formed, autograd's ``p.grad`` in the verification steps, and the fp32 transients of the
  norms and the clipped sum of the largest slot;
* **optimizer step**: the noise of one bucket and the optimizer's temporaries.

The peak is static + the largest of the other three phases, at the physical batch of a
Poisson batch of expected size b at ``sigmas`` standard deviations above b, split into the
Trainer's ``accumulate_grad_batches`` micro-batches.

One module per concern; every name is importable from this package as before:
:mod:`~.units` (bytes, phases), :mod:`~.settings` (the merged config and what the plan reads from it),
:mod:`~.model` (the meta model), :mod:`~.layers` (the hooked layers), :mod:`~.activations` (per transformer
layer), :mod:`~.grape` (DP-GRAPE's projections), :mod:`~.states` (the optimizer's state, asked of it or found by
stepping it on meta tensors), :mod:`~.per_example` (the engines' per-example state), :mod:`~.plan` (the components
and the peak) and :mod:`~.output` (suggestions, the text table). The command line is
:mod:`dplightning.commands.memory_plan`.
"""

from typing import Any

from dplightning.planning.memory.activations import (
    ROLES,
    Dims,
    Saved,
    activation_bytes,
    dims_of,
    layer_tensors,
    trained_roles,
)
from dplightning.planning.memory.grape import Projected, grape_projections
from dplightning.planning.memory.layers import Layer, hooked_layers
from dplightning.planning.memory.model import meta_model, model_config
from dplightning.planning.memory.output import header, suggestion, table
from dplightning.planning.memory.per_example import clipping_transient, engine_store, forms_slot
from dplightning.planning.memory.plan import Component, MemoryPlan, Survey, assemble, formed_roles, plan, survey
from dplightning.planning.memory.settings import (
    Precision,
    Settings,
    dp_defaults,
    load_configs,
    merge_configs,
    physical_batch,
    precision_of,
    settings_of,
)
from dplightning.planning.memory.states import optimizer_states
from dplightning.planning.memory.units import DEFAULT_SIGMAS, GB, PHASES, Phase, parse_memory

__all__ = [
    "Phase",
    "PHASES",
    "GB",
    "DEFAULT_SIGMAS",
    "parse_memory",
    "merge_configs",
    "load_configs",
    "Precision",
    "precision_of",
    "Settings",
    "dp_defaults",
    "settings_of",
    "physical_batch",
    "optimizer_states",
    "model_config",
    "meta_model",
    "Layer",
    "hooked_layers",
    "Projected",
    "grape_projections",
    "Dims",
    "dims_of",
    "Saved",
    "ROLES",
    "trained_roles",
    "layer_tensors",
    "activation_bytes",
    "forms_slot",
    "engine_store",
    "clipping_transient",
    "Component",
    "MemoryPlan",
    "Survey",
    "survey",
    "assemble",
    "formed_roles",
    "plan",
    "suggestion",
    "table",
    "header",
]


def __getattr__(name: str) -> Any:
    """``main``, the CLI entry that moved to :mod:`dplightning.commands.memory_plan`, is still importable here.

    Loaded on first access (PEP 562) because the command imports this module, not the other way round.
    """
    if name == "main":
        from dplightning.commands.memory_plan import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
