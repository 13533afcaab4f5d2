"""Clipping in two backward passes over one graph (``clip_replay=True``).

Flat clipping weights each example's gradient by a factor that depends on its norm over all
layers, so one backward pass must hold every layer's per-example factors (its inputs and output
gradients) until the pass ends: on a Linear stack with long inputs, about as much memory again as
the activations. Here the first pass keeps each example's squared norm per parameter only: a
layer's factors become norms and are freed as soon as the layer's backward is done. A replay of
the same backward pass (its graph retained) then hands each call's per-example gradients over once
more, and they are weighted by the now known clip factors and added at once.

No per-example loss is needed: the replay recomputes the very output gradients of the first pass,
which the hooks check bit for bit (:meth:`PerExampleHooks.replay`), so every factor is applied to
the gradient whose norm it was taken from. A parameter whose norm cannot be taken layer by layer
(shared by several layers: its norm has cross terms; or of a layer with a call the backward pass
never reached) is held and clipped as in one pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor, nn

from dplightning.privacy.grad_sample import PerExampleGrad, PerExampleHooks
from dplightning.privacy.mechanism import GradientPrivatizer, MicroBatchStats, common_rows


class ClipReplay:
    """The two passes of one micro-batch's clipping for the clip groups that span layers.

    Args:
        privatizer: Receives the clipped sums.
        hooks: The per-example hooks (their first pass must fingerprint the output gradients).
        streamed: Per layer, its parameters whose norms are taken when it is done (owned by that layer
            alone, in a clip group this replay clips).
        rows_per_unit: Consecutive rows that form one privacy unit.
        scale: From the captured gradients to each unit's own gradient (see ``GradientPrivatizer.accumulate``).
    """

    def __init__(
        self,
        privatizer: GradientPrivatizer,
        hooks: PerExampleHooks,
        streamed: Mapping[nn.Module, Sequence[nn.Parameter]],
        rows_per_unit: int,
        scale: float,
    ) -> None:
        self._privatizer, self._hooks, self._streamed_params = privatizer, hooks, streamed
        self._k, self._scale = rows_per_unit, scale
        self._sq: dict[nn.Parameter, Tensor] = {}

    def layer_done(self, layer: nn.Module) -> None:
        """The first pass is done with ``layer``: keep its parameters' per-unit squared norms, free the rest."""
        params = self._streamed_params.get(layer)
        if params:
            for p, g in self._hooks.take(params, self._k).items():
                self._sq[p] = g.sq_norms()

    def run(self, backward: Callable[[], None], groups: Sequence[int]) -> MicroBatchStats:
        """After the first pass: clip factors from the norms, then the replay adds the clipped sums.

        Args:
            backward: Runs the replayed backward pass (the same loss, graph retained by the first).
            groups: The clip groups not clipped yet (those of this replay, and per-layer groups whose layer
                had a call the first pass never reached).

        Returns:
            The statistics of ``groups``.
        """
        privatizer = self._privatizer
        params = [p for j in groups for p in privatizer.groups[j].params if p not in self._sq]
        held = self._hooks.take(params, self._k)
        n = common_rows([*(v.shape[0] for v in self._sq.values()), *(g.rows for g in held.values())])
        param_sq = privatizer.sq_norm_table(held, n)
        for p, sq in self._sq.items():
            param_sq[:, privatizer.column(p)] = sq
        stats, factors = privatizer.clip(param_sq, self._scale, groups)
        for p, g in held.items():
            privatizer.add_clipped(p, g, factors)
        del held
        streamed, k = set(self._sq), self._k
        self._sq = {}

        def add(p: nn.Parameter, g: PerExampleGrad) -> None:
            if p in streamed:
                privatizer.add_clipped(p, g.units(k), factors)

        with self._hooks.replay(add):
            try:
                backward()
            except RuntimeError as err:
                if "second time" not in str(err):
                    raise
                raise RuntimeError(
                    "clip_replay=True replays the backward pass, but its graph was freed by the first: "
                    "LightningModule.backward must pass its arguments on to loss.backward (retain_graph=True). "
                    "Nothing of this step was released."
                ) from err
        return stats
