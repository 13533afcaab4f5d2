"""configs/dpdm: the CPU configs are the regime the comparison protocol measured, and the regime table says so.

``digits_eps10.yaml`` is the K = 4 arm of ``benchmarks/dpdm_protocol.py`` (network, expected batch,
steps, C, ε, lr as selected); ``mnist5k_eps10.yaml`` keeps its network and lr; and the rows of
``benchmarks/dpdm_regime.py`` that describe the configs describe these files.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "dpdm"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("dpdm_protocol"), importlib.import_module("dpdm_regime")


def _net(config: dict[str, Any]) -> dict[str, Any]:
    args = dict(config["model"]["init_args"]["net"]["init_args"])
    return {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}


def test_digits_config_is_the_protocols_k4_arm(bench: tuple[Any, Any]) -> None:
    protocol, _ = bench
    config = _load("digits_eps10.yaml")
    model, strategy = config["model"]["init_args"], config["trainer"]["strategy"]["init_args"]
    assert _net(config) == {"image_size": 8, **protocol.NET}
    assert model["noise_multiplicity"] == protocol.E2_K == 4
    assert (
        config["data"]["init_args"]["batch_size"] == protocol.BATCH and config["trainer"]["max_steps"] == protocol.STEPS
    )
    assert strategy["target_epsilon"] == protocol.E1_EPSILON and strategy["max_grad_norm"] == protocol.MAX_GRAD_NORM
    assert model["optimizer"]["init_args"]["lr"] in protocol.LRS
    record = ROOT / "benchmarks" / "results" / "dpdm_digits_cpu_k.json"
    if record.exists():  # the lr the protocol selected for K = 4, once its record is committed
        import json

        selected = json.loads(record.read_text())["selection"]["K=4"]["hparams"]["lr"]
        assert model["optimizer"]["init_args"]["lr"] == selected


@pytest.mark.parametrize(("config", "row"), [("digits_eps10.yaml", "digits_eps10.yaml (now)"),
                                             ("mnist5k_eps10.yaml", "mnist5k_eps10.yaml (now, 14x14)")])  # fmt: skip
def test_regime_rows_describe_the_configs(bench: tuple[Any, Any], config: str, row: str) -> None:
    _, regime = bench
    setting = next(s for s in regime.SETTINGS if s.name == row)
    c = _load(config)
    net = _net(c)
    assert {**setting.net, "ch_mult": tuple(setting.net["ch_mult"])} == net
    assert setting.batch == c["data"]["init_args"]["batch_size"] and setting.steps == c["trainer"]["max_steps"]
    assert setting.epsilon == c["trainer"]["strategy"]["init_args"]["target_epsilon"]
