"""PNG figures of the statistics callbacks, drawn with matplotlib's Agg canvas (no pyplot, no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_MAX_PANELS = 4  # per_layer clipping on a large model has many groups; draw the first few


def _figure(rows: int, height: float = 2.6) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]


def plot_clipping(
    path: Path,
    steps: Sequence[int],
    edges: Sequence[float],
    counts: Mapping[str, np.ndarray],
    clip_fraction: Sequence[float],
) -> Path:
    """Norm distribution over training (one heat map per clip group) and the clip fraction per window.

    Args:
        path: The PNG to write.
        steps: Steps done at the end of each logged window (window t covers (steps[t-1], steps[t]]).
        edges: Bin edges in units of the group's bound C; counts have one more bin for > edges[-1].
        counts: Per clip group, counts ``[windows, bins + 1]``.
        clip_fraction: Share of examples clipped in each window.
    """
    groups = list(counts)[:_MAX_PANELS]
    fig, axes = _figure(len(groups) + 1)
    x = np.array([0, *steps], dtype=float)
    y = np.array([*edges, edges[-1] + (edges[-1] - edges[-2])])
    for ax, group in zip(axes, groups, strict=False):  # the last axes is the clip fraction
        c = counts[group].astype(float)
        share = c / np.maximum(c.sum(axis=1, keepdims=True), 1.0)
        mesh = ax.pcolormesh(x, y, share.T, cmap="viridis", vmin=0.0)
        fig.colorbar(mesh, ax=ax, label="share of examples")
        ax.axhline(1.0, color="white", linestyle="--", linewidth=1)
        ax.axhline(edges[-1], color="0.7", linewidth=0.8)
        ax.set_ylabel(f"‖g‖ / C  ({group})")
        ax.set_title(f"per-example gradient norm / C (top row: > {edges[-1]:g}, dashed: C) — NOT private", fontsize=9)
    ax = axes[-1]
    ax.plot(steps, clip_fraction, marker="o" if len(steps) < 40 else None, markersize=3)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlim(0, max(steps))
    ax.set_ylabel("clip fraction")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return path


def plot_tail_stats(path: Path, steps: Sequence[int], records: Sequence[Mapping[str, Mapping[str, float]]]) -> Path:
    """Per-group quantiles, Hill tail index and clipping share over training.

    Args:
        path: The PNG to write.
        steps: Steps done at the end of each window.
        records: Per window, ``{group: {statistic: value}}`` as logged by ``GradientTailStats``.
    """
    fig, (quantiles, hill, share) = _figure(3)
    groups = list(records[0])
    colors = {g: f"C{i}" for i, g in enumerate(groups)}
    for group in groups:
        stats = [r[group] for r in records]
        for key, style in (("p50", ":"), ("p99", "-"), ("max", "--")):
            if key in stats[0]:
                quantiles.plot(steps, [s[key] for s in stats], style, color=colors[group], label=f"{group} {key}")
        hill.plot(steps, [s["hill_alpha"] for s in stats], color=colors[group], label=group)
        if "clip_share" in stats[0]:
            share.plot(steps, [s["clip_share"] for s in stats], color=colors[group], label=group)
    quantiles.set_yscale("log")
    quantiles.set_ylabel("‖g‖  (p50 dotted, p99, max dashed)")
    quantiles.set_title("per-example gradient norms by parameter group — NOT private", fontsize=9)
    hill.set_ylabel("Hill tail index α")
    share.set_ylabel("share of clipping")
    share.set_xlabel("optimizer step")
    for ax in (quantiles, hill, share):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    fig.savefig(path, dpi=100)
    return path
