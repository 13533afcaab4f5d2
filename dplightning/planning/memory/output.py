"""Suggestions and output: what would make a step fit, and the plan as text."""

from __future__ import annotations

from dplightning.planning.memory.plan import (
    MemoryPlan,
    Survey,
    assemble,
)
from dplightning.planning.memory.units import GB, PHASES


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
