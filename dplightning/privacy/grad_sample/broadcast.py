"""Embeddings looked up once for the whole batch and broadcast over it, where that is known to be exact.

Hugging Face's default position ids have shape ``[1, T]``: GPT-2 computes
``inputs_embeds + self.wpe(position_ids)`` and BERT ``embeddings + self.position_embeddings(position_ids)``,
so the ``[1, T, d]`` lookup is broadcast over the ``[n, T, d]`` batch *after* the
embedding, where autograd sums the examples' gradients into one. Looking the ids up once
per example (``[n, T]``) gives the same output and lets every example backpropagate
into its own copy, which is exact **only because** the copy is then added elementwise to
that example's own row. A model that reduces over the copies instead
(``emb(arange(T)[None])[0]``, ``.mean(0)``) would hand each copy other examples'
gradients, and the sum over examples (what the gradient verification checks) would still
be right. So the per-example lookup is used only for the (container, attribute) pairs
listed here, each read in its container's ``forward``; any other embedding called with a
``[1, ...]`` index tensor in a batch of several examples is refused at its first call.
"""

from __future__ import annotations

from torch import nn

_BROADCAST_EMBEDDINGS: dict[str, set[str]] = {
    # container class (module.qualname) -> attributes whose [1, T] lookup is added to a batch-first [n, T, d]
    "transformers.models.gpt2.modeling_gpt2.GPT2Model": {"wpe"},
    "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoModel": {"wpe"},
    "transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeModel": {"wpe"},
    "transformers.models.bert.modeling_bert.BertEmbeddings": {"position_embeddings"},
    "transformers.models.electra.modeling_electra.ElectraEmbeddings": {"position_embeddings"},
    "transformers.models.distilbert.modeling_distilbert.Embeddings": {"position_embeddings"},
}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_broadcast_embedding(cls: type[nn.Module], *attributes: str) -> None:
    """Declare that ``cls.forward`` adds the ``[1, ...]`` lookups of these embeddings to a batch-first tensor.

    Each named child must be an ``nn.Embedding`` whose output, when it is called with a
    ``[1, ...]`` index tensor, is combined elementwise with a ``[n, ...]`` tensor whose row
    ``i`` is example ``i`` (a broadcast ``+`` or ``*``), and used nowhere else. Then looking
    the ids up once per example is exact. Declaring anything else (an output indexed
    ``[0]``, averaged or summed over its first dimension) would give each example other
    examples' gradients: only declare what you have read in the ``forward``.

    Args:
        cls: The container module class.
        *attributes: Names of its embedding children.
    """
    if not attributes:
        raise ValueError("Name at least one embedding attribute of the container.")
    _BROADCAST_EMBEDDINGS.setdefault(_qualified(cls), set()).update(attributes)


def broadcast_embeddings(module: nn.Module) -> set[nn.Module]:
    """The embeddings inside ``module`` declared to be broadcast exactly (see :func:`register_broadcast_embedding`)."""
    found: set[nn.Module] = set()
    for container in module.modules():
        for name in _BROADCAST_EMBEDDINGS.get(_qualified(type(container)), ()):
            child = getattr(container, name, None)
            if isinstance(child, nn.Embedding):
                found.add(child)
    return found
