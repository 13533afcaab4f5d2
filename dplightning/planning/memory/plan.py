"""The plan: the components of each phase of the step, from a survey of the meta model, and its peak."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dplightning.planning.memory.activations import (
    ROLES,
    Dims,
    activation_bytes,
    dims_of,
    trained_roles,
)
from dplightning.planning.memory.grape import Projected, grape_projections
from dplightning.planning.memory.layers import Layer, _widths, hooked_layers
from dplightning.planning.memory.model import meta_model
from dplightning.planning.memory.per_example import clipping_transient, engine_store, forms_slot
from dplightning.planning.memory.settings import (
    Settings,
    physical_batch,
    settings_of,
)
from dplightning.planning.memory.states import OptimizerState, optimizer_state, per_element
from dplightning.planning.memory.units import DEFAULT_SIGMAS, GB, PHASES, Phase


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
        optimizer_states: State elements per trainable parameter (per slot element when the DP plan projects):
            2 for Adam; a fraction for a mix (DP-Muon: 1 per Muon matrix element, 2 per other).
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
    optimizer_states: int | float
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


def _static(
    s: Settings, params: int, trainable: int, state: OptimizerState, slots: int | None = None
) -> list[Component]:
    p = s.precision.param
    if slots is not None:  # DP-GRAPE: moments and buckets of the slots (projected weights r x max(m, n))
        note = f"{per_element(state.total, slots)} {state.dtype_names()} per slot element"
        return [
            Component("weights", params * p, "static", f"{params:,} parameters, {8 * p}-bit"),
            Component("optimizer states", state.bytes, "static", note),
            Component("DP buckets (clipped sum)", slots * 4, "static", f"fp32, {slots:,} slot elements"),
        ]
    # The dtype is named only when it is not the weights' (torch's optimizers keep theirs, DP-Muon fp32).
    dtypes = "" if set(state.elements) <= {s.precision.param_dtype} else f" {state.dtype_names()}"
    note = f"{per_element(state.total, trainable)}{dtypes} per trainable parameter"
    return [
        Component("weights", params * p, "static", f"{params:,} parameters, {8 * p}-bit"),
        Component("optimizer states", state.bytes, "static", note),
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


PER_EXAMPLE_STATE = ("layer inputs held by the hooks (A)", "output gradients kept (Δ)", "formed per-example gradients")
"""The backward phase's lines that make up the per-example state at the clip point."""


def replays(s: Settings) -> bool:
    """Whether the planned (peak) steps clip in two backward passes: ``clip_replay`` outside verification, flat."""
    return s.clip_replay and s.clipping == "flat" and s.verify == "never"


def _backward(
    s: Settings,
    layers: list[Layer],
    held: int,
    retained: int,
    rows: int,
    trainable: int,
    projected: Mapping[str, Projected] | None = None,
) -> list[Component]:
    t, prec = s.max_length, s.precision
    kept, formed = engine_store(layers, prec, s.engine, rows, t, projected)
    early = s.clipping in ("per_layer", "per_matrix") and s.verify == "never"
    replay = replays(s)
    if early or replay:  # each layer's Δ and g_i are done with when its backward is done
        # Under the replay a shared weight's calls are held as in one pass (PrivateStep's streamable table).
        shared = [x for x in layers if replay and x.calls > 1]
        kept, formed = engine_store(shared, prec, s.engine, rows, t, projected)
        per = [engine_store([x], prec, s.engine, rows, t, projected) for x in layers if x not in shared]
        kept += max((k for k, _ in per), default=0)
        formed += max((f for _, f in per), default=0)
    inputs, deltas, formed_name = PER_EXAMPLE_STATE
    if replay:  # the first pass keeps every saved tensor for the second (retain_graph)
        alive = Component("activations kept for the replay", retained, "backward", "clip_replay: graph retained")
    else:
        alive = Component(inputs, held, "backward", "until the clipped sum")
    out = [
        alive,
        Component(deltas, kept, "backward", f"book-keeping{', one layer' if early or replay else ''}"),
        Component(formed_name, formed, "backward", "biases, norms, instantiated weights"),
        Component(
            "clipping temporaries (fp32)", clipping_transient(layers, prec, s.engine, rows, t, projected), "backward"
        ),
    ]
    if s.verify != "never":
        note = "autograd's, first steps only (verify_gradients)"
        out.append(Component("gradients p.grad", trainable * prec.param, "backward", note))
    return out


def _probe(sv: Survey, components: list[Component]) -> list[Component]:
    """What the real pass leaves alive while the coupling probe replays it (first steps only; coupling.py).

    The smaller of a summary (one fp32 gradient of the privatized slots) and the pass' own per-example
    state, as ``coupling.summary_pays`` chooses, through the replay's forward and backward.
    """
    summary = (sv.slots if sv.slots is not None else sv.trainable) * 4
    state = sum(c.bytes for c in components if c.name in PER_EXAMPLE_STATE)
    name, size = ("the real pass' summary", summary) if summary < state else ("the real pass' per-example state", state)
    return [Component(f"coupling probe: {name}", size, phase, "first steps only") for phase in ("forward", "backward")]


def _optimizer(s: Settings, trainable: int, largest: int, states: float, slots: int | None = None) -> list[Component]:
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
    state: OptimizerState
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
    layers, roles = hooked_layers(model), trained_roles(model, d.arch)
    matmul = sum(m.weight.numel() for m in model.modules() if _widths(m)[0] == "linear")
    projections = grape_projections(model, s)
    # Last, because it casts the model: the optimizer sees its parameters in their storage dtype, as in the fit.
    state = optimizer_state(model.to(s.precision.param_dtype), s.optimizer, s.optimizer_args, s.max_grad_norm)
    return Survey(
        settings=s,
        dims=d,
        layers=layers,
        roles=roles,
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in trainable),
        largest=max((p.numel() for p in trainable), default=0),
        matmul=matmul,
        source=source,
        state=state,
        **projections,
    )


def assemble(sv: Survey, sigmas: float = DEFAULT_SIGMAS, accumulate: int | None = None) -> MemoryPlan:
    """The plan of a surveyed model (cheap: rerun it to try other batch splits)."""
    s = sv.settings if accumulate is None else replace(sv.settings, accumulate=accumulate)
    rows = physical_batch(s.batch_size, s.accumulate, sigmas, s.poisson)
    states = per_element(sv.state.total, sv.slots if sv.slots is not None else sv.trainable)
    head = any(x.name.endswith(("lm_head", "score", "classifier.out_proj")) for x in sv.layers)
    alive, _ = activation_bytes(sv.dims, s.precision, sv.roles, rows, s.max_length, head)
    # A formed slot frees its layer's input after that layer's backward, not before: the end
    # of the forward still has it, the end of the backward does not.
    _, held = activation_bytes(sv.dims, s.precision, sv.roles - formed_roles(sv, s), rows, s.max_length, head)
    retained = alive + 4 * rows * s.max_length * sv.dims.vocab  # and the loss' saved log-softmax (fp32)
    components = [
        *_static(s, sv.parameters, sv.trainable, sv.state, sv.slots),
        *_forward(s, sv.dims, sv.matmul, rows, alive),
        *_backward(s, sv.layers, held, retained, rows, sv.trainable, sv.projected),
        *_optimizer(s, sv.trainable, sv.largest, states, sv.slots),
    ]
    if s.verify != "never":
        components += _probe(sv, components)
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
    if sv.state.assumed:
        notes.append(f"optimizer state: {sv.state.assumed}")
    if not s.poisson:
        notes.append("poisson_sampling is off: fixed batches, no margin")
    if s.verify != "never":
        notes.append("verification steps (the first two) keep autograd's p.grad and clip after the backward")
        if s.clip_replay:
            notes.append("clip_replay: the steady steps replay the backward pass; the plan is the verified steps'")
    elif replays(s):
        notes.append("clip_replay: the whole graph is kept for the second backward pass; a shared weight is held")
    if s.world_size > 1:
        notes.append(f"{s.world_size} processes: batch_size is per process; the plan is per GPU (weights replicated)")
    return notes


def plan(config: Mapping[str, Any], sigmas: float = DEFAULT_SIGMAS) -> MemoryPlan:
    """The memory plan of a merged fit config (the mapping ``dplightning fit --config`` reads)."""
    return assemble(survey(config), sigmas)
