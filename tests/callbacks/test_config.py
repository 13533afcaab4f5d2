"""The callbacks are configurable from YAML, as ``trainer.callbacks`` of the ``dplightning`` command."""

from __future__ import annotations

from pathlib import Path

import pytest

from dplightning.cli import build_cli

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
CALLBACKS = """
trainer:
  callbacks:
    - {class_path: dplightning.callbacks.PrivacyBudget, init_args: {target_epsilon: 2.0}}
    - {class_path: dplightning.callbacks.ClippingHistogram, init_args: {every_n_steps: 5, enabled: false}}
    - {class_path: dplightning.callbacks.GradientTailStats, init_args: {groups: {cond: ["model.head.*"]}}}
    - {class_path: dplightning.callbacks.PrivateClipFraction, init_args: {noise_multiplier: 10.0}}
"""


def test_callbacks_parse_from_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overlay = tmp_path / "callbacks.yaml"
    overlay.write_text(CALLBACKS)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(QUICKSTART), "--config", str(overlay), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for name in ("PrivacyBudget", "ClippingHistogram", "GradientTailStats", "PrivateClipFraction"):
        assert f"class_path: dplightning.callbacks.{name}" in printed
    assert "target_epsilon: 2.0" in printed and "- model.head.*" in printed and "enabled: false" in printed
