"""Activations per transformer layer: what autograd and the hooks keep alive at the end of the forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dplightning.planning.memory.settings import (
    Precision,
)


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
