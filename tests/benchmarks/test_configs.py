"""benchmarks/_configs.py: a config's digest, part of the method experiments' record identity."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def configs(benchmark_module: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_module("_configs")


def _write(path: Path, model_class: str, lr: float = 0.1) -> Path:
    config = {"model": {"class_path": model_class, "init_args": {"optimizer": {"init_args": {"lr": lr}}}}}
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_tasks_rename_keeps_a_config_s_digest(configs: ModuleType, tmp_path: Path) -> None:
    """``dplightning.tasks.X`` digests as ``dplightning.modules.X`` (issue 26's rename): old records still resume."""
    new = _write(tmp_path / "new.yaml", "dplightning.tasks.classifier.ImageClassifier")
    old = _write(tmp_path / "old.yaml", "dplightning.modules.classifier.ImageClassifier")
    assert configs.config_digest(new) == configs.config_digest(old)
    assert "dplightning.modules.classifier.ImageClassifier" in configs.config_digest(new)
    assert configs.config_digest(_write(tmp_path / "lr.yaml", "dplightning.tasks.classifier.ImageClassifier", 0.2)) != (
        configs.config_digest(new)
    )


@pytest.mark.parametrize("config", ["configs/grape/vit_digits_dp_adam.yaml", "configs/grape/vit_digits_dp_grape.yaml"])
def test_a_shipped_config_digests_as_before_the_rename(configs: ModuleType, config: str) -> None:
    """The shipped configs name ``dplightning.tasks``; their digest is that of the file naming the old path."""
    text = (ROOT / config).read_text()
    assert "dplightning.tasks." in text
    expected = yaml.safe_load(text.replace("dplightning.tasks.", "dplightning.modules."))
    assert configs.config_digest(config) == configs.json.dumps(expected, sort_keys=True)
