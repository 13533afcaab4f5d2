"""The config: merging fit YAMLs as LightningCLI does, and the planning inputs read from them (DP defaults from
:class:`~dplightning.strategies.config.DPConfig`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml


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

    @property
    def param_dtype(self) -> Any:
        """The weights' storage dtype (a ``torch.dtype``; torch is imported only when it is asked for)."""
        import torch

        if self.param != 2:
            return {4: torch.float32, 8: torch.float64}[self.param]
        return torch.float16 if self.name.startswith("16") else torch.bfloat16


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
    max_grad_norm: float = 1.0
    """C, which an optimizer's DP plan is asked with."""
    clip_replay: bool = False
    """Flat clipping in two backward passes over a retained graph (``DPConfig.clip_replay``)."""


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
        model_class=str(model.get("class_path", "dplightning.tasks.DPCausalLM")),
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
        max_grad_norm=float(strategy["max_grad_norm"]),
        clip_replay=bool(strategy["clip_replay"]),
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
