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
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml

Phase = Literal["static", "forward", "backward", "optimizer"]
PHASES: dict[str, str] = {
    "static": "whole step",
    "forward": "end of forward",
    "backward": "end of backward",
    "optimizer": "optimizer step",
}
GB = 1e9
_UNITS = {"": GB, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": GB, "gb": GB, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
DEFAULT_SIGMAS = 4.0
"""Standard deviations above the expected Poisson batch that the physical batch must hold."""


def parse_memory(text: str) -> float:
    """Bytes in ``"80GB"``, ``"80GiB"``, ``"24G"``, ``"512MiB"`` or a bare number of GB.

    Raises:
        ValueError: For an unknown unit or a negative amount.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"Cannot read {text!r} as an amount of memory (e.g. 80GB, 80GiB, 24G, 512MiB).")
    return float(match.group(1)) * _UNITS[unit]


# ---------------------------------------------------------------- the config


def merge_configs(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on ``base`` as LightningCLI combines ``--config`` files: later keys win, dicts merge.

    A ``class_path`` that changes drops the old ``init_args`` (they belong to the old class).
    """
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            if "class_path" in value and old.get("class_path") not in (None, value["class_path"]):
                out[key] = dict(value)
            else:
                out[key] = merge_configs(old, value)
        else:
            out[key] = value
    return out


def load_configs(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The YAML files merged in order (a leading ``fit:`` section is unwrapped)."""
    merged: dict[str, Any] = {}
    for path in paths:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if isinstance(data.get("fit"), Mapping):
            data = data["fit"]
        merged = merge_configs(merged, data)
    return merged


def _init_args(section: Any) -> dict[str, Any]:
    if isinstance(section, Mapping):
        return dict(section.get("init_args", {}) or {})
    return {}


@dataclass(frozen=True)
class Precision:
    """Bytes per element: stored weights, matmul compute, and the residual stream / norms."""

    name: str
    param: int
    compute: int
    mixed: bool

    @property
    def residual(self) -> int:
        return 4 if self.mixed else self.compute


def precision_of(value: Any) -> Precision:
    """Lightning's ``trainer.precision`` as element sizes (``bf16-mixed`` keeps fp32 weights)."""
    name = "32-true" if value is None else str(value)
    table = {
        "32": (4, 4, False),
        "32-true": (4, 4, False),
        "64": (8, 8, False),
        "64-true": (8, 8, False),
        "bf16-mixed": (4, 2, True),
        "16-mixed": (4, 2, True),
        "bf16": (4, 2, True),
        "16": (4, 2, True),
        "bf16-true": (2, 2, False),
        "16-true": (2, 2, False),
    }
    if name not in table:
        raise ValueError(f"Unsupported trainer.precision {name!r} for planning; choose one of {sorted(table)}.")
    return Precision(name, *table[name])


@dataclass(frozen=True)
class Settings:
    """What the plan reads from the merged config."""

    model_class: str
    model_args: dict[str, Any]
    precision: Precision
    batch_size: int
    max_length: int
    accumulate: int
    poisson: bool
    clipping: str
    engine: str
    verify: str
    bucket_cap_mb: float
    optimizer: str
    optimizer_args: dict[str, Any]
    gpu: bool
    world_size: int
    noise_buffers: int = 0
    """Secret fp32 buffers of the noised size a correlated noise mechanism keeps (b - 1 banded, m BLT)."""


def dp_defaults() -> dict[str, Any]:
    """The DP strategies' defaults, read from :class:`~dplightning.strategies.config.DPConfig` (never retyped here)."""
    from dplightning.strategies import config

    return {f.name: f.default for f in fields(config.DPConfig) if f.default is not MISSING}


def settings_of(config: Mapping[str, Any]) -> Settings:
    """The planning inputs of a merged fit config (defaults as the classes define them).

    Raises:
        ValueError: For a ``clipping_engine`` that no engine is registered as.
    """
    from dplightning.privacy.grad_sample.engines import available_engines

    trainer = dict(config.get("trainer", {}) or {})
    model = config.get("model", {}) or {}
    strategy = {**dp_defaults(), **_init_args(trainer.get("strategy"))}
    if strategy["clipping_engine"] not in available_engines():
        raise ValueError(
            f"Unknown clipping_engine {strategy['clipping_engine']!r}; choose one of {available_engines()}."
        )
    data = _init_args(config.get("data"))
    optimizer = _init_args(model).get("optimizer")
    opt_class = optimizer.get("class_path", "torch.optim.AdamW") if isinstance(optimizer, Mapping) else "AdamW"
    if isinstance(optimizer, str):
        opt_class = optimizer
    accelerator = str(trainer.get("accelerator", "auto"))
    devices = trainer.get("devices", 1)
    return Settings(
        model_class=str(model.get("class_path", "dplightning.modules.DPCausalLM")),
        model_args=_init_args(model),
        precision=precision_of(trainer.get("precision")),
        batch_size=int(data.get("batch_size", 32)),
        max_length=int(data.get("max_length", 128)),
        accumulate=int(trainer.get("accumulate_grad_batches", 1) or 1),
        poisson=bool(strategy["poisson_sampling"]),
        clipping=str(strategy["clipping"]),
        engine=str(strategy["clipping_engine"]),
        verify=str(strategy["verify_gradients"]),
        bucket_cap_mb=float(strategy["bucket_cap_mb"]),
        optimizer=opt_class,
        optimizer_args=_init_args(optimizer) if isinstance(optimizer, Mapping) else {},
        gpu=accelerator not in ("cpu",),
        world_size=int(trainer.get("num_nodes", 1) or 1) * (devices if isinstance(devices, int) else 1),
        noise_buffers=_noise_buffers(strategy),
    )


def _noise_buffers(strategy: Mapping[str, Any]) -> int:
    """Buffers of the correlated noise state: b - 1 for ``band_mf``, ``blt_buffers`` for ``blt``, else 0."""
    mechanism = strategy["noise_mechanism"]
    if mechanism == "band_mf":
        return max(int(strategy.get("bands") or 1) - 1, 0)
    if mechanism == "blt":
        return int(strategy.get("blt_buffers") or 0)
    return 0


def physical_batch(expected: int, accumulate: int, sigmas: float, poisson: bool) -> int:
    """Rows of the largest micro-batch to plan for.

    A Poisson batch of expected size b has standard deviation ≈ √b (q is small); it is split
    into ``accumulate`` micro-batches by ``tensor_split``, the first ones the larger.
    """
    rows = expected + sigmas * math.sqrt(expected) if poisson else expected
    return max(1, math.ceil(math.ceil(rows) / accumulate))


def optimizer_states(name: str, args: Mapping[str, Any]) -> int:
    """Optimizer state tensors per trainable parameter, from the optimizer's class name."""
    short = name.rsplit(".", 1)[-1].lower()
    if short in ("adam", "adamw", "nadam", "radam", "adamax", "lamb"):
        return 2 + (1 if args.get("amsgrad") else 0)
    if short == "sgd":
        return 1 if float(args.get("momentum", 0) or 0) > 0 else 0
    if short == "rmsprop":
        return 1 + (float(args.get("momentum", 0) or 0) > 0) + bool(args.get("centered"))
    if short in ("adagrad", "adadelta"):
        return 1 if short == "adagrad" else 2
    return 2  # an unknown optimizer is planned as Adam-like (what most are)


# ---------------------------------------------------------------- the model, on the meta device


def model_config(model_args: Mapping[str, Any]) -> tuple[Any, str]:
    """The ``transformers`` config of the module's model and where it came from."""
    from transformers import AutoConfig

    from dplightning.models.hf import build_config
    from dplightning.planning.published import published_config

    extra = dict(model_args.get("model_kwargs") or {})
    if model_args.get("config") is not None:
        return build_config(model_args["config"]), "config mapping in the YAML"
    name = model_args.get("pretrained")
    if name is None:
        raise ValueError("The model section has neither `pretrained` nor `config`: nothing to plan.")
    folder = os.path.expanduser(str(name))
    if os.path.isdir(folder):
        return AutoConfig.from_pretrained(folder, local_files_only=True, **extra), f"config.json in {folder}"
    known = published_config(str(name))
    if known is not None:
        return build_config(known[1]), f"published config of {known[0]} (dplightning.planning.published)"
    try:
        return AutoConfig.from_pretrained(str(name), local_files_only=True, **extra), "Hugging Face cache"
    except OSError as error:
        raise ValueError(
            f"{name!r} is not a local folder, not in the Hugging Face cache and not in the published table; "
            "pass `config: {model_type: ...}` or a local folder."
        ) from error


def meta_model(settings: Settings) -> tuple[Any, str]:
    """The module's model with its LoRA adapters, on the meta device, and the config's source."""
    import torch
    import transformers

    from dplightning.models.hf import apply_lora, lora_settings

    classifier = settings.model_class.rsplit(".", 1)[-1] == "DPSequenceClassifier"
    config, source = model_config(settings.model_args)
    if classifier:
        config.num_labels = int(settings.model_args.get("num_labels", 2))
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
        lora = lora_settings(settings.model_args.get("lora"))
        if lora is not None:
            train_head = bool(settings.model_args.get("train_head", True))
            model = apply_lora(model, lora, "SEQ_CLS" if classifier else "CAUSAL_LM", train_head)
    return model, source


# ---------------------------------------------------------------- the hooked layers


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


# ---------------------------------------------------------------- activations (per transformer layer)


@dataclass(frozen=True)
class Dims:
    """The shapes of the transformer, read from its config."""

    arch: str
    hidden: int
    ffn: int
    heads: int
    layers: int
    vocab: int
    activation: str
    p_hidden: float
    p_attn: float
    p_embed: float
    attention: str
    causal_lm: bool
    gpu: bool = True

    def mask_bytes(self, compute: int) -> int:
        """Bytes per element of a dropout mask: bool on CUDA (fused kernel), the input's dtype on CPU."""
        return 1 if self.gpu else compute


def dims_of(config: Any, causal_lm: bool, gpu: bool = True) -> Dims:
    """:class:`Dims` of a ``transformers`` config (GPT-2, OPT, BERT/RoBERTa, Llama-style).

    ``sdpa`` with attention dropout runs PyTorch's math kernel on CPU (T×T probabilities kept),
    a fused kernel on CUDA; it is planned as ``eager`` there.
    """
    mt = config.model_type
    hidden = int(config.hidden_size)
    ffn = getattr(config, "ffn_dim", None) or getattr(config, "intermediate_size", None)
    ffn = ffn or getattr(config, "n_inner", None) or 4 * hidden
    act = str(
        getattr(config, "activation_function", None)
        or getattr(config, "hidden_act", None)
        or getattr(config, "hidden_activation", "gelu")
    )
    p_hidden = getattr(config, "resid_pdrop", None)
    p_hidden = p_hidden if p_hidden is not None else getattr(config, "dropout", None)
    p_hidden = p_hidden if p_hidden is not None else getattr(config, "hidden_dropout_prob", 0.0)
    p_attn = getattr(config, "attn_pdrop", None)
    p_attn = p_attn if p_attn is not None else getattr(config, "attention_dropout", None)
    p_attn = p_attn if p_attn is not None else getattr(config, "attention_probs_dropout_prob", 0.0)
    arch = "llama" if hasattr(config, "intermediate_size") and mt not in ("bert", "roberta") else mt
    return Dims(
        arch=arch,
        hidden=hidden,
        ffn=int(ffn),
        heads=int(config.num_attention_heads),
        layers=int(config.num_hidden_layers),
        vocab=int(config.vocab_size) if causal_lm else 0,
        activation="relu"
        if act == "relu"
        else ("glu" if arch == "llama" else ("gelu_new" if act == "gelu_new" else "gelu")),
        p_hidden=float(p_hidden or 0.0),
        p_attn=float(p_attn or 0.0),
        p_embed=float(getattr(config, "embd_pdrop", 0.0) or 0.0),
        attention=_attention(config, float(p_attn or 0.0), gpu),
        causal_lm=causal_lm,
        gpu=gpu,
    )


def _attention(config: Any, p_attn: float, gpu: bool) -> str:
    name = str(getattr(config, "_attn_implementation", None) or "sdpa")
    return "eager" if name == "eager" or (name == "sdpa" and p_attn > 0 and not gpu) else name


@dataclass(frozen=True)
class Saved:
    """One tensor of a transformer layer alive at the end of the forward pass.

    Attributes:
        name: What it is.
        width: Elements per token (``heads · T`` for attention probabilities).
        nbytes: Bytes per element.
        autograd: Saved by autograd for the backward whatever is trained.
        consumers: Roles whose hooked layers hold it as their input A (if they are trained).
    """

    name: str
    width: int
    nbytes: int
    autograd: bool
    consumers: tuple[str, ...] = ()


ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "opt": {
        "attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attn_out": ("self_attn.out_proj",),
        "mlp_in": ("fc1",),
        "mlp_out": ("fc2",),
    },
    "gpt2": {
        "attn_in": ("attn.c_attn",),
        "attn_out": ("attn.c_proj",),
        "mlp_in": ("mlp.c_fc",),
        "mlp_out": ("mlp.c_proj",),
    },
    "bert": {
        "attn_in": ("attention.self.query", "attention.self.key", "attention.self.value"),
        "attn_out": ("attention.output.dense",),
        "mlp_in": ("intermediate.dense",),
        "mlp_out": ("output.dense",),
    },
    "llama": {
        "attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attn_out": ("self_attn.o_proj",),
        "mlp_in": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp_out": ("mlp.down_proj",),
    },
}
ROLES["roberta"] = ROLES["bert"]


def trained_roles(model: Any, arch: str) -> set[str]:
    """Roles of the first transformer layer with a trainable parameter (LoRA adapters count)."""
    from torch import nn

    layer0 = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and sum(1 for _ in module[0].parameters()) > 2:
            layer0 = module[0]
            break
    if layer0 is None:
        return set()
    trained = [n for n, p in layer0.named_parameters() if p.requires_grad]
    roles = ROLES.get(arch, ROLES["opt"])
    return {role for role, paths in roles.items() if any(n.startswith(f"{p}.") for n in trained for p in paths)}


def layer_tensors(d: Dims, prec: Precision, tokens: int) -> list[Saved]:
    """The tensors one transformer layer leaves alive at the end of the forward pass under DP.

    The Korthikanti et al. (2022) count (``sbh(34 + 5as/h)`` bytes in 16-bit), itemised so
    that each term follows the architecture and what DP changes: the privatized weights do
    not require gradient during the forward, so autograd does not save the inputs of
    trained Linear layers; their hooks hold them instead (``consumers``), in the dtype they
    arrive in (fp32 norm outputs under autocast). ``sdpa`` (the default) keeps Q, K, V, the
    output and the log-sum-exp, no T×T probabilities.
    """
    c, r, h, f = prec.compute, prec.residual, d.hidden, d.ffn
    scores, mask = d.heads * tokens, d.mask_bytes(prec.compute)
    out = [
        Saved("norm 1 input", h, r, True),
        Saved("norm 1 output", h, r, False, ("attn_in",)),
        Saved("q, k, v", 3 * h, c, True),
    ]
    if d.attention == "eager":
        out.append(Saved("softmax output", scores, 4 if prec.mixed or d.arch == "opt" else c, True))
        if d.p_attn > 0:
            out += [
                Saved("attention dropout mask", scores, mask, True),
                Saved("attention dropout output", scores, c, True),
            ]
        elif prec.mixed or (d.arch == "opt" and c != 4):
            out.append(Saved("probabilities (compute dtype)", scores, c, True))
    else:
        out += [Saved("attention output (sdpa)", h, c, True), Saved("log-sum-exp", d.heads, 4, True)]
    out.append(Saved("attention output, merged heads", h, c, False, ("attn_out",)))
    out += [Saved("norm 2 input", h, r, True), Saved("norm 2 output", h, r, False, ("mlp_in",))]
    if d.activation == "glu":
        out += [Saved("gate, up projections", 2 * f, c, True), Saved("silu(gate)", f, c, True)]
        out.append(Saved("silu(gate) · up", f, c, False, ("mlp_out",)))
    elif d.activation == "relu":
        out.append(Saved("relu output", f, c, True, ("mlp_out",)))
    elif d.activation == "gelu_new":  # Hugging Face's tanh GELU in Python: x, tanh, 1 + tanh, x / 2
        out += [Saved("tanh-GELU intermediates", 4 * f, c, True), Saved("GELU output", f, c, False, ("mlp_out",))]
    else:
        out += [Saved("fc1 output (GELU input)", f, c, True), Saved("GELU output", f, c, False, ("mlp_out",))]
    if d.p_hidden > 0:
        out.append(Saved("dropout masks (attention, MLP)", 2 * h, mask, True))
    return out


def _alive(t: Saved, roles: set[str]) -> tuple[bool, bool]:
    held = any(role in roles for role in t.consumers)
    return t.autograd or held, held


def activation_bytes(d: Dims, prec: Precision, roles: set[str], rows: int, tokens: int, head: bool) -> tuple[int, int]:
    """``(alive at the end of the forward, of which held by the hooks)`` over all layers, in bytes."""
    alive = held = 0
    for t in layer_tensors(d, prec, tokens):
        is_alive, is_held = _alive(t, roles)
        alive += is_alive * t.width * t.nbytes
        held += is_held * t.width * t.nbytes
    alive, held = alive * d.layers, held * d.layers
    final = d.hidden * prec.residual  # the final norm's input (saved), and its output if the head is trained
    alive += final + (final if head else 0) + (d.hidden * d.mask_bytes(prec.compute) if d.p_embed > 0 else 0)
    held += final if head else 0
    return alive * rows * tokens, held * rows * tokens


# ---------------------------------------------------------------- the engines' per-example state


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


# ---------------------------------------------------------------- DP-GRAPE's projections


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


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Component:
    """One line of the plan: bytes alive in a phase of the step."""

    name: str
    bytes: float
    phase: Phase
    note: str = ""

    @property
    def gb(self) -> float:
        return self.bytes / GB


@dataclass
class MemoryPlan:
    """The per-GPU memory of one DP training step, by component.

    Attributes:
        components: The estimate's lines; ``peak`` adds the static ones to the largest phase.
        model_source: Where the architecture came from.
        parameters: All parameters of the model (exact, from the meta model).
        trainable: Trainable (privatized) parameters.
        optimizer: The optimizer's class path.
        optimizer_states: State tensors per trainable parameter.
        precision: Lightning's precision name.
        engine: The clipping engine.
        expected_batch: b, the expected Poisson batch per process.
        physical_batch: Rows of the micro-batch planned for.
        accumulate: Lightning's ``accumulate_grad_batches``.
        sigmas: Standard deviations above b in ``physical_batch``.
        tokens: Sequence length T planned for (the DataModule's ``max_length``).
        engines: Hooked layers by engine (``book_keeping``, ``instantiate``).
        notes: What the estimate assumed.
    """

    components: list[Component]
    model_source: str
    parameters: int
    trainable: int
    optimizer: str
    optimizer_states: int
    precision: str
    engine: str
    expected_batch: int
    physical_batch: int
    accumulate: int
    sigmas: float
    tokens: int
    engines: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def phase_bytes(self, phase: Phase) -> float:
        """Bytes of the components of one phase."""
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def peak_phase(self) -> Phase:
        """The phase with the most memory on top of the static components."""
        return max(("forward", "backward", "optimizer"), key=self.phase_bytes)  # type: ignore[arg-type,return-value]

    @property
    def peak(self) -> float:
        """Estimated peak bytes of live tensors."""
        return self.phase_bytes("static") + self.phase_bytes(self.peak_phase)

    def fits(self, capacity: float, reserve: float = 0.0) -> bool:
        """Whether the peak plus ``reserve`` (context, fragmentation) stays within ``capacity`` bytes."""
        return self.peak + reserve <= capacity

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with the totals."""
        out = asdict(self)
        out["components"] = [{**asdict(c), "gb": c.gb} for c in self.components]
        out["phases_gb"] = {p: self.phase_bytes(p) / GB for p in PHASES}  # type: ignore[arg-type]
        out.update(peak_phase=self.peak_phase, peak_bytes=self.peak, peak_gb=self.peak / GB)
        return out


def _static(s: Settings, params: int, trainable: int, states: int, slots: int | None = None) -> list[Component]:
    p = s.precision.param
    if slots is not None:  # DP-GRAPE: fp32 moments and buckets of the slots (projected weights r x max(m, n))
        return [
            Component("weights", params * p, "static", f"{params:,} parameters, {8 * p}-bit"),
            Component("optimizer states", states * slots * 4, "static", f"{states} fp32 per slot element"),
            Component("DP buckets (clipped sum)", slots * 4, "static", f"fp32, {slots:,} slot elements"),
        ]
    return [
        Component("weights", params * p, "static", f"{params:,} parameters, {8 * p}-bit"),
        Component("optimizer states", states * trainable * p, "static", f"{states} per trainable parameter"),
        Component("DP buckets (clipped sum)", trainable * 4, "static", f"fp32, {trainable:,} trainable"),
    ]


def _forward(s: Settings, d: Dims, matmul: int, rows: int, alive: int) -> list[Component]:
    t = s.max_length
    out = [Component("activations", alive, "forward", f"per layer, attention {d.attention}")]
    if s.precision.mixed:
        out.append(
            Component("autocast weight copies", matmul * s.precision.compute, "forward", "16-bit matmul weights")
        )
    if d.vocab:
        out.append(Component("logits and loss (fp32)", 12 * rows * t * d.vocab, "forward", "log-softmax + 2 grads"))
    return out


def _backward(
    s: Settings,
    layers: list[Layer],
    held: int,
    rows: int,
    trainable: int,
    projected: Mapping[str, Projected] | None = None,
) -> list[Component]:
    t, prec = s.max_length, s.precision
    kept, formed = engine_store(layers, prec, s.engine, rows, t, projected)
    early = s.clipping in ("per_layer", "per_matrix") and s.verify == "never"
    if early:  # each layer's Δ and g_i go into the buckets when its backward is done
        per = [engine_store([x], prec, s.engine, rows, t, projected) for x in layers]
        kept, formed = max((k for k, _ in per), default=0), max((f for _, f in per), default=0)
    out = [
        Component("layer inputs held by the hooks (A)", held, "backward", "until the clipped sum"),
        Component("output gradients kept (Δ)", kept, "backward", f"book-keeping{', one layer' if early else ''}"),
        Component("formed per-example gradients", formed, "backward", "biases, norms, instantiated weights"),
        Component(
            "clipping temporaries (fp32)", clipping_transient(layers, prec, s.engine, rows, t, projected), "backward"
        ),
    ]
    if s.verify != "never":
        note = "autograd's, first steps only (verify_gradients)"
        out.append(Component("gradients p.grad", trainable * prec.param, "backward", note))
    return out


def _optimizer(s: Settings, trainable: int, largest: int, states: int, slots: int | None = None) -> list[Component]:
    if slots is not None:  # DP-GRAPE steps per tensor: √v, m/√v and the lifted fp32 update of one weight
        out = [Component("optimizer temporaries", 3 * largest * 4, "optimizer", "per tensor (DP-GRAPE)")]
        out.append(Component("noise (one bucket)", min(s.bucket_cap_mb * 2**20, slots * 4), "optimizer"))
        return out
    temp = trainable * s.precision.param if s.gpu else 2 * largest * 4  # foreach on GPU, per tensor on CPU
    out = [Component("optimizer temporaries", temp if states else 0, "optimizer", "foreach" if s.gpu else "per tensor")]
    out.append(Component("noise (one bucket)", min(s.bucket_cap_mb * 2**20, trainable * 4), "optimizer"))
    if s.precision.param != 4:
        out.append(Component("gradients p.grad", trainable * s.precision.param, "optimizer", "16-bit copy of buckets"))
    return out


@dataclass
class Survey:
    """What the meta model gives, computed once per config (building it is the slow part)."""

    settings: Settings
    dims: Dims
    layers: list[Layer]
    roles: set[str]
    parameters: int
    trainable: int
    largest: int
    matmul: int
    source: str
    projected: dict[str, Projected] = field(default_factory=dict)
    slots: int | None = None


def survey(config: Mapping[str, Any]) -> Survey:
    """Build the model on the meta device and read its hooked layers."""
    s = settings_of(config)
    model, source = meta_model(s)
    causal = s.model_class.rsplit(".", 1)[-1] != "DPSequenceClassifier"
    config_ = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    d = dims_of(config_, causal, s.gpu)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Survey(
        settings=s,
        dims=d,
        layers=hooked_layers(model),
        roles=trained_roles(model, d.arch),
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in trainable),
        largest=max((p.numel() for p in trainable), default=0),
        matmul=sum(m.weight.numel() for m in model.modules() if _widths(m)[0] == "linear"),
        source=source,
        **grape_projections(model, s),
    )


def assemble(sv: Survey, sigmas: float = DEFAULT_SIGMAS, accumulate: int | None = None) -> MemoryPlan:
    """The plan of a surveyed model (cheap: rerun it to try other batch splits)."""
    s = sv.settings if accumulate is None else replace(sv.settings, accumulate=accumulate)
    rows = physical_batch(s.batch_size, s.accumulate, sigmas, s.poisson)
    states = optimizer_states(s.optimizer, s.optimizer_args)
    head = any(x.name.endswith(("lm_head", "score", "classifier.out_proj")) for x in sv.layers)
    alive, _ = activation_bytes(sv.dims, s.precision, sv.roles, rows, s.max_length, head)
    # A formed slot frees its layer's input after that layer's backward, not before: the end
    # of the forward still has it, the end of the backward does not.
    _, held = activation_bytes(sv.dims, s.precision, sv.roles - formed_roles(sv, s), rows, s.max_length, head)
    components = [
        *_static(s, sv.parameters, sv.trainable, states, sv.slots),
        *_forward(s, sv.dims, sv.matmul, rows, alive),
        *_backward(s, sv.layers, held, rows, sv.trainable, sv.projected),
        *_optimizer(s, sv.trainable, sv.largest, states, sv.slots),
    ]
    if s.noise_buffers:  # on every noising rank (rank 0 under noise_placement="rank0"); secret, never saved
        noised = sv.slots if sv.slots is not None else sv.trainable
        detail = f"{s.noise_buffers} fp32 buffers of the {noised:,} noised elements, secret"
        components.append(Component("correlated noise state", s.noise_buffers * noised * 4, "static", detail))
    engines = {"book_keeping": 0, "instantiate": 0}
    for layer in sv.layers:
        engines["book_keeping" if layer.factored(s.engine, s.max_length) else "instantiate"] += 1
    return MemoryPlan(
        components=components,
        model_source=sv.source,
        parameters=sv.parameters,
        trainable=sv.trainable,
        optimizer=s.optimizer,
        optimizer_states=states,
        precision=s.precision.name,
        engine=s.engine,
        expected_batch=s.batch_size,
        physical_batch=rows,
        accumulate=s.accumulate,
        sigmas=sigmas if s.poisson else 0.0,
        tokens=s.max_length,
        engines=engines,
        notes=_notes(sv, s),
    )


def formed_roles(sv: Survey, s: Settings) -> set[str]:
    """Roles (``ROLES``) whose every trained consumer forms its projected slot: no hook holds their input."""
    paths = ROLES.get(sv.dims.arch, ROLES["opt"])
    out = set()
    for role in sv.roles:
        consumers = [x for x in sv.layers if x.weight and any(x.name.endswith(f".{q}") for q in paths[role])]
        bytes_of = {x.name: s.precision.compute if x.kind == "linear" else s.precision.param for x in consumers}
        if consumers and all(
            forms_slot(x, sv.projected.get(x.name), s.engine, s.max_length, bytes_of[x.name]) for x in consumers
        ):
            out.add(role)
    return out


def _notes(sv: Survey, s: Settings) -> list[str]:
    notes = [f"architecture: {sv.dims.arch}, {sv.dims.layers} layers, from the {sv.source}"]
    if sv.slots is not None:
        rank = next(iter(sv.projected.values())).rank if sv.projected else 0
        notes.append(
            f"DP-GRAPE: {len(sv.projected)} weights projected to rank {rank}; {sv.slots:,} slot elements "
            f"(of {sv.trainable:,} trainable); under auto a slot smaller than its factors is formed in the "
            "backward and frees them (Auto.settle), otherwise the held inputs A are counted in full"
        )
    if not s.poisson:
        notes.append("poisson_sampling is off: fixed batches, no margin")
    if s.verify != "never":
        notes.append("verification steps (the first two) keep autograd's p.grad and clip after the backward")
    if s.world_size > 1:
        notes.append(f"{s.world_size} processes: batch_size is per process; the plan is per GPU (weights replicated)")
    return notes


def plan(config: Mapping[str, Any], sigmas: float = DEFAULT_SIGMAS) -> MemoryPlan:
    """The memory plan of a merged fit config (the mapping ``dplightning fit --config`` reads)."""
    return assemble(survey(config), sigmas)


# ---------------------------------------------------------------- suggestions and output


def suggestion(sv: Survey, current: MemoryPlan, capacity: float, reserve: float, sigmas: float) -> str:
    """One line on what would make the step fit (or that it fits)."""
    if current.fits(capacity, reserve):
        return "fits."
    k = current.accumulate
    while current.physical_batch > 1:
        k *= 2
        trial = assemble(sv, sigmas, accumulate=k)
        if trial.fits(capacity, reserve):
            return (
                f"does not fit: set trainer.accumulate_grad_batches={k} (physical batch {trial.physical_batch}, "
                f"{trial.peak / GB:.1f} GB; same q and privacy)."
            )
        if trial.physical_batch == 1:
            break
    if sv.settings.model_args.get("lora") is None:
        return "does not fit even at physical batch 1: fine-tune with LoRA (model.init_args.lora: {r: 16, ...})."
    if sv.settings.engine == "instantiate":
        return "does not fit even at physical batch 1: use clipping_engine: book_keeping (or auto)."
    return "does not fit even at physical batch 1: a smaller model, bf16-true precision, or a larger GPU."


def table(p: MemoryPlan) -> str:
    """The plan as a text table: component, phase, GB, note; then the phase totals and the peak."""
    rows = [(c.name, PHASES[c.phase], f"{c.gb:8.3f}", c.note) for c in p.components]
    widths = [max(len(r[i]) for r in [("component", "phase", "GB", ""), *rows]) for i in range(3)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) if i < 3 else cell for i, (cell, w) in enumerate(zip(cells, [*widths, 0])))

    out = [line(("component", "phase", "GB".rjust(widths[2]), "note")), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    phases = ", ".join(f"{PHASES[ph]} {p.phase_bytes(ph) / GB:.3f}" for ph in ("forward", "backward", "optimizer"))
    out.append(f"static {p.phase_bytes('static') / GB:.3f} GB + max({phases}) GB")
    out.append(f"estimated peak: {p.peak / GB:.3f} GB ({PHASES[p.peak_phase]})")
    return "\n".join(out)


def header(p: MemoryPlan) -> str:
    """What the plan is for, in three lines."""
    margin = f"b + {p.sigmas:g}√b" if p.sigmas else "b"
    return "\n".join(
        [
            f"model: {p.parameters:,} parameters ({p.trainable:,} trainable); {p.notes[0]}",
            f"precision {p.precision}, engine {p.engine} ({p.engines['book_keeping']} layers book-keeping, "
            f"{p.engines['instantiate']} formed), optimizer {p.optimizer.rsplit('.', 1)[-1]} ({p.optimizer_states} "
            "states/param)",
            f"batch: expected b={p.expected_batch} per process, planned {margin} over {p.accumulate} micro-batches "
            f"-> physical batch {p.physical_batch} x T={p.tokens} tokens",
        ]
    )


def __getattr__(name: str) -> Any:
    """``main``, the CLI entry that moved to :mod:`dplightning.commands.memory_plan`, is still importable here.

    Loaded on first access (PEP 562) because the command imports this module, not the other way round.
    """
    if name == "main":
        from dplightning.commands.memory_plan import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    from dplightning.commands.memory_plan import main as _main

    sys.exit(_main())
