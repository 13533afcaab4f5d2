"""The DP strategies' arguments, written once: defaults, documentation and validation.

Both strategies take these arguments next to their Lightning ones. They are declared
once, as the fields of :class:`DPConfig`; :func:`dp_arguments` adds them to a strategy's
``__init__`` signature and ``Args:`` docstring, which is what ``LightningCLI`` reads for
``--trainer.strategy.help`` and YAML validation.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal, TypeVar, get_type_hints

from dplightning.privacy.accounting import check_accountant
from dplightning.privacy.clipping import available_clipping
from dplightning.privacy.grad_sample import GRAD_SAMPLE_MODES, available_engines

NOISE_PLACEMENTS = {
    "rank0": "rank 0 adds N(0, (σΔ)²); the other ranks add none",
    "split": "every rank adds N(0, (σΔ)²/W) from its own generator; the variances sum to (σΔ)²",
}
NOISE_MECHANISMS = {
    "gaussian": "independent N(0, (σΔ)²) at every step (DP-SGD)",
    "band_mf": "correlated noise of a column-normalised banded matrix factorization with cyclic Poisson sampling "
    "(amplified accounting)",
    "blt": "correlated noise of a buffered linear Toeplitz factorization with cyclic Poisson sampling (no "
    "amplification: one Gaussian mechanism over the whole run)",
}
VERIFY_GRADIENTS = {
    "first_steps": "the first steps with data, and the first steps after the trainable parameters change",
    "always": "every backward pass",
    "never": "no check",
}

_DOCS = {
    "noise_multiplier": "σ, the noise std in units of the sensitivity. Exactly one of ``noise_multiplier`` and "
    "``target_epsilon``; 0 disables noise (ε = inf).",
    "target_epsilon": "ε to reach at the end of training; σ is calibrated from ``max_epochs``/``max_steps``, q "
    "and δ when fit starts.",
    "max_grad_norm": "Clipping bound C (the joint sensitivity for group clipping).",
    "delta": "δ; default 1/(10·N) with N the training set size.",
    "accountant": '``"prv"`` (default), ``"rdp"`` or ``"gdp"`` (Opacus\' accountants).',
    "clipping": '``"flat"`` (one norm over all parameters), ``"per_layer"`` or ``"per_matrix"`` (each weight '
    "matrix its own group, the rest one group); an optimizer's DP plan may set its own groups.",
    "clipping_engine": '``"auto"`` (default: per layer, the ghost norm where it pays, else formed per-example '
    'gradients), ``"book_keeping"`` or ``"instantiate"``. The engine of every layer is printed at setup.',
    "clip_replay": "Clip the groups that span layers (flat clipping) in two backward passes over the same graph: the "
    "first takes the per-example norms and frees each layer's output gradients at once, the second, a replay of the "
    "first, adds the clipped sum. Peak memory near non-private instead of every layer's per-example factors held to "
    "the end of the backward pass, for one more backward pass (input gradients only). Automatic optimization only; "
    "the first (verified) steps hold as usual. See docs/clipping_engines.md.",
    "poisson_sampling": "Replace the train loader's sampler by Poisson sampling with q = batch_size x world_size "
    "/ N. ``False`` keeps the loader and reports ε = inf.",
    "secure_mode": "Draw noise and sampling decisions from the OS CSPRNG (slow).",
    "loss_reduction": '``"mean"`` if ``training_step`` averages the loss over the privacy units of the batch '
    '(the usual case), ``"sum"`` if it sums it.',
    "grad_sample_mode": '``"functorch"`` (default): registered per-layer samplers and engines where they exist, '
    "``torch.func`` for any other layer (named in the engine table, checked by the gradient verification like every "
    'layer); ``"hooks"``: registered samplers only, a trainable layer without one is refused.',
    "verify_gradients": "Check that autograd's gradient equals the sum of the per-example gradients, and refuse to "
    'train if not (a contribution escaped the per-example hooks): ``"first_steps"`` (default: the first steps with '
    'data, and again after the trainable parameters change), ``"always"`` or ``"never"``.',
    "bucket_cap_mb": "Size of the fp32 buckets that are noised (and, across processes, all-reduced).",
    "seed": "FOR TESTS ONLY. Noise and sampling seeds otherwise come from OS entropy (expanded per seed, rank and "
    "step); a seed lets whoever knows it subtract the noise.",
    "privacy_journal": "Folder for a durable journal of the noisy steps (one fsynced line per step, written at the "
    "release). On resume, steps that a killed attempt released after its last checkpoint are charged to the ledger "
    "too, so ε also covers what was released from the weights between checkpoints (validation metrics, logs). "
    "``None`` (default): the ledger covers the weights that checkpoints hold.",
    "noise_mechanism": '``"gaussian"`` (default, DP-SGD), ``"band_mf"`` (banded matrix factorization: noise '
    "correlated over ``bands`` steps so that much of it cancels in the running sum; amplified by cyclic Poisson "
    'sampling over ``cyclic_partitions`` partitions) or ``"blt"`` (buffered linear Toeplitz with ``blt_buffers`` '
    "buffers, accounted without amplification). See docs/correlated_noise.md.",
    "bands": 'Number of bands b of ``noise_mechanism="band_mf"`` (b - 1 secret buffers of the noised size).',
    "blt_buffers": 'Number of buffers of ``noise_mechanism="blt"`` (that many secret buffers of the noised size).',
    "cyclic_partitions": "Partitions of the cyclic Poisson sampler of a correlated noise mechanism: the data are "
    "split into this many fixed partitions and step t samples partition t mod it, so an example participates at "
    'most once every that many steps. Default: ``bands`` for ``"band_mf"``; required for ``"blt"``.',
    "init_from": "A checkpoint of an earlier DP run to start from: its weights are loaded at the start of fit and "
    "its privacy ledger is carried as a prior segment, so ε composes over both runs (fine-tuning a private model "
    "on the same data). Read without running code from the file. Ignored when resuming (the resumed ledger holds "
    "the prior already). Not with ``target_epsilon`` (σ would be calibrated as if the run started from nothing).",
    "noise_placement": '``"rank0"`` (default): rank 0 adds all the noise, so a test can regenerate it exactly; '
    '``"split"``: each rank adds N(0, (σΔ)²/W) from its own generator, which balances the work of drawing noise.',
}


@dataclass(frozen=True)
class DPConfig:
    """The DP arguments of a strategy, validated once when the strategy is built (see :data:`_DOCS`)."""

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    max_grad_norm: float = 1.0
    delta: float | None = None
    accountant: Literal["prv", "rdp", "gdp"] = "prv"
    clipping: str = "flat"
    clipping_engine: str = "auto"
    clip_replay: bool = False
    poisson_sampling: bool = True
    secure_mode: bool = False
    loss_reduction: Literal["mean", "sum"] = "mean"
    grad_sample_mode: Literal["hooks", "functorch"] = "functorch"
    verify_gradients: Literal["first_steps", "always", "never"] = "first_steps"
    bucket_cap_mb: float = 25.0
    seed: int | None = None
    noise_placement: Literal["rank0", "split"] = "rank0"
    privacy_journal: str | None = None
    noise_mechanism: Literal["gaussian", "band_mf", "blt"] = "gaussian"
    bands: int | None = None
    blt_buffers: int | None = None
    cyclic_partitions: int | None = None
    init_from: str | None = None

    def __post_init__(self) -> None:
        self._check_noise()
        if self.init_from is not None and self.target_epsilon is not None:
            raise ValueError(
                "init_from carries the earlier run's ledger, and target_epsilon would calibrate σ as if this run "
                "started from nothing: give noise_multiplier (and stop at a budget with PrivacyBudget), or train "
                "without init_from."
            )
        if not self.max_grad_norm > 0 or not math.isfinite(self.max_grad_norm):
            raise ValueError(f"max_grad_norm (the clipping bound C) must be finite and > 0, got {self.max_grad_norm}.")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}.")
        check_accountant(self.accountant)
        _check_choice("clipping", self.clipping, available_clipping())
        _check_choice("clipping_engine", self.clipping_engine, available_engines())
        _check_choice("loss_reduction", self.loss_reduction, ["mean", "sum"])
        _check_choice("grad_sample_mode", self.grad_sample_mode, sorted(GRAD_SAMPLE_MODES))
        _check_choice("verify_gradients", self.verify_gradients, sorted(VERIFY_GRADIENTS))
        _check_choice("noise_placement", self.noise_placement, sorted(NOISE_PLACEMENTS))
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}.")
        self._check_mechanism()

    @property
    def correlated(self) -> bool:
        """Whether the noise is correlated across steps (a matrix-factorization mechanism)."""
        return self.noise_mechanism != "gaussian"

    @property
    def partitions(self) -> int:
        """Partitions of the cyclic Poisson sampler (1: plain Poisson sampling, DP-SGD)."""
        if not self.correlated:
            return 1
        return self.cyclic_partitions if self.cyclic_partitions is not None else int(self.bands or 0)

    def _check_mechanism(self) -> None:
        _check_choice("noise_mechanism", self.noise_mechanism, sorted(NOISE_MECHANISMS))
        for name in ("bands", "blt_buffers", "cyclic_partitions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        mechanism = self.noise_mechanism
        stray = {
            "gaussian": ("bands", "blt_buffers", "cyclic_partitions"),
            "band_mf": ("blt_buffers",),
            "blt": ("bands",),
        }[mechanism]
        given = [name for name in stray if getattr(self, name) is not None]
        if given:
            raise ValueError(f"{given} do not apply to noise_mechanism={mechanism!r}; remove them.")
        if mechanism == "gaussian":
            return
        if mechanism == "band_mf" and self.bands is None:
            raise ValueError('noise_mechanism="band_mf" needs bands= (the number of bands b, e.g. 4).')
        if mechanism == "blt" and (self.blt_buffers is None or self.cyclic_partitions is None):
            raise ValueError(
                'noise_mechanism="blt" needs blt_buffers= (e.g. 2) and cyclic_partitions= (the minimum separation of '
                "an example's participations, which sets the sensitivity the noise is calibrated to)."
            )
        if mechanism == "band_mf" and self.bands > self.partitions:  # type: ignore[operator]
            raise ValueError(
                f"bands={self.bands} > cyclic_partitions={self.partitions}: an example could participate twice within "
                "the band of one column, which the amplified accounting of banded matrix factorization does not cover "
                "(Choquette-Choo et al. 2023 need bands <= partitions). Use cyclic_partitions >= bands."
            )
        if not self.poisson_sampling:
            raise ValueError(
                f"noise_mechanism={mechanism!r} needs poisson_sampling=True: its sensitivity and accounting rely on "
                "the cyclic Poisson sampler (each example at most once every cyclic_partitions steps)."
            )
        if self.privacy_journal is not None:
            raise ValueError(
                f"privacy_journal does not apply to noise_mechanism={mechanism!r}: a correlated-noise run cannot be "
                "resumed (its noise state is secret and never checkpointed), so there is nothing to charge on resume."
            )

    def _check_noise(self) -> None:
        sigma, eps = self.noise_multiplier, self.target_epsilon
        if (sigma is None) == (eps is None):
            raise ValueError(
                "Pass exactly one of noise_multiplier (σ) or target_epsilon (the ε to reach at the end of training), "
                f"got noise_multiplier={sigma}, target_epsilon={eps}."
            )
        if sigma is not None:
            if sigma < 0 or not math.isfinite(sigma):
                raise ValueError(f"noise_multiplier must be finite and >= 0, got {sigma}.")
            if sigma == 0:
                warnings.warn(
                    "noise_multiplier=0 adds no noise: ε is infinite (use it only for debugging).", stacklevel=5
                )
        if eps is not None:
            if not eps > 0 or not math.isfinite(eps):
                raise ValueError(f"target_epsilon must be finite and > 0, got {eps}.")
            if not self.poisson_sampling:
                raise ValueError("target_epsilon needs poisson_sampling=True: the accountant assumes Poisson sampling.")


def _check_choice(name: str, value: object, choices: list[str]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; choose one of {choices}.")


_C = TypeVar("_C", bound=type[Any])


def dp_arguments(exclude: tuple[str, ...] = ()) -> Callable[[_C], _C]:
    """Class decorator: the strategy's ``__init__`` takes :class:`DPConfig`'s fields as keyword arguments.

    The decorated ``__init__`` receives them in ``**dp`` (build ``DPConfig(**dp)`` from it).
    Its signature, as ``inspect.signature`` and LightningCLI see it, lists the DP fields
    first, then the strategy's own arguments; the class docstring's ``Args:`` section gets
    their documentation. ``exclude`` leaves out fields that do not apply to the strategy.
    """

    def decorate(cls: _C) -> _C:
        init = cls.__init__
        own = inspect.signature(init)
        kept = [f for f in fields(DPConfig) if f.name not in exclude]
        types = get_type_hints(DPConfig)  # resolved here: the strategy's module need not import Literal
        dp_params = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
            for f in kept
            if f.default is not MISSING
        ]
        others = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        positional, keyword = others[:1], [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in others[1:]]
        init.__signature__ = own.replace(parameters=[*positional, *dp_params, *keyword])
        docs = "".join(f"        {f.name}: {_DOCS[f.name]}\n" for f in kept)
        cls.__doc__ = (cls.__doc__ or "").replace("    Args:\n", "    Args:\n" + docs, 1)
        return cls

    return decorate
