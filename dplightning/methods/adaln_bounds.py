"""DP-aware AdaLN-Zero's bounds from information outside the private training data, and the vacuous-arm rule.

The spec says not to set c_max, γ_max, β_max, α_max from statistics of the private data unless that release is
accounted for. Issue 24 (item 3) sets them from the validation months instead: a model of the same architecture
(the arm's network with every bound off, freshly initialised) is trained on the validation windows only, without
DP or (``noise_multiplier``) with DP-SGD like the private run, and each bound is put at the 95th percentile of
what it bounds there:

* c_max: of ‖c̃‖ per example, c̃ the vector the L2 ball projects (t_emb + ctx, or ctx with ``project="ctx"``);
* γ_max, β_max, α_max: of |γ̃|, |β̃|, |α̃|, the raw (pre-bound) modulation coordinates, pooled over every block
  and the final layer (which has no gate).

The statistics are taken with training-time masks and diffusion steps (the distribution the bounds meet in
training), by forward hooks on the network's own modules. The bounds are then frozen and written as a YAML
overlay for the arm's config. Nothing reads the training split: the windows come from ``val_dataloader()``
and the model is re-initialised. The one training-split quantity involved is the data's scaler, which every
run uses and declares anyway (``dp_not_covered``); pass public ``mean``/``std`` to the data to avoid it.

:func:`vacuity` is the pre-registered rule applied to the bind fractions that
:class:`~dplightning.callbacks.AdaLNBindFractions` logs in every run.

python -m dplightning.methods.adaln_bounds calibrate --config configs/timeseries/ARM.yaml --out bounds.yaml \
    [-- --model.init_args.center context_mean ...]
python -m dplightning.methods.adaln_bounds vacuity lightning_logs/.../metrics.csv
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import yaml
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dplightning.models.adaln import (
    AdaLNFinalLayer,
    AdaLNZeroBlock,
    BoundMode,
    L2BallProjection,
    ModulationBounds,
    ModulationKind,
    modulation_chunks,
)
from dplightning.privacy.noise import derive_seed
from dplightning.tasks.timeseries_diffusion import DPTimeSeriesDiffusion

QUANTILE = 0.95
"""The pre-registered percentile of the calibration."""
PROJECTION_BAND = (0.01, 0.20)
"""The share of examples the projection must bind on for the arm to count: [1 %, 20 %]."""
MODULATION_BAND = (0.01, 0.10)
"""The share of coordinates each modulation bound must bind on: [1 %, 10 %]."""
MODULATION_KINDS: tuple[ModulationKind, ...] = ("gamma", "beta", "alpha")
RUN_PREFIX = "nonprivate/adaln_bind/run/"
"""The prefix of the run-level bind fractions :class:`~dplightning.callbacks.AdaLNBindFractions` logs."""


# ------------------------------------------------------------------ the unbounded twin


def bounded_layers(network: nn.Module) -> tuple[list[L2BallProjection], list[AdaLNZeroBlock | AdaLNFinalLayer]]:
    """The projections and the AdaLN layers (blocks and final layer) of ``network``."""
    projections = [m for m in network.modules() if isinstance(m, L2BallProjection)]
    layers = [m for m in network.modules() if isinstance(m, (AdaLNZeroBlock, AdaLNFinalLayer))]
    return projections, layers


def unbounded_twin(module: DPTimeSeriesDiffusion, seed: int = 0) -> DPTimeSeriesDiffusion:
    """A copy of ``module`` whose network has every bound off and fresh weights (seeded).

    The weights are re-initialised so that nothing a given module may have learnt (e.g. on the private
    training data) reaches the calibration.

    Raises:
        TypeError: If the network has no ``init_weights`` or no AdaLN layer.
    """
    twin = copy.deepcopy(module)
    network = twin.model
    projections, layers = bounded_layers(network)
    init_weights = getattr(network, "init_weights", None)
    if not layers or not callable(init_weights):
        raise TypeError(
            f"{type(network).__name__} has no AdaLN-Zero layer or no init_weights(): expected a network such as "
            "dplightning.models.TimeSeriesDiT."
        )
    for projection in projections:
        projection.c_max = None
    for layer in layers:
        layer.bounds = ModulationBounds(mode=layer.bounds.mode)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init_weights()
    return twin


def bound_mode_of(network: nn.Module) -> BoundMode:
    """The bound mode (``soft``/``hard``) of the network's AdaLN layers."""
    _, layers = bounded_layers(network)
    return layers[0].bounds.mode if layers else "soft"


# ------------------------------------------------------------------ training on the validation windows


def fit_on_windows(
    module: DPTimeSeriesDiffusion,
    windows: Dataset,
    steps: int,
    batch_size: int = 64,
    seed: int = 0,
    accelerator: str = "cpu",
    noise_multiplier: float | None = None,
    max_grad_norm: float = 1.0,
) -> DPTimeSeriesDiffusion:
    """Train ``module`` for ``steps`` steps on ``windows`` (shuffled, seeded); return it.

    ``windows`` must be held-out data (the validation windows). By default the model trains without DP. With
    ``noise_multiplier`` it trains with DP-SGD at that σ, clipping bound ``max_grad_norm`` and expected batch
    ``batch_size`` (Poisson sampling over ``windows``): the regime of a private run, whose conditioning values
    stay far smaller than a non-private model's. The DP here only mimics that regime; the held-out windows are
    not protected by it.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}.")
    if noise_multiplier is not None and not (noise_multiplier >= 0 and max_grad_norm > 0):
        raise ValueError(f"need noise_multiplier >= 0 and max_grad_norm > 0, got {noise_multiplier}, {max_grad_norm}.")
    strategy: Any = "auto"
    if noise_multiplier is not None:
        from dplightning.strategies.single_device import DPStrategy  # the strategies import the tasks' package

        with warnings.catch_warnings():
            # Seeded noise on purpose: this DP protects nothing (held-out data), it only mimics the private run's
            # regime, and the frozen bounds must be reproducible from the seed.
            warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")
            # RDP: the end-of-fit ε line is not used here, and PRV takes minutes at sigma <= 0.1.
            strategy = DPStrategy(
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, seed=seed, accountant="rdp"
            )
    pl.seed_everything(seed, verbose=False)  # t, ε and the training masks of the fit
    loader = DataLoader(
        windows, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed), drop_last=False
    )
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    return module


# ------------------------------------------------------------------ the statistics


@dataclass
class ConditioningValues:
    """What the bounds bound, on a set of windows.

    Attributes:
        c_norms: ``[N]`` ‖c̃‖ of each window (one draw of t and of the mask per window).
        raw: Kind -> |raw modulation| of every coordinate, pooled over the layers (1-d, float64).
    """

    c_norms: np.ndarray
    raw: dict[str, np.ndarray]


@contextmanager
def recording(network: nn.Module) -> Iterator[tuple[list[Tensor], dict[str, list[Tensor]]]]:
    """Collect ‖c̃‖ (per example) and |raw modulation| (by kind) of every forward while inside the block.

    Forward hooks on the projection (its input is c̃) and on each AdaLN layer's ``adaLN_modulation`` (its
    output is the raw modulation), removed on exit.
    """
    norms: list[Tensor] = []
    raw: dict[str, list[Tensor]] = {k: [] for k in MODULATION_KINDS}
    projections, layers = bounded_layers(network)

    def on_projection(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        norms.append(torch.linalg.vector_norm(args[0].detach(), dim=-1).double().cpu())

    def on_modulation(layer: AdaLNZeroBlock | AdaLNFinalLayer) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            for kind, chunk in modulation_chunks(output.detach(), layer.MODULATION_KINDS):
                raw[kind].append(chunk.abs().double().flatten().cpu())

        return hook

    handles = [p.register_forward_hook(on_projection) for p in projections]
    handles += [layer.adaLN_modulation.register_forward_hook(on_modulation(layer)) for layer in layers]
    try:
        yield norms, raw
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def conditioning_values(
    module: DPTimeSeriesDiffusion, windows: Dataset, batch_size: int = 256, seed: int = 0
) -> ConditioningValues:
    """‖c̃‖ and |raw modulation| of ``module`` on every window, with training-time masks and steps (seeded).

    Each window is passed once through the module's own training loss (centring, parameterisation and
    masks as in training), with t, ε and the mask drawn from a generator seeded by ``seed``.
    """
    was_training = module.training
    module.eval()
    generator = torch.Generator().manual_seed(derive_seed(seed, "adaln_bounds"))
    device = next(module.parameters()).device
    try:
        with recording(module.model) as (norms, raw):
            for batch in DataLoader(windows, batch_size=batch_size, shuffle=False):
                batch = batch.to(device) if isinstance(batch, Tensor) else [t.to(device) for t in batch]
                x, observed, target = module.unpack_windows(batch)
                cond = module.conditioning_mask(observed, generator)
                module.per_example_loss(x, observed, cond, generator, target)
    finally:
        module.train(was_training)
    return ConditioningValues(
        torch.cat(norms).numpy() if norms else np.zeros(0),
        {k: torch.cat(v).numpy() for k, v in raw.items() if v},
    )


# ------------------------------------------------------------------ the calibrated bounds


@dataclass(frozen=True)
class CalibratedBounds:
    """Bounds set at a percentile of a non-private model's values on held-out windows; frozen once written.

    Attributes:
        c_max: Radius of the condition's L2 ball.
        bounds: γ_max, β_max, α_max and the mode.
        quantile: The percentile (0.95).
        windows: Windows the values were taken on.
        steps: Steps the calibration model was trained.
        seed: The seed of its initialisation, training and statistics.
        regime: How it was trained: ``"non-private"`` or ``"DP-SGD sigma=..., C=..., expected batch ..."``.
    """

    c_max: float
    bounds: ModulationBounds
    quantile: float
    windows: int
    steps: int
    seed: int
    regime: str = "non-private"

    def init_args(self) -> dict[str, float]:
        """The network's arguments these bounds set (``TimeSeriesDiT``'s names)."""
        b = self.bounds
        values = {"c_max": self.c_max, "gamma_max": b.gamma_max, "beta_max": b.beta_max, "alpha_max": b.alpha_max}
        return {k: float(f"{v:.6g}") for k, v in values.items() if v is not None}

    def to_yaml(self, source: str = "") -> str:
        """A config overlay (``--config ARM.yaml --config this.yaml``) that sets the bounds, with its provenance."""
        header = [
            "# DP-aware AdaLN-Zero bounds set from the validation months only (frozen):",
            f"# the {100 * self.quantile:g}th percentiles of ||c~|| and of |raw gamma|, |raw beta|, |raw alpha| of a",
            f"# {self.regime} model of the same architecture (bounds off),",
            f"# trained {self.steps} steps (seed {self.seed})",
            f"# on {self.windows} windows of validation rows alone (none holds a training row).",
            "# Overlay: dplightning fit --config ARM.yaml --config THIS.yaml",
        ]
        if source:
            header.append(f"# Calibrated with: {source}")
        body = {"model": {"init_args": {"model": {"init_args": self.init_args()}}}}
        return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)


def percentile_bounds(values: ConditioningValues, quantile: float, mode: BoundMode) -> tuple[float, ModulationBounds]:
    """(c_max, bounds) at ``quantile`` of ``values`` (numpy's linear interpolation).

    Raises:
        ValueError: If a percentile is not positive (e.g. the modulation never left its zero init).
    """
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}.")
    found = {"c_max": values.c_norms, **{f"{k}_max": values.raw.get(k, np.zeros(0)) for k in MODULATION_KINDS}}
    limits: dict[str, float] = {}
    for name, sample in found.items():
        if sample.size == 0:
            raise ValueError(f"No value for {name}: the network has no projection or no such modulation.")
        limits[name] = float(np.quantile(sample, quantile))
        if not limits[name] > 0:
            raise ValueError(
                f"The {quantile:g} quantile for {name} is {limits[name]}: the calibration model did not move it "
                "from its zero init; train it for more steps."
            )
    bounds = ModulationBounds(limits["gamma_max"], limits["beta_max"], limits["alpha_max"], mode)
    return limits["c_max"], bounds


def calibrate_bounds(
    template: DPTimeSeriesDiffusion,
    windows: Dataset,
    steps: int = 600,
    batch_size: int = 64,
    quantile: float = QUANTILE,
    seed: int = 0,
    accelerator: str = "cpu",
    noise_multiplier: float | None = None,
    max_grad_norm: float = 1.0,
) -> CalibratedBounds:
    """Train the unbounded twin of ``template`` on held-out ``windows`` and set the bounds at ``quantile``.

    Args:
        template: The arm's module (task, centring, parameterisation, optimizer and network as configured);
            it is copied, never trained.
        windows: Held-out windows, e.g. ``datamodule.calibration_set`` (:func:`calibration_windows`).
        steps: Training steps of the non-private model.
        batch_size: Its batch size.
        quantile: The percentile of the bounds.
        seed: Seeds the initialisation, the training and the statistics' draws.
        accelerator: Where it trains.
        noise_multiplier: Train it with DP-SGD at this σ (``None``: without DP), so that the bounds meet the
            values of a model trained like the private one; see :func:`fit_on_windows`.
        max_grad_norm: Its clipping bound under DP.

    Returns:
        The frozen bounds, with the template's bound mode.
    """
    twin = unbounded_twin(template, seed)
    model = fit_on_windows(twin, windows, steps, batch_size, seed, accelerator, noise_multiplier, max_grad_norm)
    values = conditioning_values(model, windows, seed=seed)
    c_max, bounds = percentile_bounds(values, quantile, bound_mode_of(template.model))
    regime = "non-private"
    if noise_multiplier is not None:
        regime = f"DP-SGD (sigma={noise_multiplier:g}, C={max_grad_norm:g}, expected batch {batch_size})"
    return CalibratedBounds(c_max, bounds, quantile, len(values.c_norms), steps, seed, regime)


def calibration_windows(datamodule: pl.LightningDataModule) -> Dataset:
    """The data module's ``calibration_set``: windows of held-out rows alone, never a training row.

    Raises:
        TypeError: If the data module has none. Its validation loader is not enough: a validation
            split may start inside the training rows (ETT's starts ``input_len`` rows early, so that its
            first forecast has an input), and bounds calibrated on it would depend on training data.
    """
    windows = getattr(datamodule, "calibration_set", None)
    if not isinstance(windows, Dataset):
        raise TypeError(
            f"{type(datamodule).__name__} has no calibration_set: give it a property that returns windows of "
            "public or held-out rows only (ETTDataModule.calibration_set: the validation months without the "
            "training rows its first windows read). The validation loader may overlap the training rows."
        )
    return windows


# ------------------------------------------------------------------ the vacuous-arm rule


@dataclass(frozen=True)
class Vacuity:
    """The verdict on one arm's bounds.

    Attributes:
        vacuous: True: the arm is declared vacuous and is not reported as a result.
        reasons: One line per bound outside its band.
        fractions: The fractions judged.
    """

    vacuous: bool
    reasons: tuple[str, ...]
    fractions: dict[str, float]


def vacuity(fractions: Mapping[str, float]) -> Vacuity:
    """The pre-registered rule: is an arm's set of bounds vacuous?

    Each bound the arm has is judged on the share it binds on over the whole training run
    (:attr:`~dplightning.callbacks.AdaLNBindFractions.run_fractions`): the projection on the share of examples
    with ‖c̃‖ > c_max, which must lie in [1 %, 20 %]; γ, β, α each on the share of raw coordinates beyond the
    bound, which must lie in [1 %, 10 %]. Below the band a bound hardly acts, so the arm is DP-vanilla in
    disguise; above it the bound rewrites the model rather than trimming its tail. The arm is vacuous if any
    of its bounds is outside its band (every bound has to do what it is there for).

    Args:
        fractions: Bound name (``projection``, ``gamma``, ``beta``, ``alpha``) -> share; a bound the arm does
            not have is left out.

    Raises:
        ValueError: If no fraction is given (the callback was not in the run: the rule cannot be applied),
            a name is unknown or a share is not in [0, 1].
    """
    if not fractions:
        raise ValueError("No bind fraction to judge: add dplightning.callbacks.AdaLNBindFractions to the run.")
    reasons: list[str] = []
    for name, share in fractions.items():
        if name != "projection" and name not in MODULATION_KINDS:
            raise ValueError(f"Unknown bound {name!r}; expected projection, gamma, beta or alpha.")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"The share of {name} must be in [0, 1], got {share}.")
        low, high = PROJECTION_BAND if name == "projection" else MODULATION_BAND
        unit = "examples" if name == "projection" else "coordinates"
        if share < low:
            reasons.append(f"{name} binds on {share:.2%} of {unit} < {low:.0%}: it hardly acts")
        elif share > high:
            reasons.append(f"{name} binds on {share:.2%} of {unit} > {high:.0%}: it rewrites the model")
    return Vacuity(bool(reasons), tuple(reasons), dict(fractions))


def run_fractions_from_csv(path: str | Path) -> dict[str, float]:
    """The run-level bind fractions in a ``CSVLogger`` ``metrics.csv`` (the last value of each column)."""
    found: dict[str, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key and key.startswith(RUN_PREFIX) and value not in ("", None):
                    found[key[len(RUN_PREFIX) :]] = float(value)
    return found


# ------------------------------------------------------------------ command line


def _calibrate(args: argparse.Namespace) -> int:
    from dplightning.cli import build_cli  # the CLI builds model and data exactly as `dplightning fit` would

    argv = [item for config in args.config for item in ("--config", config)] + list(args.overrides)
    argv += ["--trainer.logger", "false"]
    cli = build_cli(argv, run=False)
    if not isinstance(cli.model, DPTimeSeriesDiffusion) or cli.datamodule is None:
        raise TypeError("The config must give a DPTimeSeriesDiffusion model and a data module (ETTDataModule).")
    windows = calibration_windows(cli.datamodule)
    result = calibrate_bounds(
        cli.model, windows, args.steps, args.batch_size, args.quantile, args.seed, args.accelerator,
        args.noise_multiplier, args.max_grad_norm,
    )  # fmt: skip
    configs = " ".join(f"--config {config}" for config in args.config)
    overrides = f" -- {' '.join(args.overrides)}" if args.overrides else ""
    command = (
        f"python -m dplightning.methods.adaln_bounds calibrate {configs} --steps {args.steps} "
        f"--batch-size {args.batch_size} --quantile {args.quantile} --seed {args.seed}"
    )
    if args.noise_multiplier is not None:
        command += f" --noise-multiplier {args.noise_multiplier:g} --max-grad-norm {args.max_grad_norm:g}"
    command += overrides
    text = result.to_yaml(command)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


def _vacuity(args: argparse.Namespace) -> int:
    verdict = vacuity(run_fractions_from_csv(args.metrics))
    print(json.dumps(asdict(verdict), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dplightning.methods.adaln_bounds {calibrate,vacuity} ...``."""
    parser = argparse.ArgumentParser(
        prog="python -m dplightning.methods.adaln_bounds", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cal = commands.add_parser(
        "calibrate", help="Set the bounds from a non-private model trained on validation windows."
    )
    cal.add_argument("--config", action="append", required=True, help="The arm's config (repeat for overlays).")
    cal.add_argument("--steps", type=int, default=600, help="Training steps of the non-private model (%(default)s).")
    cal.add_argument("--batch-size", type=int, default=64, help="Its batch size (%(default)s).")
    cal.add_argument("--quantile", type=float, default=QUANTILE, help="The percentile (%(default)s).")
    cal.add_argument("--seed", type=int, default=0, help="Initialisation, training and statistics (%(default)s).")
    cal.add_argument("--accelerator", default="cpu", help="Where the model trains (%(default)s).")
    cal.add_argument(
        "--noise-multiplier", type=float, default=None,
        help="Train the calibration model with DP-SGD at this sigma, like the private run (default: no DP).",
    )  # fmt: skip
    cal.add_argument("--max-grad-norm", type=float, default=1.0, help="Its clipping bound C (%(default)s).")
    cal.add_argument("--out", help="Write the YAML overlay here (it is printed either way).")
    cal.add_argument(
        "overrides", nargs="*", help="LightningCLI arguments after `--`, e.g. --model.init_args.center ..."
    )
    vac = commands.add_parser("vacuity", help="Apply the vacuous-arm rule to a run's metrics.csv.")
    vac.add_argument("metrics", help="The CSVLogger metrics.csv of a run with AdaLNBindFractions.")
    args = parser.parse_args(argv)
    return _calibrate(args) if args.command == "calibrate" else _vacuity(args)


if __name__ == "__main__":
    raise SystemExit(main())
