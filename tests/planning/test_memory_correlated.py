"""memory-plan's correlated-noise component: b - 1 buffers of the noised size for band_mf, m for BLT."""

from __future__ import annotations

from typing import Any

import pytest

from dplightning.planning.memory import plan
from tests.planning.test_memory import component, fit_config


@pytest.mark.parametrize(
    ("args", "buffers"),
    [({"noise_mechanism": "band_mf", "bands": 4}, 3), ({"noise_mechanism": "blt", "blt_buffers": 2}, 2)],
)
def test_correlated_noise_state_is_planned(args: dict[str, Any], buffers: int) -> None:
    config = fit_config()
    config["trainer"]["strategy"]["init_args"].update(args)
    p, gaussian = plan(config), plan(fit_config())
    assert component(p, "correlated noise state") == buffers * 4 * p.trainable
    assert p.peak == pytest.approx(gaussian.peak + buffers * 4 * p.trainable)
    assert "correlated noise state" not in [c.name for c in gaussian.components]
